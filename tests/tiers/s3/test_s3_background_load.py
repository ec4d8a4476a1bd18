"""An S3 tier that opens at once and loads its index in the background
(``index_background_load``), against a real SeaweedFS: first HITs before the
index is complete, a key deleted meanwhile never brought back, a close during the load that
leaves nothing running and no waiter hanging (the index's own rules while it loads:
``test_s3_load_rules``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from devtools.weed_server import BUCKET, WeedServer, raw_client
from kvtier import BlockNotFoundError, LifecycleError, LookupResult, TierUnavailableError
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3.index import ExistenceIndex
from kvtier.tiers.s3.index import _snapshot_directory as snapshot_directory
from kvtier.tiers.s3.index import _snapshot_format as snapshot_format
from kvtier.tiers.s3.index import _snapshot_stream as snapshot_stream
from kvtier.tiers.s3.index._journal_format import journal_prefix
from kvtier.tiers.s3.index._snapshot_format import BodyDecoder
from tests.support import INDEX_BY_HAND, MakeS3Tier, fresh_keys

BLOCK = 4096
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY

# -- against SeaweedFS ---------------------------------------------------------------------------


async def _fill(make_tier: MakeS3Tier, packed: list[bytes], alone: bytes) -> None:
    """``packed`` as one pack, ``alone`` as its own object; published at the close."""
    async with make_tier(index_background_load=True, **INDEX_BY_HAND) as tier:
        payload = memoryview(os.urandom(BLOCK))
        assert await tier.store_many(packed, [payload] * len(packed)) == [None] * len(packed)
        await tier.store(alone, payload)
        stats = tier.statistics()
        assert (stats.packs_written, stats.blocks_packed) == (1, len(packed))


async def _forget_the_journal(server: WeedServer, prefix: str) -> None:
    """Delete the journal: a node opening now learns the keys only from the listing."""
    async with raw_client(server.endpoint_url) as client:
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=journal_prefix(prefix))
        for item in page.get("Contents", ()):
            await client.delete_object(Bucket=BUCKET, Key=item["Key"])


class HeldLoad:
    """Holds a tier's listing (or snapshot) at open until ``release``: ``reached`` once it
    is about to start, ``journal_read`` once the journal read beside it ended, ``done`` once
    the whole load ended."""

    def __init__(self, tier: S3Tier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self.gate, self.done = anyio.Event(), anyio.Event(), anyio.Event()
        self.journal_read = anyio.Event()
        sync = tier._sync
        listing, journal, load = sync.list_at_open, sync._read_recent, sync.load_in_background

        async def held(survey: object = None) -> None:
            self.reached.set()
            await self.gate.wait()
            await listing()  # the folder listed again: what the test put there meanwhile

        async def read() -> None:
            try:
                await journal()
            finally:
                self.journal_read.set()

        async def loading() -> None:
            try:
                await load()
            finally:
                self.done.set()

        monkeypatch.setattr(sync, "list_at_open", held)
        monkeypatch.setattr(sync, "_read_recent", read)
        monkeypatch.setattr(sync, "load_in_background", loading)

    async def wait_held(self) -> None:
        """Until the listing is held and the journal read."""
        with anyio.fail_after(30):
            await self.reached.wait()
            await self.journal_read.wait()

    def release(self) -> None:
        self.gate.set()


async def _verdict(tier: S3Tier, key: bytes) -> LookupResult:
    """The answer for ``key`` once its existence check landed (a listener tells when)."""
    landed = anyio.Event()

    def heard(changed: bytes) -> None:
        if changed == key:
            landed.set()

    remove = tier.add_listener(heard)
    try:
        first = tier.lookup(key)
        if first is not RETRY:
            return first
        with anyio.fail_after(30):
            await landed.wait()
        return tier.lookup(key)
    finally:
        remove()


@asynccontextmanager
async def _opened(tier: S3Tier) -> AsyncIterator[S3Tier]:
    await tier.open()
    try:
        yield tier
    finally:
        await tier.aclose()


async def test_first_hits_before_the_index_is_complete(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, (alone, never) = fresh_keys(6), fresh_keys(2)
    await _fill(make_tier, packed, alone)
    # The journal holds every key: it is read first, so all are HITs before the listing.
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        stats = tier.statistics()
        assert stats.index_loading and not stats.index_listing_complete
        assert [tier.lookup(k) for k in [*packed, alone]] == [HIT] * 7
        assert await _verdict(tier, never) is MISS  # asked of the bucket: not there
        load.release()
        with anyio.fail_after(30):
            await load.done.wait()
        stats = tier.statistics()
        assert not stats.index_loading and stats.index_listing_complete
        assert stats.index_keys == 7
        # The HEAD made while the index loaded is the load's, not the request path's.
        assert (stats.index_load_requests, stats.request_path_requests) == (1, 0)
    # Without the journal: the key's own object is found by asking, the packed ones (a HEAD
    # by key cannot see a pack's blocks) once the listing brought them.
    await _forget_the_journal(weed_server, prefix)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        assert tier.statistics().index_keys == 0
        assert await _verdict(tier, alone) is HIT  # before the index knows it
        dst = memoryview(bytearray(BLOCK))
        await tier.load(alone, dst)  # and it loads, verified as every load is
        assert await _verdict(tier, packed[0]) is MISS
        assert tier.lookup_with_reason(never)[0] is RETRY
        load.release()
        with anyio.fail_after(30):
            await load.done.wait()
        assert [tier.lookup(k) for k in [*packed, alone]] == [HIT] * 7
        assert tier.lookup(never) is MISS
        stats = tier.statistics()
        assert stats.index_listing_complete and stats.index_listed == 7


async def test_a_key_deleted_during_the_load_is_not_brought_back(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, (alone,) = fresh_keys(4), fresh_keys(1)
    await _fill(make_tier, packed, alone)
    await _forget_the_journal(weed_server, prefix)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        await tier.delete(packed[0])  # the index does not know its pack yet: only its name
        assert await _verdict(tier, packed[0]) is MISS
        load.release()
        with anyio.fail_after(30):
            await load.done.wait()
        # The listing read the pack's table, older than the delete: the key stays a miss.
        assert tier.lookup(packed[0]) is MISS
        assert [tier.lookup(k) for k in packed[1:]] == [HIT] * 3
        assert tier.statistics().index_load_skipped == 1


@pytest.mark.parametrize("held", ["listing", "journal"])
async def test_a_close_during_the_load_leaves_nothing_running(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    packed, (alone, unknown) = fresh_keys(4), fresh_keys(2)
    await _fill(make_tier, packed, alone)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    reached, never = anyio.Event(), anyio.Event()

    async def stalls(*args: object, **kwargs: object) -> None:
        reached.set()
        await never.wait()  # a listing or a journal read that never ends

    sync = tier._sync
    target: Callable[..., Awaitable[object]] = stalls
    monkeypatch.setattr(sync, "list_at_open" if held == "listing" else "poll", target)
    before = asyncio.all_tasks()
    with anyio.fail_after(30):
        await tier.open()
        await reached.wait()
        assert tier.statistics().index_loading
        try:
            assert tier.lookup(unknown) is RETRY  # asked meanwhile: a check in flight
        finally:
            await tier.aclose()
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert left == [], f"tasks left running after the close: {left}"
    stats = tier.statistics()
    assert not stats.index_loading and not stats.index_listing_complete
    assert stats.lookups.pending == stats.lookups.in_flight == 0
    assert tier.lookup(packed[0]) is MISS  # closed: unavailable


SNAPSHOT_BY_HAND = {"index_refresh": 3600.0, "index_lookback": 7200.0, "index_snapshot_every": 60.0}


async def test_a_snapshot_loaded_in_the_background_serves_all_but_a_key_deleted_meanwhile(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, (alone,) = fresh_keys(6), fresh_keys(1)
    async with make_tier(**SNAPSHOT_BY_HAND) as writer:
        await writer.wait_index_loaded()  # its journal view starts there: it may compact
        payload = memoryview(os.urandom(BLOCK))
        assert await writer.store_many(packed, [payload] * 6) == [None] * 6
        await writer.store(alone, payload)
        sync, snapshots = writer._sync, writer._sync.snapshots
        assert snapshots is not None and sync.covered_ms is not None
        found = await snapshots.survey(int(sync._wall() * 1000))
        assert await snapshots.compact(found, sync.covered_ms)
    await _forget_the_journal(weed_server, prefix)  # the snapshot is all there is to learn
    tier = make_tier(index_background_load=True, **SNAPSHOT_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        assert tier.statistics().index_keys == 0
        await tier.delete(packed[0])
        load.release()
        with anyio.fail_after(30):
            await load.done.wait()
        assert tier._sync.snapshots is not None and tier._sync.snapshots.loaded == 1
        assert [tier.lookup(k) for k in packed] == [MISS] + [HIT] * 5
        assert tier.lookup(alone) is HIT
        stats = tier.statistics()
        assert stats.index_listing_complete and not stats.index_loading
        assert stats.index_load_skipped == 1


async def test_a_failed_journal_read_does_not_stop_the_load(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, (alone,) = fresh_keys(3), fresh_keys(1)
    await _fill(make_tier, packed, alone)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)

    async def fails(*args: object, **kwargs: object) -> list[bytes]:
        raise TierUnavailableError("the journal is down", tier=tier.name, operation="list")

    monkeypatch.setattr(tier._sync, "poll", fails)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        load.release()
        with anyio.fail_after(30):
            await load.done.wait()
        assert [tier.lookup(k) for k in [*packed, alone]] == [HIT] * 4
        stats = tier.statistics()
        assert stats.index_listing_complete and stats.index_refresh_failures == 1


async def test_the_journal_read_first_takes_every_segment_in_order(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More segments than one window of GETs at once, from two writers, and one of them a
    removal: every key the journal holds is a HIT before the listing, the removed one not."""
    keys = fresh_keys(11)
    payload = memoryview(os.urandom(BLOCK))
    background = {"index_background_load": True, **INDEX_BY_HAND}
    async with make_tier(**background) as a, make_tier(**background) as b:
        for i, key in enumerate(keys):
            await (a if i % 2 else b).store(key, payload)
            await (a if i % 2 else b).refresh_index()  # one segment per key
        await a.delete(keys[1])
        await a.refresh_index()  # and a removal segment
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        assert [tier.lookup(k) for k in keys[:1] + keys[2:]] == [HIT] * 10
        assert await _verdict(tier, keys[1]) is MISS  # checked, dropped, then asked: gone
        assert tier.statistics().journal_segments_read == 12
        load.release()
        with anyio.fail_after(30):
            await load.done.wait()
        assert [tier.lookup(k) for k in keys] == [HIT, MISS] + [HIT] * 9


