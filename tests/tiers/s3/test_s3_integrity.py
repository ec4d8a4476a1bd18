"""The S3 tier's integrity key: signed objects, forgeries refused, the prefix's marker, the
secret never shown.

The threat: anyone who can write to the bucket prefix publishes a well-formed block for
someone else's key. Each test plays that writer with a raw client against a real SeaweedFS.
"""

from __future__ import annotations

import json
import logging
import os

import anyio
import anyio.lowlevel
import pytest

from devtools.weed_server import (
    ACCESS_KEY,
    BUCKET,
    REGION,
    SECRET_KEY,
    WeedServer,
    raw_client,
)
from kvtier import (
    BlockNotFoundError,
    CorruptBlockError,
    HostPool,
    IntegrityKey,
    InvalidArgumentError,
    KVTierConfig,
    LookupResult,
    OffloadScheduler,
)
from kvtier.common._format import FLAG_MAC, MAC_BYTES, decode_header, encode_header
from kvtier.manager import TieringManager
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3._codec import build_object, verify_into
from kvtier.tiers.s3._integrity import MARKER_NAME, marker_key
from kvtier.tiers.s3.index._existence import key_from_object
from tests.support import INDEX_BY_HAND, MakeS3Tier, fresh_keys
from tests.tiers.s3.s3_forge import forged_segment, forged_segment_name

BLOCK = 4096
SECRET = "correct horse battery staple 0123456789"
OTHER = "another secret, also long enough"


async def _get(endpoint_url: str, name: str) -> bytes | None:
    import botocore.exceptions

    async with raw_client(endpoint_url) as client:
        try:
            response = await client.get_object(Bucket=BUCKET, Key=name)
        except botocore.exceptions.ClientError:
            return None
        async with response["Body"] as body:
            data: bytes = await body.read()
    return data


async def _put(endpoint_url: str, name: str, body: bytes) -> None:
    async with raw_client(endpoint_url) as client:
        await client.put_object(Bucket=BUCKET, Key=name, Body=body)


# -- the codec, without a server -------------------------------------------------------------


def test_codec_signs_and_checks_the_mac() -> None:
    (key,) = fresh_keys(1)
    payload = os.urandom(BLOCK)
    ikey = IntegrityKey(SECRET)
    body, metadata, _ = build_object(key, memoryview(payload), integrity_key=ikey)
    assert decode_header(body, integrity_key=ikey).flags & FLAG_MAC
    meta = metadata["kvtier-checksum"]
    dst = bytearray(BLOCK)
    assert verify_into(body, key, memoryview(dst), meta, ikey)[0] is None and dst == payload
    refused = {
        "no key": verify_into(body, key, memoryview(bytearray(BLOCK)), meta)[0],
        "other key": verify_into(
            body, key, memoryview(bytearray(BLOCK)), meta, IntegrityKey(OTHER)
        )[0],
        "unsigned": verify_into(
            build_object(key, memoryview(payload))[0], key, memoryview(bytearray(BLOCK)), meta, ikey
        )[0],
    }
    assert refused["no key"] is not None and "has none" in refused["no key"]
    assert refused["other key"] is not None and "integrity check failed" in refused["other key"]
    assert refused["unsigned"] is not None and "not signed" in refused["unsigned"]


# -- signed round trip and sharing -----------------------------------------------------------


