"""CacheIdentity: what it accepts, the keys it derives (one field apart, no key shared), and the
manifest it writes and reads back, refusing anything else."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvtier import CacheIdentity, InvalidArgumentError, ManifestError, block_keys
from kvtier.common._identity import MAX_MANIFEST_BYTES, check_manifest, scoped_name

BASE = CacheIdentity("org/model@rev", "bfloat16", 16, layout="NHD", extra={"b": "2", "a": "1"})
CHANGES: list[dict[str, Any]] = [
    {"model": "org/model@rev2"},
    {"kv_dtype": "float16"},
    {"block_size": 32},
    {"layout": "HND"},
    {"parallel": "tp=2 rank=0"},
    {"positional": "rope_theta=10000"},
    {"extra": {"b": "2", "a": "x"}},
    {"kvtier_format": 2},
]


def test_each_field_changes_every_key() -> None:
    tokens = list(range(128))
    keys = set(BASE.block_keys(tokens))
    names = {scoped_name(BASE)}
    for change in CHANGES:
        other = dataclasses.replace(BASE, **change)
        assert other != BASE and other.digest != BASE.digest
        assert keys.isdisjoint(other.block_keys(tokens))
        assert [d[0] for d in BASE.differences(other)] == list(change)
        names.add(scoped_name(other))
    assert len(names) == len(CHANGES) + 1


def test_keys_are_those_of_block_keys_under_the_identity() -> None:
    tokens = list(range(64))
    assert BASE.block_keys(tokens) == block_keys(tokens, 16, namespace=BASE)
    assert BASE.block_keys(tokens) == block_keys(tokens, 16, namespace=BASE.namespace)
    assert BASE.block_keys(tokens) != block_keys(tokens, 16)  # a bare namespace: vouched for
    with pytest.raises(InvalidArgumentError, match="block_size"):
        block_keys(tokens, 8, namespace=BASE)


def test_extra_order_does_not_matter_and_identities_hash() -> None:
    same = CacheIdentity("org/model@rev", "bfloat16", 16, layout="NHD", extra={"a": "1", "b": "2"})
    assert same == BASE and hash(same) == hash(BASE) and same.digest == BASE.digest
    assert list(BASE.extra) == ["a", "b"]
    with pytest.raises(TypeError):
        BASE.extra["c"] = "3"  # type: ignore[index]


@pytest.mark.parametrize(
    "bad",
    [
        {"model": ""},
        {"kv_dtype": 16},
        {"block_size": 0},
        {"block_size": True},
        {"block_size": 16.0},
        {"layout": "x" * 300},
        {"parallel": ""},
        {"extra": {"bad name": "x"}},
        {"extra": {"a": 1}},
        {"extra": {f"k{i}": "v" for i in range(40)}},
        {"kvtier_format": -1},
    ],
)
def test_invalid_fields_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        dataclasses.replace(BASE, **bad)


def test_manifest_round_trip() -> None:
    raw = BASE.manifest()
    assert len(raw) < MAX_MANIFEST_BYTES
    assert CacheIdentity.from_manifest(raw) == BASE
    check_manifest(raw, BASE, "here")


def _with(**identity: Any) -> bytes:
    fields = {**BASE.fields(), **identity}
    return json.dumps({"format": "kvtier-identity", "version": 1, "identity": fields}).encode()


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"\xff\xfe", "not a cache identity manifest"),
        (b"null", "not a cache identity manifest"),
        (b'{"format": "kvtier-fs", "version": 1, "identity": {}}', "not a cache identity"),
        (_with(block_size=-4), "invalid identity"),
        (_with(extra=["a"]), "invalid identity"),
        (_with(model=None), "invalid identity"),
        (BASE.manifest().replace(b'"version": 1', b'"version": 2'), "version 2"),
        (b" " * (MAX_MANIFEST_BYTES + 1), "more than any kvtier writes"),
    ],
)
def test_a_manifest_that_is_not_valid_is_refused(raw: bytes, says: str) -> None:
    with pytest.raises(ManifestError, match=says):
        CacheIdentity.from_manifest(raw)
