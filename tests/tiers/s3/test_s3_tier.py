"""S3Tier against a real SeaweedFS server (``weed server`` with its S3 gateway) on 127.0.0.1,
no mock of the client.

One session-wide server serves most tests (each test uses its own key prefix, so tests do not
see each other's objects and can run in any order); tests that kill the server start their own.
moto remains only for the credential tests (its ThreadedMotoServer, real HTTP from a thread):
it can switch IAM auth on and reject keys, which SeaweedFS without configured identities does
not (it accepts any request).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import pytest

from devtools.moto_server import MotoServer, create_bucket, free_port
from devtools.moto_server import raw_client as moto_client
from devtools.weed_server import (
    ACCESS_KEY,
    BUCKET,
    SECRET_KEY,
    WeedServer,
    ensure_bucket,
    raw_client,
)
from kvtier import (
    BlockNotFoundError,
    CorruptBlockError,
    HostPool,
    InvalidArgumentError,
    LifecycleError,
    LookupResult,
    MissReason,
    OffloadScheduler,
    TierTimeoutError,
    TierUnavailableError,
    block_keys,
)
from kvtier.common._format import FORMAT_VERSION, MAGIC, encode_header
from kvtier.common._resilience import BreakerState, CircuitBreaker, Permit, backoff_delay
from kvtier.manager import TieringManager
from kvtier.testing import resolve_lookup
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3._errors import Fault, translate
from tests.support import (
    CREDENTIALS_FROM_ENVIRONMENT,
    INDEX_BY_HAND,
    MakeS3Tier,
    ManualClock,
    fresh_keys,
    s3_tier,
)
from tests.tiers.s3.s3_peer import make_blocks

BLOCK = 4096
HERE = Path(__file__).parent


FAILS_FAST: dict[str, Any] = {
    "connect_timeout": 1.0,
    "read_timeout": 2.0,
    "max_attempts": 2,
    "breaker_threshold": 3,
    "breaker_reset": 10.0,
    "miss_ttl": 1.0,
    **INDEX_BY_HAND,
}
"""S3Tier settings for a test that kills its server: short timeouts and retries, a breaker
that opens after three failures, and an index refreshed only when the test asks."""


async def _object_keys(endpoint_url: str, prefix: str) -> list[str]:
    async with raw_client(endpoint_url) as client:
        listing = await client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    names = [item["Key"] for item in listing.get("Contents", [])]
    return [name for name in names if "/_kvtier_journal/" not in name]


async def _exists(endpoint_url: str, object_key: str, bucket: str = BUCKET) -> bool:
    import botocore.exceptions

    async with raw_client(endpoint_url) as client:
        try:
            await client.head_object(Bucket=bucket, Key=object_key)
        except botocore.exceptions.ClientError:
            return False
    return True


async def _corrupt_deleted(tier: S3Tier, count: int) -> None:
    """Wait until the tier has deleted ``count`` corrupt objects (in its background)."""
    with anyio.fail_after(20):
        while tier.statistics().corrupt_deleted < count:
            await anyio.lowlevel.checkpoint()


def _notified(tier: S3Tier, keys: list[bytes]) -> Callable[[], Awaitable[None]]:
    """Start listening now; the returned function waits until ``tier.notify`` has been called
    for every key (the manager does that when a write-through to the tier landed)."""
    missing = set(keys)
    done = anyio.Event()

    def on_key(key: bytes) -> None:
        missing.discard(key)
        if not missing:
            done.set()

    remove = tier.add_listener(on_key)

    async def wait() -> None:
        try:
            with anyio.fail_after(20):
                await done.wait()
        finally:
            remove()

    return wait


# -- the server the tests use ------------------------------------------------------------------


def _collections(server: WeedServer) -> set[str]:
    """The collections SeaweedFS's master holds volumes for (one per bucket written to)."""
    url = f"http://127.0.0.1:{server.master_port}/vol/status"
    with urllib.request.urlopen(url, timeout=10) as response:
        status = json.load(response)
    found: set[str] = set()
    stack: list[Any] = [status]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("Collection"), str):
                found.add(item["Collection"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


async def test_a_bucket_made_for_a_run_is_warmed_up_and_left_empty(
    weed_server: WeedServer,
) -> None:
    """``ensure_bucket`` makes SeaweedFS grow the new bucket's volumes, which it otherwise
    does on the bucket's first write (about a second, which stalled the first stores of the
    demo and made back-pressure drop most of its S3-only writes), and leaves nothing in it."""
    bucket = f"warm-{uuid.uuid4().hex[:12]}"
    assert bucket not in await anyio.to_thread.run_sync(_collections, weed_server)
    await ensure_bucket(weed_server.endpoint_url, bucket)
    assert bucket in await anyio.to_thread.run_sync(_collections, weed_server)
    async with raw_client(weed_server.endpoint_url) as client:
        listed = await client.list_objects_v2(Bucket=bucket)
    assert listed.get("KeyCount", 0) == 0, listed.get("Contents")


# -- conformance -----------------------------------------------------------------------------


@pytest.mark.parametrize("addressing_style", ["path", "auto"])
async def test_round_trip_and_layout(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, addressing_style: str
) -> None:
    keys = fresh_keys(3)
    blocks = [os.urandom(BLOCK) for _ in keys]
    async with make_tier(addressing_style=addressing_style) as tier:
        for key, block in zip(keys, blocks, strict=True):
            await tier.store(key, memoryview(block))
        out = bytearray(BLOCK)
        await tier.load(keys[1], memoryview(out))
        assert out == blocks[1]
        stats = tier.statistics()
        assert (stats.stores, stats.loads, stats.bytes_read) == (3, 1, BLOCK)
    names = await _object_keys(weed_server.endpoint_url, prefix)
    assert sorted(names) == sorted(f"{prefix}/{k.hex()[:2]}/{k.hex()}" for k in keys)
    async with raw_client(weed_server.endpoint_url) as client:
        head = await client.head_object(Bucket=BUCKET, Key=names[0])
    assert head["Metadata"]["kvtier-format"] == str(FORMAT_VERSION)
    assert len(head["Metadata"]["kvtier-checksum"]) == 16


async def test_store_of_existing_object_is_skipped(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    (key,) = fresh_keys(1)
    block = os.urandom(BLOCK)
    async with make_tier() as tier:
        await tier.store(key, memoryview(block))
        async with raw_client(weed_server.endpoint_url) as client:
            before = await client.head_object(Bucket=BUCKET, Key=tier.object_key(key))
        await tier.store(key, memoryview(os.urandom(BLOCK)))  # conditional put: 412, skipped
        async with raw_client(weed_server.endpoint_url) as client:
            after = await client.head_object(Bucket=BUCKET, Key=tier.object_key(key))
        stats = tier.statistics()
        assert stats.stores_skipped_existing == 1
        assert stats.conditional_put
        assert after["ETag"] == before["ETag"]
        out = bytearray(BLOCK)
        await tier.load(key, memoryview(out))
        assert out == block


async def _puts_of_a_round_trip(
    make_tier: MakeS3Tier, block: bytes, seen: Callable[[Any], object]
) -> list[object]:
    """Store ``block`` under a fresh key and load it back (the bytes must match); what
    ``seen`` makes of each PutObject request of that key, as botocore sends it."""
    (key,) = fresh_keys(1)
    sent: list[object] = []

    def before_send(request: Any, **_: Any) -> None:
        if key.hex() in request.url:
            sent.append(seen(request))

    async with make_tier() as tier:
        tier._client.meta.events.register("before-send.s3.PutObject", before_send)
        await tier.store(key, memoryview(block))
        out = bytearray(len(block))
        await tier.load(key, memoryview(out))
    assert out == block
    return sent


async def test_store_of_a_large_block_keeps_work_off_the_loop(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block copy and checksums of a store run in a worker thread, not on the event loop,
    and botocore does not SHA-256-sign the payload (the block carries its own checksum)."""
    import kvtier.tiers.s3._blocks as s3_module
    from kvtier.tiers.s3._codec import build_object

    threads: list[threading.Thread] = []

    def build(key: bytes, payload: memoryview, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return build_object(key, payload, **kwargs)

    monkeypatch.setattr(s3_module, "build_object", build)
    sent = await _puts_of_a_round_trip(
        make_tier, os.urandom(2 << 20), lambda r: r.headers.get("x-amz-content-sha256", b"")
    )
    assert threads and threading.main_thread() not in threads
    assert sent in ([b"UNSIGNED-PAYLOAD"], ["UNSIGNED-PAYLOAD"])


async def test_store_sends_its_bytes_body_without_expect_continue(make_tier: MakeS3Tier) -> None:
    """botocore wrapped every PutObject body in a BytesIO, and a file-like body gets an
    ``Expect: 100-continue`` header: each store waited one more round trip for the server's
    interim answer and aiohttp copied the body out chunk by chunk (0.2 ms of client CPU per
    256 KiB store, benchmarks/bench_s3_cpu.py). The tier's client sends its ``bytes`` body
    as it is."""
    sent = await _puts_of_a_round_trip(
        make_tier, os.urandom(256 << 10), lambda r: (type(r.body), r.headers.get("Expect"))
    )
    assert sent == [(bytes, None)]


async def test_batched_lookup_and_miss_ttl(make_tier: MakeS3Tier) -> None:
    clock = ManualClock(1000.0)
    keys = fresh_keys(100)
    present, absent = keys[:60], keys[60:]
    async with make_tier() as writer:
        for key in present:
            await writer.store(key, memoryview(os.urandom(64)))
    async with make_tier(
        lookup_mode="ask", lookup_batch_size=16, miss_ttl=5.0, clock=clock
    ) as tier:
        assert all(tier.lookup(key) is LookupResult.RETRY for key in keys)
        results = [await resolve_lookup(tier, key) for key in keys]
        assert results == [LookupResult.HIT] * 60 + [LookupResult.MISS] * 40
        lookups = tier.statistics().lookups
        assert lookups.keys_checked == 100
        assert lookups.batches >= 100 // 16
        # Another node writes one of the missing keys: the cached miss hides it until the TTL.
        async with make_tier() as other:
            await other.store(absent[0], memoryview(os.urandom(64)))
        assert tier.lookup(absent[0]) is LookupResult.MISS
        clock.advance(5.1)
        assert await resolve_lookup(tier, absent[0]) is LookupResult.HIT


async def test_round_trip_through_tiering_manager(make_tier: MakeS3Tier) -> None:
    keys = fresh_keys(6)
    data = np.frombuffer(os.urandom(len(keys) * BLOCK), dtype=np.uint8).reshape(len(keys), -1)
    writer = make_tier()
    async with TieringManager(HostPool(8, BLOCK), [writer]) as manager:
        assert await manager.store(keys, data) == len(keys)
    assert manager.statistics().writes.succeeded == len(keys)
    # A fresh node: empty pool, a new tier instance on the same bucket and prefix.
    async with TieringManager(HostPool(8, BLOCK), [make_tier()]) as manager:
        assert manager.lookup(keys[0]) is LookupResult.RETRY
        assert await OffloadScheduler(manager).lookup(keys, timeout=20) == len(keys)
        out = np.zeros_like(data)
        assert await manager.load(keys, out) == len(keys)
        assert np.array_equal(out, data)
        assert manager.statistics().promotions.succeeded == len(keys)


# -- several processes share one bucket ---------------------------------------------------------


async def _run_peer(server: WeedServer, **args: Any) -> dict[str, Any]:
    payload = {
        "endpoint": server.endpoint_url,
        "bucket": BUCKET,
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        "block_bytes": BLOCK,
        **args,
    }
    result = await anyio.run_process(
        [sys.executable, str(HERE / "s3_peer.py"), json.dumps(payload)], check=False
    )
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)  # type: ignore[no-any-return]


async def test_second_process_sees_blocks(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    namespace = os.urandom(8)
    keys = block_keys(list(range(16)), 4, namespace=namespace)
    blocks = make_blocks(7, len(keys), BLOCK)
    async with make_tier() as tier:
        for key, block in zip(keys, blocks, strict=True):
            await tier.store(key, memoryview(block))
    common = {"prefix": prefix, "namespace": namespace.hex(), "tokens": 16, "seed": 7}
    peer = await _run_peer(weed_server, mode="load", **common)
    assert peer["first"] == ["RETRY"] * len(keys)  # index HIT, promotion started
    assert peer["request_path_requests"] == 0
    assert peer["count"] == peer["loaded"] == len(keys)
    assert peer["digests"] == [hashlib.sha256(b).hexdigest() for b in blocks]

    # And the other way round: in index mode a block the peer writes is a MISS here at once
    # (no request), and a HIT once the peer's journal segment has been read.
    other_ns = os.urandom(8)
    other_keys = block_keys(list(range(8)), 4, namespace=other_ns)
    async with make_tier(**INDEX_BY_HAND) as tier:
        assert await tier.wait_index_loaded()
        assert tier.lookup(other_keys[0]) is LookupResult.MISS
        stored = await _run_peer(
            weed_server, mode="store", prefix=prefix, namespace=other_ns.hex(), tokens=8, seed=9
        )
        assert stored["cascades_succeeded"] == len(other_keys)
        assert stored["journal_segments_published"] >= 1
        assert tier.lookup(other_keys[0]) is LookupResult.MISS  # not polled yet
        await tier.refresh_index()
        assert [tier.lookup(k) for k in other_keys] == [LookupResult.HIT] * len(other_keys)
        out = bytearray(BLOCK)
        await tier.load(other_keys[0], memoryview(out))
        assert out == make_blocks(9, len(other_keys), BLOCK)[0]
        stats = tier.statistics()
        assert stats.request_path_requests == 0
        assert stats.journal_segments_read >= 1


async def test_index_staleness_bound(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    """Another process's write becomes a HIT here by the tier's own polling, within the
    promised bound (about 2 x index_refresh; the wait below is a generous deadline)."""
    namespace = os.urandom(8)
    keys = block_keys(list(range(16)), 4, namespace=namespace)
    async with make_tier(index_refresh=0.5, index_lookback=10.0) as tier:
        assert await tier.wait_index_loaded()
        assert tier.lookup(keys[-1]) is LookupResult.MISS
        learnt = _notified(tier, keys)
        await _run_peer(
            weed_server, mode="store", prefix=prefix, namespace=namespace.hex(), tokens=16, seed=3
        )
        await learnt()
        assert [tier.lookup(k) for k in keys] == [LookupResult.HIT] * len(keys)
        assert tier.statistics().request_path_requests == 0


@pytest.mark.parametrize("background", [True, False], ids=["background", "inside-open"])
async def test_index_rebuilt_after_restart(make_tier: MakeS3Tier, background: bool) -> None:
    keys = fresh_keys(40)
    async with make_tier() as tier:
        for key in keys:
            await tier.store(key, memoryview(os.urandom(256)))
        assert tier.statistics().index_keys == len(keys)
    # A new instance (a restarted node) lists the prefix: after open() returned (the
    # default), or inside it.
    async with make_tier(index_background_load=background) as tier:
        if not background:  # whole when open() returns: nothing to wait for
            assert not tier.statistics().index_loading
        assert await tier.wait_index_loaded()
        stats = tier.statistics()
        assert stats.index_listing_complete
        assert stats.index_keys == len(keys)  # from the journal, then the listing
        if not background:  # listed inside open(), before any journal read
            assert stats.index_listed == len(keys)
        assert [tier.lookup(k) for k in keys] == [LookupResult.HIT] * len(keys)
        assert tier.lookup(fresh_keys(1)[0]) is LookupResult.MISS
        assert tier.statistics().request_path_requests == 0


async def test_index_hit_whose_object_was_deleted(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    keys = fresh_keys(3)
    data = np.frombuffer(os.urandom(len(keys) * BLOCK), dtype=np.uint8).reshape(len(keys), -1)
    async with make_tier() as writer:
        for key, row in zip(keys, data, strict=True):
            await writer.store(key, row.data)
    tier = make_tier()
    async with TieringManager(HostPool(8, BLOCK), [tier]) as manager:
        assert await tier.wait_index_loaded()
        assert tier.lookup(keys[1]) is LookupResult.HIT  # listed at open
        async with raw_client(weed_server.endpoint_url) as client:  # another node deletes it
            await client.delete_object(Bucket=BUCKET, Key=tier.object_key(keys[1]))
        # The promotion's GET finds nothing: a miss (not an error), and the index forgets it.
        assert await OffloadScheduler(manager).lookup(keys, timeout=20) == 1
        assert manager.statistics().promotions.failed_by_reason == {"not_found": 1}
        assert tier.lookup(keys[1]) is LookupResult.MISS
        assert tier.statistics().index_keys == 2
        assert manager.lookup(keys[1]) is LookupResult.MISS


async def test_conditional_put_race_between_two_processes(
    weed_server: WeedServer, prefix: str
) -> None:
    """Two processes put the same 64 keys at the same moment (If-None-Match: *): each key is
    written at least once, every other put finds it there, and every block is intact."""
    namespace = os.urandom(8)
    payload = {
        "endpoint": weed_server.endpoint_url,
        "bucket": BUCKET,
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        "block_bytes": BLOCK,
        "prefix": prefix,
        "namespace": namespace.hex(),
        "tokens": 64,
        "seed": 5,
    }
    command = [sys.executable, str(HERE / "s3_peer.py"), json.dumps({**payload, "mode": "race"})]
    results: list[dict[str, Any]] = []
    with anyio.fail_after(120):
        async with (
            await anyio.open_process(command) as first,
            await anyio.open_process(command) as second,
        ):
            peers = [first, second]
            for peer in peers:  # both tiers are open ...
                assert peer.stdout is not None
                assert (await peer.stdout.receive()).startswith(b"ready")
            for peer in peers:  # ... and both start now
                assert peer.stdin is not None
                await peer.stdin.send(b"go\n")
            for peer in peers:
                assert peer.stdout is not None
                out = b""
                async for chunk in peer.stdout:
                    out += chunk
                assert await peer.wait() == 0
                results.append(json.loads(out.decode().strip().splitlines()[-1]))
    keys = block_keys(list(range(64)), 4, namespace=namespace)
    for result in results:
        assert result["cascades_succeeded"] == len(keys)  # both saw success: put or "exists"
    # Every key was written at least once; the writes that lost found it there (412/409).
    assert sum(r["stores"] for r in results) >= len(keys)
    assert sum(r["stores"] + r["stores_skipped_existing"] for r in results) == 2 * len(keys)
    # And what is stored is intact: a third node loads every block and checks its bytes.
    common = {k: payload[k] for k in ("prefix", "namespace", "tokens", "seed")}
    loaded = await _run_peer(weed_server, mode="load", **common)
    assert loaded["loaded"] == len(keys)
    assert loaded["digests"] == [hashlib.sha256(b).hexdigest() for b in make_blocks(5, 16, BLOCK)]


# -- faults ------------------------------------------------------------------------------------


async def _settle(manager: TieringManager) -> None:
    """Let background work that fails fast (breaker open) run to its end."""
    with anyio.fail_after(10):
        while manager.statistics().background.tasks:
            await anyio.lowlevel.checkpoint()


async def test_server_killed_mid_run_and_restarted(own_weed: WeedServer) -> None:
    """Ask mode (existence checks on the request path): kill -9 of the server turns lookups
    into misses within their deadline; the same tier recovers when it is back."""
    clock = ManualClock(1000.0)
    tier = s3_tier(
        own_weed, "kill", **FAILS_FAST, lookup_mode="ask", lookup_timeout=5.0, clock=clock
    )
    keys = fresh_keys(12)
    blocks = np.frombuffer(os.urandom(len(keys) * BLOCK), dtype=np.uint8).reshape(len(keys), -1)
    async with TieringManager(HostPool(32, BLOCK), [tier], store_timeout=10) as manager:
        scheduler = OffloadScheduler(manager)
        written = _notified(tier, keys[:2])
        await manager.store(keys[:2], blocks[:2])
        await written()
        assert tier.statistics().stores == 2

        await own_weed.akill()
        # Lookups of blocks nobody has seen resolve to MISS within their deadline.
        unknown = keys[4:8]
        assert await scheduler.lookup(unknown, timeout=8) == 0
        assert [manager.lookup(k) for k in unknown] == [LookupResult.MISS] * len(unknown)
        stats = tier.statistics()
        assert stats.breaker_state == "open"
        assert stats.lookups.misses_by_reason.get("unavailable", 0) >= 1
        # While the breaker is open a lookup answers MISS at once instead of queueing.
        assert tier.lookup(keys[8]) is LookupResult.MISS
        assert tier.statistics().lookups.pending == 0
        # Stores fail, counted; the engine keeps going (the pool still takes the blocks).
        assert await manager.store(keys[8:10], blocks[8:10]) == 2
        await _settle(manager)
        assert manager.statistics().writes.failures_by_reason.get("unavailable", 0) >= 1
        with pytest.raises(TierUnavailableError, match="circuit breaker open"):
            await tier.store(keys[10], memoryview(blocks[10]))
        assert tier.statistics().failures_by_reason.get("unavailable", 0) >= 2
        assert manager.lookup(keys[8]) is LookupResult.HIT  # primary still serves

        # The server comes back (SeaweedFS keeps its data), the breaker's reset period passes,
        # and the same tier instance recovers. The first existence check is a 2-key batch: the
        # half-open breaker's trial must close it (were the sibling request rejected and the
        # trial cancelled, 2-key batches would stay "unavailable" for good).
        await own_weed.astart()
        clock.advance(10.5)
        tier.record_miss(keys[0], MissReason.NOT_FOUND)  # drop the cached hits: ask again
        tier.record_miss(keys[1], MissReason.NOT_FOUND)
        clock.advance(1.5)  # past miss_ttl
        assert [tier.lookup(k) for k in keys[:2]] == [LookupResult.RETRY] * 2
        assert [await resolve_lookup(tier, k) for k in keys[:2]] == [LookupResult.HIT] * 2
        assert tier.breaker_state is BreakerState.CLOSED
        assert await resolve_lookup(tier, keys[11]) is LookupResult.MISS
        await tier.store(keys[11], memoryview(blocks[11]))
        out = bytearray(BLOCK)
        await tier.load(keys[11], memoryview(out))
        assert out == blocks[11].tobytes()
    assert tier.statistics().breaker_opened >= 1


@pytest.mark.parametrize("packed", [False, True])
async def test_index_mode_server_killed_and_restarted(own_weed: WeedServer, packed: bool) -> None:
    """Index mode: with the server gone, indexed blocks (objects of their own, or sections of
    one pack) become misses within the promotion deadline and unknown ones miss at once;
    once it is back they load again."""
    clock = ManualClock(1000.0)
    tier = s3_tier(own_weed, "kill-index", **FAILS_FAST, clock=clock)
    keys = fresh_keys(8)
    blocks = np.frombuffer(os.urandom(len(keys) * BLOCK), dtype=np.uint8).reshape(len(keys), -1)
    async with tier, anyio.create_task_group() as tg:
        for key, row in zip(keys[:4], blocks[:4], strict=True):
            if packed:  # started together: one pack
                tg.start_soon(tier.store, key, memoryview(row))
            else:
                await tier.store(key, memoryview(row))
    assert tier.statistics().blocks_packed == (4 if packed else 0)
    async with TieringManager(HostPool(16, BLOCK), [tier], promotion_timeout=5) as manager:
        scheduler = OffloadScheduler(manager)
        await own_weed.akill()
        assert await scheduler.lookup(keys[:4], timeout=20) == 0
        assert [tier.lookup(k) for k in keys[:4]] == [LookupResult.MISS] * 4
        assert tier.lookup(keys[6]) is LookupResult.MISS  # not indexed: no request
        failed = manager.statistics().promotions.failed_by_reason
        assert set(failed) <= {"unavailable", "timeout"} and failed

        await own_weed.astart()
        clock.advance(10.5)  # past the breaker's reset and the miss TTL
        assert await scheduler.lookup(keys[:4], timeout=20) == 4
        out = np.zeros((4, BLOCK), dtype=np.uint8)
        assert await manager.load(keys[:4], out) == 4
        assert np.array_equal(out, blocks[:4])
        assert tier.breaker_state is BreakerState.CLOSED
        assert tier.statistics().request_path_requests == 0


def _corruptions(key: bytes, block: bytes) -> dict[str, bytes]:
    good = encode_header(key, block) + block
    other = os.urandom(16)
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    return {
        "payload_bit_flip": bytes(flipped),
        "truncated": good[: len(good) - 100],
        "other_keys_block": encode_header(other, block) + block,
        "garbage": os.urandom(len(good)),
        "empty": b"",
    }


@pytest.mark.parametrize(
    "kind", ["payload_bit_flip", "truncated", "other_keys_block", "garbage", "empty"]
)
async def test_corrupt_object_is_a_corrupt_miss_and_deleted(
    make_tier: MakeS3Tier, weed_server: WeedServer, kind: str
) -> None:
    (key,) = fresh_keys(1)
    block = os.urandom(BLOCK)
    tier = make_tier()
    async with raw_client(weed_server.endpoint_url) as client:
        await client.put_object(
            Bucket=BUCKET, Key=tier.object_key(key), Body=_corruptions(key, block)[kind]
        )
    async with TieringManager(HostPool(4, BLOCK), [tier]) as manager:
        assert manager.lookup(key) is LookupResult.RETRY
        # The HEAD finds the object, the promotion's load finds it corrupt: a miss, not bytes.
        assert await OffloadScheduler(manager).lookup([key], timeout=20) == 0
        assert manager.lookup(key) is LookupResult.MISS
        assert manager.statistics().promotions.failed_by_reason == {"corrupt": 1}
        stats = tier.statistics()
        assert stats.failures_by_reason == {"corrupt": 1}
        assert stats.index_keys == 0  # removed from the index with the object
        await _corrupt_deleted(tier, 1)  # in the background
        with pytest.raises(BlockNotFoundError):
            await tier.load(key, memoryview(bytearray(BLOCK)))
    assert not await _exists(weed_server.endpoint_url, tier.object_key(key))


@pytest.mark.parametrize("signed", [False, True], ids=["xxh3", "signed"])
async def test_large_objects_stream_into_the_block_and_damage_anywhere_is_caught(
    make_tier: MakeS3Tier, weed_server: WeedServer, signed: bool
) -> None:
    """A multi-MiB body arrives in many socket chunks, each copied straight into the block
    buffer and checked there: an intact block comes back byte for byte; a flipped byte in
    a middle chunk or in the last one, or a body cut short, is a corrupt miss, never data."""
    size = 3 << 20
    keys = fresh_keys(4)
    block = os.urandom(size)
    secret = os.urandom(32) if signed else None
    tier = make_tier(integrity_key=secret)
    async with tier:
        await tier.store(keys[0], memoryview(block))
        dst = bytearray(size)
        await tier.load(keys[0], memoryview(dst))
        assert dst == block
        good = [
            bytearray(encode_header(key, block, integrity_key=tier.integrity_key) + block)
            for key in keys
        ]
        good[1][len(good[1]) // 2] ^= 0x01  # in a middle chunk
        good[2][-1] ^= 0x80  # in the last chunk
        damaged = {keys[1]: good[1], keys[2]: good[2], keys[3]: good[3][: -(1 << 20)]}
        async with raw_client(weed_server.endpoint_url) as client:
            for key, body in damaged.items():
                await client.put_object(Bucket=BUCKET, Key=tier.object_key(key), Body=bytes(body))
        for key in damaged:
            with pytest.raises(CorruptBlockError, match=r"checksum|integrity|header says"):
                await tier.load(key, memoryview(bytearray(size)))
        await _corrupt_deleted(tier, 3)
    for key in damaged:
        assert not await _exists(weed_server.endpoint_url, tier.object_key(key))


async def test_newer_format_is_skipped_not_deleted(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    (key,) = fresh_keys(1)
    block = os.urandom(BLOCK)
    header = bytearray(encode_header(key, block))
    assert header[:4] == MAGIC
    header[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    async with make_tier() as tier:
        async with raw_client(weed_server.endpoint_url) as client:
            await client.put_object(
                Bucket=BUCKET, Key=tier.object_key(key), Body=bytes(header) + block
            )
        with pytest.raises(CorruptBlockError, match="format version"):
            await tier.load(key, memoryview(bytearray(BLOCK)))
        assert tier.statistics().corrupt_deleted == 0
    assert await _exists(weed_server.endpoint_url, tier.object_key(key))


class DeleteGate:
    """A TCP proxy in front of the S3 server that passes every request through as it is,
    except DELETE requests, which it holds until ``release`` is set: a real, slow DELETE on
    the tier's one endpoint, with the rest of its traffic untouched."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self.endpoint_url = ""
        self.held = anyio.Event()  # a DELETE arrived and is held
        self.release = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        self.endpoint_url = f"http://127.0.0.1:{port}"
        async with listener:
            task_status.started()
            await listener.serve(self._proxy)

    async def _proxy(self, downstream: anyio.abc.SocketStream) -> None:
        upstream = await anyio.connect_tcp("127.0.0.1", self._upstream_port)
        async with downstream, upstream, anyio.create_task_group() as tg:

            async def answers() -> None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    async for chunk in upstream:
                        await downstream.send(chunk)
                tg.cancel_scope.cancel()

            tg.start_soon(answers)
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                buffer = b""
                while True:
                    while b"\r\n\r\n" not in buffer:
                        buffer += await downstream.receive()
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    fields = [line.partition(b":") for line in head.split(b"\r\n")[1:]]
                    sizes = [int(v) for n, _, v in fields if n.strip().lower() == b"content-length"]
                    while len(buffer) < sum(sizes):
                        buffer += await downstream.receive()
                    body, buffer = buffer[: sum(sizes)], buffer[sum(sizes) :]
                    if head.startswith(b"DELETE "):
                        self.held.set()
                        await self.release.wait()
                    await upstream.send(head + b"\r\n\r\n" + body)
            tg.cancel_scope.cancel()


async def test_a_slow_delete_of_a_corrupt_object_never_holds_its_promotion(
    make_tier: MakeS3Tier, weed_server: WeedServer
) -> None:
    """The promotion of a corrupt object ends, as a corrupt miss, within its own deadline
    while the object's DELETE hangs (held by a proxy in front of the server): the delete runs
    in the tier's background, bounded, and still happens once the server answers it."""
    (key,) = fresh_keys(1)
    async with anyio.create_task_group() as tg:
        gate = DeleteGate(weed_server.s3_port)
        await tg.start(gate.run)
        tier = make_tier(endpoint_url=gate.endpoint_url, read_timeout=30.0)
        async with raw_client(weed_server.endpoint_url) as client:
            await client.put_object(
                Bucket=BUCKET, Key=tier.object_key(key), Body=os.urandom(BLOCK + 64)
            )
        try:
            manager = TieringManager(HostPool(4, BLOCK), [tier], promotion_timeout=0.5)
            async with manager:
                assert await tier.wait_index_loaded()
                assert tier.lookup(key) is LookupResult.HIT  # listed at open
                with anyio.fail_after(10):  # the promotion's deadline is 0.5 s, the DELETE's 30
                    assert await OffloadScheduler(manager).lookup([key], timeout=20) == 0
                assert manager.statistics().promotions.failed_by_reason == {"corrupt": 1}
                with anyio.fail_after(20):
                    await gate.held.wait()
                assert await _exists(weed_server.endpoint_url, tier.object_key(key))
                assert tier.statistics().corrupt_deleted == 0
                gate.release.set()
                await _corrupt_deleted(tier, 1)
            assert not await _exists(weed_server.endpoint_url, tier.object_key(key))
        finally:
            gate.release.set()
            tg.cancel_scope.cancel()


async def test_missing_bucket_is_a_clear_error_on_open(make_tier: MakeS3Tier) -> None:
    tier = make_tier(bucket="no-such-bucket-here")
    with pytest.raises(TierUnavailableError, match=r"bucket 'no-such-bucket-here' does not exist"):
        await tier.open()
    assert not tier.is_open
    await tier.aclose()


async def test_unreachable_endpoint_is_a_clear_error_on_open() -> None:
    tier = s3_tier(f"http://127.0.0.1:{free_port()}", "x", max_attempts=2)
    with pytest.raises(TierUnavailableError, match="unreachable"):
        await tier.open()


@pytest.fixture
async def auth_server() -> Any:
    """A server with moto's IAM auth on: only the access key created here is accepted."""
    server = MotoServer()
    await server.astart()
    try:
        async with moto_client(server.endpoint_url, "iam") as iam:
            await iam.create_user(UserName="kvtier")
            created = (await iam.create_access_key(UserName="kvtier"))["AccessKey"]
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            await iam.put_user_policy(
                UserName="kvtier", PolicyName="s3", PolicyDocument=json.dumps(policy)
            )
        await create_bucket(server.endpoint_url, BUCKET)
        await anyio.to_thread.run_sync(server.set_auth, 0)
        yield server, created["AccessKeyId"], created["SecretAccessKey"]
    finally:
        await server.astop()


async def test_bad_credentials_are_a_clear_error_and_never_leak(
    auth_server: tuple[MotoServer, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, access_key, secret_key = auth_server
    caplog.set_level(logging.DEBUG, logger="kvtier")
    # Ask mode: no listing at open, because moto's signature check rejects a ListObjectsV2
    # whose Prefix holds a '/' (a moto defect; AWS and SeaweedFS accept it).
    make = functools.partial(s3_tier, server, "auth", lookup_mode="ask")
    async with make(aws_access_key_id=access_key, aws_secret_access_key=secret_key) as tier:
        (key,) = fresh_keys(1)
        await tier.store(key, memoryview(b"x" * BLOCK))  # the real key works
    bad_secret = "wrong-secret-" + uuid.uuid4().hex
    for key_id, secret in ((access_key, bad_secret), ("AKIAUNKNOWNUNKNOWN00", bad_secret)):
        tier = make(aws_access_key_id=key_id, aws_secret_access_key=secret)
        with pytest.raises(TierUnavailableError, match="access denied") as info:
            await tier.open()
        chain = []
        exc: BaseException | None = info.value
        while exc is not None:
            chain.append(f"{exc!s} {exc!r}")
            exc = exc.__cause__ or exc.__context__
        seen = " ".join([*chain, repr(tier), str(vars(tier)), caplog.text])
        assert secret not in seen
        assert secret_key not in seen


async def test_credentials_from_the_environment(
    aws_environment: pytest.MonkeyPatch, weed_server: WeedServer, prefix: str
) -> None:
    aws_environment.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    aws_environment.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    tier = s3_tier(weed_server, prefix, **CREDENTIALS_FROM_ENVIRONMENT)
    async with tier:
        (key,) = fresh_keys(1)
        await tier.store(key, memoryview(b"e" * 64))
        assert await tier.contains_many([key]) == [True]


async def test_no_credentials_is_a_clear_error(
    aws_environment: pytest.MonkeyPatch, weed_server: WeedServer
) -> None:
    tier = s3_tier(weed_server, "", **CREDENTIALS_FROM_ENVIRONMENT)
    with pytest.raises(TierUnavailableError, match="no usable AWS credentials"):
        await tier.open()


# -- lifecycle, arguments, optional extra --------------------------------------------------


async def test_use_before_open(make_tier: MakeS3Tier) -> None:
    tier = make_tier()
    (key,) = fresh_keys(1)
    assert tier.lookup(key) is LookupResult.MISS  # nothing can answer: a miss, never raise
    with pytest.raises(LifecycleError):
        await tier.load(key, memoryview(bytearray(BLOCK)))
    with pytest.raises(LifecycleError):
        await tier.store(key, memoryview(bytearray(BLOCK)))
    assert "open=False" in repr(tier)


def _sockets_to(port: int) -> int:
    """How many TCP sockets this process holds open to ``port`` (Linux /proc)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                remote_port = int(fields[2].rpartition(":")[2], 16)
                count += remote_port == port and fields[9] in mine
    return count


async def test_closing_a_tier_whose_server_stopped_answering_closes_its_client(
    own_weed: WeedServer,
) -> None:
    """aclose while the endpoint has stopped answering (SeaweedFS stopped with SIGSTOP): the
    last journal publish hangs and is given up within its own bound, the client is closed all
    the same (no socket to the server left open), and the closed tier refuses operations."""
    tier = s3_tier(own_weed, "stopped", **INDEX_BY_HAND, pack_blocks=1, read_timeout=30.0)
    keys = fresh_keys(4)
    pid = own_weed.pid
    assert pid is not None
    try:
        with anyio.fail_after(90):  # the last publish and the close are bounded (5 s each)
            async with tier:
                async with anyio.create_task_group() as tg:  # four PUTs at once: four
                    for key in keys:  # pooled connections, and four keys to publish
                        tg.start_soon(tier.store, key, memoryview(os.urandom(BLOCK)))
                assert _sockets_to(own_weed.s3_port) >= 2
                os.kill(pid, signal.SIGSTOP)
        assert _sockets_to(own_weed.s3_port) == 0  # aiohttp's close waits for its sockets
        assert not tier.is_open
        with anyio.fail_after(10):
            with pytest.raises(LifecycleError):
                await tier.store(fresh_keys(1)[0], memoryview(os.urandom(BLOCK)))
            with pytest.raises(LifecycleError):
                await tier.load(keys[0], memoryview(bytearray(BLOCK)))
            with pytest.raises(LifecycleError):
                await tier.refresh_index()
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("index", [False, True], ids=["checks", "index"])
async def test_a_cancelled_close_leaves_no_task_and_no_cancel_scope_behind(
    make_tier: MakeS3Tier, index: bool
) -> None:
    """aclose whose caller is cancelled meanwhile (a manager's open_timeout firing while it
    closes the tiers it opened): both of the tier's task groups are still left, in order, so
    none of its tasks runs on, the caller's cancel scope exits cleanly, and the tier opens
    again."""
    tier = make_tier(**INDEX_BY_HAND) if index else make_tier()
    before = asyncio.all_tasks()
    with anyio.fail_after(60):
        with anyio.CancelScope() as caller:
            await tier.open()
            caller.cancel()  # the caller's deadline fires while it closes the tier
            await tier.aclose()
        assert caller.cancelled_caught
        assert not tier.is_open
        left = [t for t in asyncio.all_tasks() - before if not t.done()]
        assert left == [], f"tasks left running after the close: {left}"
        async with tier:  # nothing of the first open is still entered
            await tier.store(fresh_keys(1)[0], memoryview(os.urandom(BLOCK)))


@pytest.mark.parametrize(
    ("bucket", "overrides", "message"),
    [
        ("", {}, "bucket must be a non-empty"),
        ("a", {}, "not a valid bucket name"),
        ("has/slash", {}, "not a valid bucket name"),
        ("ok-bucket", {"endpoint_url": "ftp://127.0.0.1:1"}, "http:// or https://"),
        ("ok-bucket", {"endpoint_url": "127.0.0.1:9000"}, "http:// or https://"),
        ("ok-bucket", {"endpoint_url": "http://u:p@127.0.0.1:9000"}, "must not carry"),
        ("ok-bucket", {"endpoint_url": "http://127.0.0.1:99999"}, "invalid port"),
        ("ok-bucket", {"addressing_style": "weird"}, "addressing_style"),
        ("ok-bucket", {"connect_timeout": 0}, "connect_timeout"),
        ("ok-bucket", {"max_attempts": 1.5}, "max_attempts"),
        ("ok-bucket", {"max_concurrency": True}, "max_concurrency"),
        ("ok-bucket", {"miss_ttl": -1}, "miss_ttl"),
        ("ok-bucket", {"breaker_threshold": 0}, "breaker_threshold"),
        ("ok-bucket", {"prefix": "a//b"}, "prefix"),
        ("ok-bucket", {"aws_access_key_id": "AKID"}, "together"),
        ("ok-bucket", {"aws_session_token": "tok"}, "aws_session_token"),
        ("ok-bucket", {"name": ""}, "name"),
    ],
)
def test_invalid_arguments(bucket: str, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        S3Tier(bucket, **overrides)


def test_prefix_is_normalised_and_repr_hides_credentials() -> None:
    tier = S3Tier(
        "ok-bucket",
        prefix="/kv/llama/",
        endpoint_url="http://127.0.0.1:9/",
        aws_access_key_id="AKIDSHOWNNOWHERE0000",
        aws_secret_access_key="super-secret-value",
    )
    key = bytes(range(16))
    assert tier.object_key(key) == f"kv/llama/00/{key.hex()}"
    text = repr(tier) + str(vars(tier))
    assert "super-secret-value" not in text
    assert "AKIDSHOWNNOWHERE0000" not in text
    assert "s3://ok-bucket/kv/llama" in repr(tier)


def test_import_without_aiobotocore() -> None:
    code = (
        "import sys\n"
        "sys.modules['aiobotocore'] = None\n"
        "import kvtier\n"
        "from kvtier.tiers.s3 import S3Tier\n"
        "try:\n"
        "    S3Tier('bucket')\n"
        "except kvtier.ExtraNotInstalledError as exc:\n"
        "    assert exc.extra == 's3' and 'aiobotocore' in str(exc) and 'S3Tier' in str(exc)\n"
        "    print('ok')\n"
        "assert 'botocore' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- the pieces on their own -----------------------------------------------------------------


def _state(breaker: CircuitBreaker) -> BreakerState:
    """``breaker.state`` read through a call: mypy would keep the attribute narrowed across
    the calls that change it."""
    return breaker.state


def test_circuit_breaker_state_machine() -> None:
    clock = ManualClock(1000.0)
    breaker = CircuitBreaker(3, 5.0, clock=clock)
    for _ in range(2):
        assert breaker.allow() is Permit.PASS
        breaker.failure(Permit.PASS)
    assert _state(breaker) is BreakerState.CLOSED
    breaker.success(Permit.PASS)  # success resets the streak
    for _ in range(3):
        breaker.failure(breaker.allow())
    assert _state(breaker) is BreakerState.OPEN
    assert breaker.rejecting()
    assert breaker.allow() is Permit.REJECTED
    clock.advance(5.0)
    assert not breaker.rejecting()
    trial = breaker.allow()
    assert trial is Permit.TRIAL
    assert _state(breaker) is BreakerState.HALF_OPEN
    assert breaker.allow() is Permit.REJECTED  # one trial at a time
    breaker.abandon(trial)  # cancelled: the next caller gets the trial
    trial = breaker.allow()
    assert trial is Permit.TRIAL
    breaker.failure(trial)  # the trial failed: open for another period
    assert _state(breaker) is BreakerState.OPEN
    assert breaker.times_opened == 2
    clock.advance(5.0)
    breaker.success(breaker.allow())
    assert _state(breaker) is BreakerState.CLOSED
    assert not breaker.rejecting()


def test_backoff_is_bounded_full_jitter() -> None:
    assert backoff_delay(0, rng=lambda: 1.0) == pytest.approx(0.05)
    assert backoff_delay(3, rng=lambda: 1.0) == pytest.approx(0.4)
    assert backoff_delay(30, rng=lambda: 1.0) == pytest.approx(2.0)
    assert backoff_delay(5, rng=lambda: 0.0) == 0.0


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    error: Exception = ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )
    return error


def test_error_translation() -> None:
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    cases: list[tuple[Exception, Fault, type[Exception]]] = [
        (_client_error(404, "NoSuchKey"), Fault.NOT_FOUND, BlockNotFoundError),
        (_client_error(404, "NoSuchBucket"), Fault.NO_BUCKET, TierUnavailableError),
        (_client_error(403, "InvalidAccessKeyId"), Fault.DENIED, TierUnavailableError),
        (_client_error(412, "PreconditionFailed"), Fault.PRECONDITION, TierUnavailableError),
        (_client_error(503, "SlowDown"), Fault.THROTTLED, TierUnavailableError),
        (_client_error(400, "ThrottlingException"), Fault.THROTTLED, TierUnavailableError),
        (_client_error(500, "InternalError"), Fault.SERVER, TierUnavailableError),
        (_client_error(501, "NotImplemented"), Fault.UNSUPPORTED, TierUnavailableError),
        (_client_error(400, "InvalidArgument"), Fault.REJECTED, TierUnavailableError),
        (EndpointConnectionError(endpoint_url="http://x"), Fault.UNREACHABLE, TierUnavailableError),
        (ConnectTimeoutError(endpoint_url="http://x"), Fault.TIMEOUT, TierTimeoutError),
        (ReadTimeoutError(endpoint_url="http://x"), Fault.TIMEOUT, TierTimeoutError),
        (NoCredentialsError(), Fault.NO_CREDENTIALS, TierUnavailableError),
        (ConnectionResetError(), Fault.UNREACHABLE, TierUnavailableError),
    ]
    for exc, fault, error_type in cases:
        translated = translate(
            exc, tier="s3", operation="load", key=b"k" * 16, bucket="b", endpoint="http://x"
        )
        assert translated is not None
        assert translated.fault is fault, exc
        assert type(translated.error) is error_type, exc
        assert translated.error.tier == "s3"
        assert translated.error.operation == "load"
        assert fault.retryable == (
            fault in (Fault.THROTTLED, Fault.SERVER, Fault.UNREACHABLE, Fault.TIMEOUT)
        )
    assert (
        translate(KeyError("x"), tier="s", operation="o", key=None, bucket="b", endpoint="e")
        is None
    )


@pytest.mark.parametrize(
    "value",
    [
        "Tue, 01 Dec 2026 12:24:08 GMT",  # Last-Modified of a GET or HEAD
        "Tue, 01 Dec 2026 12:24:08 -0000",
        "2026-12-01T12:24:08.000Z",  # LastModified in a listing
        "2026-12-01T12:24:08Z",
        "2026-12-01T12:24:08.123456+02:00",
        1764591848,
        "1764591848",
    ],
)
def test_timestamp_parser_agrees_with_botocore(value: object) -> None:
    """The tier's client parses timestamps without dateutil (about 0.1 ms of client CPU per
    GET, benchmarks/bench_s3_cpu.py); what it returns must not change."""
    from botocore.utils import parse_timestamp as botocore_parse

    from kvtier.tiers.s3._client import parse_timestamp

    got = parse_timestamp(value)
    assert got == botocore_parse(value)
    assert got.tzinfo is not None