async def test_signed_round_trip_and_two_tiers_share(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    keys = fresh_keys(3)
    blocks = [os.urandom(BLOCK) for _ in keys]
    async with make_tier(integrity_key=SECRET, name="a") as a:
        for key, block in zip(keys, blocks, strict=True):
            await a.store(key, memoryview(block))
        raw = await _get(weed_server.endpoint_url, a.object_key(keys[0]))
        assert raw is not None
        header = decode_header(raw, integrity_key=IntegrityKey(SECRET))
        assert header.flags & FLAG_MAC and raw[header.size :] == blocks[0]
        out = bytearray(BLOCK)
        await a.load(keys[0], memoryview(out))
        assert out == blocks[0]
        texts = [repr(a), repr(a.statistics()), repr(a.integrity_key), repr(a.config)]
    marker = await _get(weed_server.endpoint_url, marker_key(prefix))
    assert marker is not None
    assert json.loads(marker) == {"mac": "blake3", "key_id": IntegrityKey(SECRET).key_id}
    # Another node with the same key (given as an IntegrityKey this time) reads them all; its
    # listing at open indexes the blocks and not the marker.
    async with make_tier(integrity_key=IntegrityKey(SECRET), name="b") as b:
        assert await b.wait_index_loaded()
        assert b.statistics().index_keys == 3
        for key, block in zip(keys, blocks, strict=True):
            assert b.lookup(key) is LookupResult.HIT
            out = bytearray(BLOCK)
            await b.load(key, memoryview(out))
            assert out == block
        texts.append(repr(b))
    assert key_from_object(marker_key(prefix), prefix) is None
    assert "signed=True" in texts[0]
    texts.extend(record.getMessage() for record in caplog.records)
    assert not any(SECRET in text for text in texts)


# -- forgeries ----------------------------------------------------------------------------


def _forgeries(keys: list[bytes], good: bytes) -> dict[str, bytes]:
    """Well-formed objects that are not signed with the tier's key, one per key."""
    evil = b"\x66" * BLOCK
    signed_good = encode_header(keys[3], good, integrity_key=IntegrityKey(SECRET))
    return {
        "unsigned": encode_header(keys[0], evil) + evil,
        "other key": encode_header(keys[1], evil, integrity_key=IntegrityKey(OTHER)) + evil,
        # the real key's MAC pasted onto a header of the other key's forgery
        "stolen mac": encode_header(keys[2], evil, integrity_key=IntegrityKey(OTHER))[:-MAC_BYTES]
        + signed_good[-MAC_BYTES:]
        + evil,
        # a genuine signed header, its payload swapped
        "swapped payload": signed_good + evil,
    }


async def test_forged_objects_are_corrupt_misses_never_served(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    keys = fresh_keys(4)
    good = os.urandom(BLOCK)
    async with make_tier(integrity_key=SECRET) as tier:
        forged = _forgeries(keys, good)
        for key, body in zip(keys, forged.values(), strict=True):
            await _put(weed_server.endpoint_url, tier.object_key(key), body)
        errors: dict[str, str] = {}
        for key, kind in zip(keys, forged, strict=True):
            with pytest.raises(CorruptBlockError) as err:
                await tier.load(key, memoryview(bytearray(BLOCK)))
            errors[kind] = str(err.value)
        assert tier.statistics().failures_by_reason == {"corrupt": 4}
        with anyio.fail_after(20):  # deleted in the tier's background
            while tier.statistics().corrupt_deleted < 4:
                await anyio.lowlevel.checkpoint()
    assert "not signed" in errors["unsigned"]
    for kind in ("other key", "stolen mac", "swapped payload"):
        assert "integrity check failed" in errors[kind], kind
    assert not any(SECRET in text or OTHER in text for text in errors.values())
    for key in keys:  # deleted, so no node keeps paying for them
        assert await _get(weed_server.endpoint_url, tier.object_key(key)) is None


async def test_a_forged_object_is_a_corrupt_miss_through_the_manager(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    keys = fresh_keys(4)
    tier = make_tier(integrity_key=SECRET, lookup_mode="ask")  # the HEAD finds the forgery
    async with TieringManager(HostPool(4, BLOCK), [tier]) as manager:
        body = _forgeries(keys, os.urandom(BLOCK))["unsigned"]
        await _put(weed_server.endpoint_url, tier.object_key(keys[0]), body)
        assert manager.lookup(keys[0]) is LookupResult.RETRY
        assert await OffloadScheduler(manager).lookup([keys[0]], timeout=20) == 0
        assert manager.lookup(keys[0]) is LookupResult.MISS
        assert manager.statistics().promotions.failed_by_reason == {"corrupt": 1}


# -- the prefix's marker --------------------------------------------------------------------


async def test_another_key_or_no_key_refuses_the_prefix(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    (key,) = fresh_keys(1)
    block = os.urandom(BLOCK)
    async with make_tier(integrity_key=SECRET) as tier:
        await tier.store(key, memoryview(block))
    with pytest.raises(InvalidArgumentError, match="another integrity key") as other:
        await make_tier(integrity_key=OTHER).open()
    with pytest.raises(InvalidArgumentError, match=r"set integrity_key \(KVTIER_INTEGRITY_KEY\)"):
        await make_tier().open()
    assert IntegrityKey(SECRET).key_id in str(other.value)  # public: says which key to find
    assert SECRET not in str(other.value) and OTHER not in str(other.value)
    # Refused at open: nothing was called corrupt, the block is still there and still served.
    assert await _get(weed_server.endpoint_url, tier.object_key(key)) is not None
    async with make_tier(integrity_key=SECRET) as again:
        out = bytearray(BLOCK)
        await again.load(key, memoryview(out))
        assert out == block


@pytest.mark.parametrize("packed", [False, True])
async def test_a_signing_tier_refuses_a_prefix_of_unsigned_blocks(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, packed: bool
) -> None:
    keys = fresh_keys(2 if packed else 1)
    blocks = [os.urandom(BLOCK) for _ in keys]
    async with make_tier() as plain:
        async with anyio.create_task_group() as tg:  # stored together: one pack
            for key, block in zip(keys, blocks, strict=True):
                tg.start_soon(plain.store, key, memoryview(block))
        stats = plain.statistics()
        assert (stats.stores, stats.packs_written) == (len(keys), int(packed))
    with pytest.raises(InvalidArgumentError, match="holds unsigned blocks"):
        await make_tier(integrity_key=SECRET).open()
    assert await _get(weed_server.endpoint_url, marker_key(prefix)) is None  # not claimed
    async with make_tier() as again:  # the unsigned nodes carry on as before
        assert await again.wait_index_loaded()  # a packed block is loaded from its pack
        for key, block in zip(keys, blocks, strict=True):
            out = bytearray(BLOCK)
            await again.load(key, memoryview(out))
            assert out == block


async def test_a_tier_without_a_key_leaves_signed_blocks_in_place(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    """A keyless node that opened before a signing node claimed the prefix cannot check signed
    blocks: a corrupt miss for it, but not deleted (they may be its peers')."""
    (key,) = fresh_keys(1)
    block = os.urandom(BLOCK)
    async with make_tier() as plain:
        signed = encode_header(key, block, integrity_key=IntegrityKey(SECRET)) + block
        await _put(weed_server.endpoint_url, plain.object_key(key), signed)
        with pytest.raises(CorruptBlockError, match="this reader has none"):
            await plain.load(key, memoryview(bytearray(BLOCK)))
        assert plain.statistics().corrupt_deleted == 0
    assert await _get(weed_server.endpoint_url, plain.object_key(key)) == signed


async def test_racing_claims_of_an_empty_prefix_agree(make_tier: MakeS3Tier) -> None:
    """Two nodes with different keys open an empty prefix at once: one claims it, the other
    refuses; two with the same key both open."""
    opened: list[str] = []
    refused: list[str] = []
    secrets = [SECRET, OTHER, SECRET]
    tiers = [make_tier(integrity_key=secret) for secret in secrets]

    async def open_one(i: int) -> None:
        try:
            async with tiers[i]:  # a tier is opened and closed in one task
                opened.append(secrets[i])
        except InvalidArgumentError as exc:
            refused.append(str(exc))

    async with anyio.create_task_group() as tg:
        for i in range(len(tiers)):
            tg.start_soon(open_one, i)
    assert len(refused) in (1, 2) and len(opened) == 3 - len(refused), (opened, refused)
    assert len(set(opened)) == 1  # one key won; every tier with it opened
    assert opened.count(SECRET) in (0, 2)
    assert all("another integrity key" in text for text in refused)


async def test_an_unreadable_marker_refuses_every_tier(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    await _put(weed_server.endpoint_url, marker_key(prefix), b"{not json")
    for ikey in (None, SECRET):
        with pytest.raises(InvalidArgumentError, match=f"{MARKER_NAME} is not an integrity marker"):
            await make_tier(integrity_key=ikey).open()


# -- configuration ---------------------------------------------------------------------------


async def test_config_from_the_environment_builds_a_signing_s3_tier(
    weed_server: WeedServer, prefix: str
) -> None:
    env = {
        "KVTIER_POOL_NUM_BLOCKS": "4",
        "KVTIER_POOL_BLOCK_BYTES": str(BLOCK),
        "KVTIER_S3_BUCKET": BUCKET,
        "KVTIER_S3_PREFIX": prefix,
        "KVTIER_S3_ENDPOINT_URL": weed_server.endpoint_url,
        "KVTIER_S3_REGION_NAME": REGION,
        "KVTIER_S3_AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "KVTIER_S3_AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "KVTIER_INTEGRITY_KEY": SECRET,
    }
    (tier,) = KVTierConfig.from_env(env).build_tiers()
    assert isinstance(tier, S3Tier) and tier.integrity_key is not None
    assert tier.integrity_key.key_id == IntegrityKey(SECRET).key_id
    (key,) = fresh_keys(1)
    async with tier:
        await tier.store(key, memoryview(os.urandom(BLOCK)))
        assert SECRET not in repr(tier) and SECRET not in repr(tier.statistics())
    raw = await _get(weed_server.endpoint_url, tier.object_key(key))
    assert (
        raw is not None and decode_header(raw, integrity_key=IntegrityKey(SECRET)).flags & FLAG_MAC
    )


# -- the journal under a signing tier ------------------------------------------------------


async def test_a_signing_tier_ignores_unsigned_journal_segments(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    """Anyone who can write the prefix can publish a journal segment; under a signing tier
    only segments with a MAC under its key count. The attack: point a key at the prefix's
    marker, so that a node promoting it finds "not a block" and deletes the marker, after
    which every signing node refuses the prefix."""
    keys = fresh_keys(3)
    marker = marker_key(prefix)
    settings = {"integrity_key": SECRET, **INDEX_BY_HAND}
    async with make_tier(**settings) as reader:
        forged = forged_segment([(keys[0], marker, 100, 4200), (keys[1], "", 0, 0)])
        await _put(weed_server.endpoint_url, forged_segment_name(prefix), forged)
        await reader.refresh_index()
        for key in keys[:2]:
            assert reader.lookup(key) is LookupResult.MISS
            with pytest.raises(BlockNotFoundError):
                await reader.load(key, memoryview(bytearray(BLOCK)))
        assert reader.statistics().journal_segments_rejected == 1
    assert await _get(weed_server.endpoint_url, marker) is not None
    # A signing writer's segments still reach a signing reader.
    async with make_tier(**settings) as reader, make_tier(**settings) as writer:
        block = os.urandom(BLOCK)
        await writer.store(keys[2], memoryview(block))
        await writer.refresh_index()
        await reader.refresh_index()
        assert reader.lookup(keys[2]) is LookupResult.HIT
        out = bytearray(BLOCK)
        await reader.load(keys[2], memoryview(out))
        assert out == block
