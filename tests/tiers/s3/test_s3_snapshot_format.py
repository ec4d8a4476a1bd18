"""The index snapshot format (``kvtier.tiers.s3.index._snapshot_format``): names and bytes read
from an untrusted bucket are parsed exactly, and whatever a snapshot holds is refused whole or read
within its bounds."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import IntegrityKey
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index._snapshot_format import (
    Manifest,
    SnapshotError,
    body_digest,
    claim_name,
    data_name,
    decode_body,
    decode_manifest,
    encode_body,
    encode_manifest,
    manifest_name,
    parse_name,
    snapshot_dir,
)
from tests.support import fresh_keys

PREFIX = "fleet/model"
WRITER = "0123456789abcdef"


def _manifest(body: bytes, generation: int = 3) -> Manifest:
    return Manifest(generation, 1_700_000_000_000, len(body), body_digest(body), WRITER)


def test_names_parse_back_and_nothing_else_does() -> None:
    claim = parse_name(claim_name(PREFIX, 7), PREFIX)
    assert claim is not None and (claim.kind, claim.generation, claim.writer) == ("claim", 7, None)
    parsed = parse_name(data_name(PREFIX, 7, WRITER), PREFIX)
    assert parsed is not None and (parsed.kind, parsed.generation, parsed.writer) == (
        "data",
        7,
        WRITER,
    )
    gen = parse_name(manifest_name(PREFIX, 12), PREFIX)
    assert gen is not None and (gen.kind, gen.generation, gen.writer) == ("gen", 12, None)
    folder = snapshot_dir(PREFIX)
    for name in (
        manifest_name("other", 1),  # another prefix
        f"{folder}gen-1",  # not 12 digits
        f"{folder}gen-000000000001-{WRITER}",  # a manifest has no writer
        f"{folder}data-000000000001",  # a body has one
        f"{folder}x/gen-000000000001",  # nested
        f"{folder}gen-000000000001/../x",
    ):
        assert parse_name(name, PREFIX) is None, name


@pytest.mark.parametrize("key", [None, IntegrityKey(b"k" * 32)])
def test_a_snapshot_round_trips_and_any_change_is_refused(key: IntegrityKey | None) -> None:
    keys = fresh_keys(40)
    pack = pack_name(PREFIX, keys[0], WRITER, 1)
    entries: list[tuple[bytes, Location | None]] = [
        (k, Location(pack, 4096 + 100 * i, 100) if i % 2 else None) for i, k in enumerate(keys)
    ]
    body = encode_body(entries, PREFIX, integrity_key=key)
    manifest = _manifest(body)
    encoded = encode_manifest(manifest, PREFIX, integrity_key=key)
    assert decode_manifest(encoded, PREFIX, 3, integrity_key=key) == manifest
    assert decode_body(body, PREFIX, manifest, integrity_key=key) == (entries, 0)
    with pytest.raises(SnapshotError):
        decode_manifest(encoded, PREFIX, 4, integrity_key=key)  # published under another name
    flipped = body[:-3] + bytes([body[-3] ^ 1]) + body[-2:]
    with pytest.raises(SnapshotError):
        decode_body(flipped, PREFIX, manifest, integrity_key=key)
    with pytest.raises(SnapshotError):  # the body checks out, but under its own digest
        decode_body(flipped, PREFIX, _manifest(flipped), integrity_key=key)
    other = IntegrityKey(b"o" * 32)
    with pytest.raises(SnapshotError):
        decode_manifest(encoded, PREFIX, 3, integrity_key=other)


def test_a_chunk_claiming_more_than_the_body_holds_is_refused() -> None:
    body = encode_body([(k, None) for k in fresh_keys(3)], PREFIX)
    forged = body[:4] + struct.pack("<I", 1 << 31) + body[8:]
    with pytest.raises(SnapshotError):
        decode_body(forged, PREFIX, _manifest(forged))


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_snapshot_error(data: bytes) -> None:
    for attempt in (
        lambda: decode_manifest(data, PREFIX, 1),
        lambda: decode_body(data, PREFIX, _manifest(data)),
        lambda: decode_body(b"KVB1" + data, PREFIX, _manifest(b"KVB1" + data)),
    ):
        try:
            attempt()
        except SnapshotError:
            pass
