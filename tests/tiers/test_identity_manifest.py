"""The cache identity manifest of the FS and S3 tiers: recorded once at open, a different
identity refused (naming the field) or kept apart, racing openers settled by the conditional
create, a damaged manifest an error that leaves it as it was; never a block across identities."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import botocore.exceptions
import pytest

from devtools.weed_server import BUCKET, WeedServer, raw_client
from kvtier import CacheIdentity, IdentityMismatchError, ManifestError, SecondaryTier
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._layout import IDENTITY_NAME as FS_MANIFEST
from kvtier.tiers.s3._integrity import identity_key
from kvtier.tiers.s3._requests import get_bytes
from tests.support import run_cli, s3_tier

BLOCK = 4096
BASE = CacheIdentity(
    model="meta-llama/Llama-3.1-8B@main",
    kv_dtype="bfloat16",
    block_size=16,
    layout="NHD",
    parallel="tp=2 rank=0",
    positional="rope_theta=500000",
    extra={"adapter": "none"},
)
# One change per field: each must be refused, and none may reach another's blocks.
FLIPS: dict[str, dict[str, Any]] = {
    "model": {"model": "meta-llama/Llama-3.1-8B@other"},
    "kv_dtype": {"kv_dtype": "fp8_e4m3"},
    "block_size": {"block_size": 32},
    "layout": {"layout": "HND"},
    "parallel": {"parallel": "tp=2 rank=1"},
    "positional": {"positional": "rope_theta=10000"},
    "extra": {"extra": {"adapter": "lora-7"}},
    "kvtier_format": {"kvtier_format": 2},
}
TOKENS = list(range(64))


class Place:
    """Where a tier keeps its blocks (an FS folder or an S3 prefix), and its manifest."""

    def __init__(
        self, make: Callable[..., SecondaryTier], read: Any, write: Any, root: Path | None
    ) -> None:
        self.make, self.read_manifest, self.write_manifest, self.root = make, read, write, root


@pytest.fixture(params=["fs", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "fs":
        root = tmp_path / "cache"

        async def read_fs() -> bytes | None:
            path = root / FS_MANIFEST
            return path.read_bytes() if path.exists() else None

        async def write_fs(body: bytes) -> None:
            root.mkdir(exist_ok=True)
            (root / FS_MANIFEST).write_bytes(body)

        return Place(lambda **kw: FSTier(root, **kw), read_fs, write_fs, root)
    server: WeedServer = request.getfixturevalue("weed_server")
    prefix = f"t/{uuid.uuid4().hex}"

    async def read_s3() -> bytes | None:
        async with raw_client(server.endpoint_url) as client:
            try:
                return await get_bytes(client, BUCKET, identity_key(prefix))
            except botocore.exceptions.ClientError:
                return None

    async def write_s3(body: bytes) -> None:
        async with raw_client(server.endpoint_url) as client:
            await client.put_object(Bucket=BUCKET, Key=identity_key(prefix), Body=body)

    return Place(lambda **kw: s3_tier(server, prefix, **kw), read_s3, write_s3, None)


async def test_each_changed_field_is_refused_or_kept_apart(place: Place) -> None:
    base_key = BASE.block_keys(TOKENS)[0]
    payload = bytes(range(256)) * (BLOCK // 256)
    async with place.make(identity=BASE) as tier:
        await tier.store(base_key, memoryview(payload))
    recorded = await place.read_manifest()
    assert recorded is not None and CacheIdentity.from_manifest(recorded) == BASE

    for name, change in FLIPS.items():
        other = dataclasses.replace(BASE, **change)
        (other_key,) = other.block_keys(TOKENS[: other.block_size])
        assert other_key != base_key  # the keys carry the identity: never a hit across it
        with pytest.raises(IdentityMismatchError) as caught:
            await place.make(identity=other).open()
        assert [d[0] for d in caught.value.differences] == [name]
        assert name in str(caught.value)
        async with place.make(identity=other, separate_identities=True) as apart:
            assert await apart.contains_many([base_key, other_key]) == [False, False]
            await apart.store(other_key, memoryview(payload[::-1]))
            out = bytearray(BLOCK)
            await apart.load(other_key, memoryview(out))
            assert bytes(out) == payload[::-1]
        assert await place.read_manifest() == recorded  # never rewritten

    async with place.make(identity=BASE) as tier:  # the first identity's block is intact
        out = bytearray(BLOCK)
        await tier.load(base_key, memoryview(out))
        assert bytes(out) == payload
        others = [dataclasses.replace(BASE, **c).block_keys(TOKENS)[0] for c in FLIPS.values()]
        assert not any(await tier.contains_many(others))


async def test_racing_openers_same_identity_all_open_different_one_refused(place: Place) -> None:
    opened: list[str] = []
    refused: list[IdentityMismatchError] = []
    all_tried = anyio.Event()  # each tier stays open until every opener has tried

    async def open_one(identity: CacheIdentity, label: str) -> None:
        tier = place.make(identity=identity, name=label)
        try:
            await tier.open()
        except IdentityMismatchError as exc:
            refused.append(exc)
        else:
            opened.append(label)
        if len(opened) + len(refused) == 5:
            all_tried.set()
        await all_tried.wait()
        await tier.aclose()

    other = dataclasses.replace(BASE, kv_dtype="float16")
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(open_one, BASE, f"base{i}")
        tg.start_soon(open_one, other, "other")
    recorded = await place.read_manifest()
    assert recorded is not None
    winner = CacheIdentity.from_manifest(recorded)
    if winner == BASE:
        assert sorted(opened) == [f"base{i}" for i in range(4)]
    else:  # the other identity created the manifest first: every BASE opener is refused
        assert winner == other and opened == ["other"]
    assert len(refused) == 5 - len(opened)
    assert all([d[0] for d in exc.differences] == ["kv_dtype"] for exc in refused)


@pytest.mark.parametrize(
    "damage",
    [
        b"{not json",
        b"",
        b"[]",
        json.dumps({"format": "kvtier-identity", "version": 1, "identity": {}}).encode(),
        json.dumps(
            {"format": "kvtier-identity", "version": 1, "identity": {**BASE.fields(), "x": 1}}
        ).encode(),
        json.dumps(
            {
                "format": "kvtier-identity",
                "version": 1,
                "identity": {**BASE.fields(), "block_size": "16"},
            }
        ).encode(),
        json.dumps({"format": "kvtier-identity", "version": 9, "identity": BASE.fields()}).encode(),
        BASE.manifest() + b" " * (64 * 1024),
    ],
    ids=["garbage", "empty", "list", "no-fields", "extra-field", "bad-type", "newer", "huge"],
)
async def test_a_damaged_manifest_is_an_error_and_stays(place: Place, damage: bytes) -> None:
    async with place.make(identity=BASE):
        pass  # a folder (prefix) kvtier made, with a manifest, now damaged
    await place.write_manifest(damage)
    with pytest.raises(ManifestError):
        await place.make(identity=BASE).open()
    assert await place.read_manifest() == damage


async def test_a_tier_without_an_identity_vouches_and_writes_no_manifest(place: Place) -> None:
    async with place.make() as tier:
        await tier.store(BASE.block_keys(TOKENS)[0], memoryview(bytes(BLOCK)))
    assert await place.read_manifest() is None
    async with place.make(identity=BASE):  # recorded by the first tier given an identity
        pass
    async with place.make():  # and a vouching tier still opens
        pass
    assert await place.read_manifest() == BASE.manifest()


async def test_inspect_shows_the_identity(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "cache", identity=BASE):
        pass
    code, out, _ = run_cli("inspect", str(tmp_path / "cache"), "--json")
    assert code == 0 and json.loads(out)["identity"] == BASE.fields()
    code, out, _ = run_cli("inspect", str(tmp_path / "cache"))
    assert "kv_dtype='bfloat16'" in out
    (tmp_path / "cache" / FS_MANIFEST).write_bytes(b"{damaged")
    code, out, _ = run_cli("inspect", str(tmp_path / "cache"), "--json")
    assert "not a cache identity manifest" in json.loads(out)["identity"]["error"]


async def test_a_file_system_without_hard_links_still_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)  # as on a file system with no hard links
    async with FSTier(tmp_path / "cache", identity=BASE):
        pass
    assert (tmp_path / "cache" / FS_MANIFEST).read_bytes() == BASE.manifest()
    assert not [p for p in (tmp_path / "cache").iterdir() if "tmp" in p.name]
    with pytest.raises(IdentityMismatchError):
        await FSTier(tmp_path / "cache", identity=dataclasses.replace(BASE, layout="HND")).open()