async def test_a_packed_block_asked_for_before_its_pack_is_indexed_is_brought_by_the_load(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of a packed block before the listing brought its pack looks for the block's own
    object and finds nothing: a miss then, but the listing still indexes the block."""
    packed, (alone,) = fresh_keys(4), fresh_keys(1)
    await _fill(make_tier, packed, alone)
    await _forget_the_journal(weed_server, prefix)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        with pytest.raises(BlockNotFoundError):
            await tier.load(packed[0], memoryview(bytearray(BLOCK)))
        load.release()
        assert await tier.wait_index_loaded()
        assert [tier.lookup(k) for k in packed] == [HIT] * 4
        assert tier.statistics().index_load_skipped == 0
        out = bytearray(BLOCK)
        await tier.load(packed[0], memoryview(out))  # from its pack now


async def test_wait_index_loaded_returns_when_the_tier_closes_during_the_load(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter is never left hanging: a close during the load wakes it (not complete)."""
    packed, (alone,) = fresh_keys(2), fresh_keys(1)
    await _fill(make_tier, packed, alone)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    load = HeldLoad(tier, monkeypatch)
    answers: list[bool] = []
    waiting = anyio.Event()

    async def waiter() -> None:
        waiting.set()
        answers.append(await tier.wait_index_loaded())

    before = asyncio.all_tasks()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:  # the tier's own groups nest inside it
            await tier.open()
            try:
                await load.wait_held()
                tg.start_soon(waiter)
                await waiting.wait()
            finally:
                await tier.aclose()  # the load never released: the close cuts it short
    assert answers == [False]
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert left == [], f"tasks left running after the close: {left}"
    stats = tier.statistics()
    assert not stats.index_loading and not stats.index_listing_complete


async def test_a_reopened_tier_is_not_complete_until_its_new_load_ends(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index's ``complete`` says what the running load has done, not the last open's."""
    packed, (alone,) = fresh_keys(2), fresh_keys(1)
    await _fill(make_tier, packed, alone)
    tier = make_tier(index_background_load=True, **INDEX_BY_HAND)
    async with _opened(tier):
        assert await tier.wait_index_loaded()
        assert tier.statistics().index_listing_complete
    load = HeldLoad(tier, monkeypatch)
    async with _opened(tier):
        await load.wait_held()
        stats = tier.statistics()
        assert stats.index_loading and not stats.index_listing_complete
        load.release()
        assert await tier.wait_index_loaded()
        stats = tier.statistics()
        assert stats.index_listing_complete and not stats.index_loading


async def test_wait_index_loaded_in_the_ask_mode_and_inside_open(make_tier: MakeS3Tier) -> None:
    """Nothing to wait for: the ask mode keeps no index (False), and a tier that loads its
    index inside ``open()`` has it when open returns."""
    async with make_tier(lookup_mode="ask") as tier:
        assert await tier.wait_index_loaded() is False
    async with make_tier(index_background_load=False) as tier:
        assert not tier.statistics().index_loading
        assert await tier.wait_index_loaded() is True
    with pytest.raises(LifecycleError):
        await make_tier().wait_index_loaded()  # not open


@pytest.mark.parametrize("then", ["released", "closed"])
async def test_a_snapshot_serves_its_first_keys_while_the_rest_arrives(
    make_tier: MakeS3Tier,
    weed_server: WeedServer,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    then: str,
) -> None:
    """The body is indexed chunk by chunk as it arrives: with the read held after its first
    chunk, that chunk's keys are HITs, the rest not known yet; released, all are. A close
    while it is held ends the read and leaves nothing running."""
    monkeypatch.setattr(snapshot_format, "MAX_SEGMENT_ENTRIES", 4)  # chunks of 4 keys
    monkeypatch.setattr(snapshot_stream, "_PIECE", 64)  # a few bytes at a time
    keys = fresh_keys(12)
    async with make_tier(**SNAPSHOT_BY_HAND) as writer:
        await writer.wait_index_loaded()
        for key in keys:  # one by one: not packed
            await writer.store(key, memoryview(os.urandom(BLOCK)))
        sync, snapshots = writer._sync, writer._sync.snapshots
        assert snapshots is not None and sync.covered_ms is not None
        found = await snapshots.survey(int(sync._wall() * 1000))
        assert await snapshots.compact(found, sync.covered_ms)
    await _forget_the_journal(weed_server, prefix)  # the snapshot is all there is to learn
    first_chunk, gate = anyio.Event(), anyio.Event()
    take = snapshot_stream._take

    async def held(
        decoder: BodyDecoder,
        piece: bytes,
        index: ExistenceIndex,
        streamed: Callable[[int], None] | None,
    ) -> None:
        await take(decoder, piece, index, streamed)
        if decoder.entries and not first_chunk.is_set():
            first_chunk.set()
            await gate.wait()

    monkeypatch.setattr(snapshot_stream, "_take", held)
    before = asyncio.all_tasks()
    async with make_tier(index_background_load=True, **SNAPSHOT_BY_HAND) as tier:
        with anyio.fail_after(30):
            await first_chunk.wait()
        # The body is sorted by key: its first chunk holds the four smallest.
        assert [tier.lookup(k) for k in sorted(keys)[:4]] == [HIT] * 4
        stats = tier.statistics()
        assert stats.index_loading and not stats.index_listing_complete
        assert stats.index_keys == 4
        if then == "released":
            gate.set()
            assert await tier.wait_index_loaded()
            assert [tier.lookup(k) for k in keys] == [HIT] * 12
            assert tier._sync.snapshots is not None and tier._sync.snapshots.loaded == 1
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert left == [], f"tasks left running after the close: {left}"
    stats = tier.statistics()
    assert not stats.index_loading
    assert stats.index_listing_complete is (then == "released")


class HeldBody:
    """Holds a tier's read of a snapshot body before its first piece is indexed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self.gate = anyio.Event(), anyio.Event()
        take = snapshot_stream._take

        async def held(
            decoder: BodyDecoder,
            piece: bytes,
            index: ExistenceIndex,
            streamed: Callable[[int], None] | None,
        ) -> None:
            self.reached.set()
            await self.gate.wait()
            await take(decoder, piece, index, streamed)

        monkeypatch.setattr(snapshot_stream, "_take", held)


async def _snapshot_of(
    make_tier: MakeS3Tier,
    weed_server: WeedServer,
    prefix: str,
    packed: list[bytes],
    alone: list[bytes],
) -> None:
    """``packed`` as one pack and each of ``alone`` as its own object, in a snapshot of
    chunks of two keys; the journal deleted, so the snapshot is all there is to learn."""
    async with make_tier(**SNAPSHOT_BY_HAND) as writer:
        await writer.wait_index_loaded()  # its journal view starts there: it may compact
        payload = memoryview(os.urandom(BLOCK))
        assert await writer.store_many(packed, [payload] * len(packed)) == [None] * len(packed)
        for key in alone:
            await writer.store(key, payload)
        sync, snapshots = writer._sync, writer._sync.snapshots
        assert snapshots is not None and sync.covered_ms is not None
        found = await snapshots.survey(int(sync._wall() * 1000))
        assert await snapshots.compact(found, sync.covered_ms)
    await _forget_the_journal(weed_server, prefix)


async def test_any_key_of_a_snapshot_is_found_while_its_body_is_held(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the body's read held before its first chunk, a key late in the body and a key
    inside a pack (not its first) are found through the body's directory: one ranged GET of
    the chunk that holds each, counted as the load's requests, not the request path's."""
    monkeypatch.setattr(snapshot_directory, "SORTED_CHUNK_ENTRIES", 2)
    packed, alone, (never,) = fresh_keys(6), fresh_keys(5), fresh_keys(1)
    await _snapshot_of(make_tier, weed_server, prefix, packed, alone)
    everything = sorted([*packed, *alone])
    late = everything[-1]
    member = max(packed[1:], key=everything.index)  # in a pack, not the key that names it
    body = HeldBody(monkeypatch)
    async with make_tier(index_background_load=True, **SNAPSHOT_BY_HAND) as tier:
        with anyio.fail_after(30):
            await body.reached.wait()
        assert tier.statistics().index_keys == 0
        assert await _verdict(tier, late) is HIT
        assert await _verdict(tier, member) is HIT
        # Not in the chunk that would hold it, nor in the journal: MISS, with no HEAD.
        assert await _verdict(tier, never) is MISS
        sections = tier._sync.snapshots.sections if tier._sync.snapshots else None
        assert sections is not None and sections.chunks == sections.gets >= 1
        stats = tier.statistics()
        assert stats.index_loading and stats.request_path_requests == 0
        assert stats.index_load_requests == sections.gets  # the chunks' GETs, nothing else
        assert stats.index_keys < len(everything)  # the chunks asked for, not the body
        body.gate.set()
        assert await tier.wait_index_loaded()
        assert [tier.lookup(k) for k in everything] == [HIT] * len(everything)
        assert tier.lookup(never) is MISS
        assert tier.statistics().request_path_requests == 0


async def test_a_forged_directory_costs_a_wait_never_a_wrong_answer(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory that does not name the body is not used: a packed key waits for the body
    (a HEAD by its name cannot see it), and the load still ends complete."""
    monkeypatch.setattr(snapshot_directory, "SORTED_CHUNK_ENTRIES", 2)
    packed, alone = fresh_keys(4), fresh_keys(1)
    await _snapshot_of(make_tier, weed_server, prefix, packed, alone)
    async with raw_client(weed_server.endpoint_url) as client:
        page = await client.list_objects_v2(
            Bucket=BUCKET, Prefix=f"{prefix}/_kvtier_snapshots/dir-"
        )
        (item,) = page["Contents"]
        await client.put_object(Bucket=BUCKET, Key=item["Key"], Body=b"KVD1" + b"\x00" * 40)
    body = HeldBody(monkeypatch)
    async with make_tier(index_background_load=True, **SNAPSHOT_BY_HAND) as tier:
        with anyio.fail_after(30):
            await body.reached.wait()
        assert tier._sync.snapshots is not None and tier._sync.snapshots.sections is None
        assert await _verdict(tier, packed[1]) is MISS  # not found by its name: not yet known
        assert await _verdict(tier, alone[0]) is HIT  # its own object: the HEAD finds it
        body.gate.set()
        assert await tier.wait_index_loaded()
        assert [tier.lookup(k) for k in [*packed, *alone]] == [HIT] * 5
