"""The S3 tier's events: this node's stores and removals are LOCAL events, other nodes' (read
from their journals) REMOTE ones, and a key nobody announced is never removed."""

from __future__ import annotations

import os

import anyio
import anyio.lowlevel
import pytest

from devtools.weed_server import BUCKET, WeedServer, raw_client
from kvtier import BlockNotFoundError, CorruptBlockError, EventKind, LookupResult, TierEvent
from kvtier.testing import resolve_lookup
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3.index import _journal as s3_segments
from tests.support import INDEX_BY_HAND, MakeS3Tier, fresh_keys, s3_tier

BLOCK = 512


def block() -> memoryview:
    return memoryview(os.urandom(BLOCK))


def removed(key: bytes, tier: str, why: str, locality: str = "LOCAL") -> TierEvent:
    return TierEvent(EventKind.REMOVED, (key,), tier, locality=locality, reason=why)


async def overwrite(server: WeedServer, tier: S3Tier, key: bytes, body: bytes | None) -> None:
    """Another party changes ``key``'s object behind the tier's back (None: deletes it)."""
    async with raw_client(server.endpoint_url) as client:
        if body is None:
            await client.delete_object(Bucket=BUCKET, Key=tier.object_key(key))
        else:
            await client.put_object(Bucket=BUCKET, Key=tier.object_key(key), Body=body)


async def corrupt_deleted(tier: S3Tier, count: int) -> None:
    """Wait until the tier has deleted ``count`` corrupt objects (in its background)."""
    with anyio.fail_after(20):
        while tier.statistics().corrupt_deleted < count:
            await anyio.lowlevel.checkpoint()


async def test_another_nodes_blocks_are_remote_stored_events(
    weed_server: WeedServer, prefix: str
) -> None:
    keys = fresh_keys(3)
    async with (
        s3_tier(weed_server, prefix, name="here", **INDEX_BY_HAND) as here,
        s3_tier(weed_server, prefix, **INDEX_BY_HAND) as there,
    ):
        for key in keys:
            await there.store(key, block())
        await there.refresh_index()  # publishes its journal segment
        await here.refresh_index()
        events = here.events.drain()
        assert {k for e in events for k in e.keys} == set(keys)
        assert all(
            e == TierEvent(EventKind.STORED, e.keys, "here", locality="REMOTE") for e in events
        )
        await there.refresh_index()
        # A node does not learn its own blocks: it told them as it stored them.
        assert all(e.locality == "LOCAL" for e in there.events.drain())


@pytest.mark.parametrize("mode", ["index", "ask"])
async def test_a_store_is_one_local_stored_event(make_tier: MakeS3Tier, mode: str) -> None:
    keys = fresh_keys(4)
    async with make_tier(name="n", lookup_mode=mode, **INDEX_BY_HAND) as tier:
        await tier.store(keys[0], block())
        assert tier.events.drain() == [TierEvent(EventKind.STORED, (keys[0],), "n")]
        async with anyio.create_task_group() as tg:  # one pack in the index mode
            for key in keys[1:]:
                tg.start_soon(tier.store, key, block())
        events = tier.events.drain()
        assert sorted(k for e in events for k in e.keys) == sorted(keys[1:])
        assert all(e.kind is EventKind.STORED and e.locality == "LOCAL" for e in events)
        await tier.load(keys[2], memoryview(bytearray(BLOCK)))
        assert tier.events.drain() == []  # a load that finds its block says nothing


@pytest.mark.parametrize("mode", ["index", "ask"])
async def test_a_load_that_finds_a_block_corrupt_or_gone_removes_it(
    make_tier: MakeS3Tier, weed_server: WeedServer, mode: str
) -> None:
    keys = fresh_keys(2)
    async with make_tier(name="n", lookup_mode=mode, **INDEX_BY_HAND) as tier:
        for key in keys:
            await tier.store(key, block())
        tier.events.drain()
        await overwrite(weed_server, tier, keys[0], b"not a block at all")
        await overwrite(weed_server, tier, keys[1], None)
        with pytest.raises(CorruptBlockError):
            await tier.load(keys[0], memoryview(bytearray(BLOCK)))
        with pytest.raises(BlockNotFoundError):
            await tier.load(keys[1], memoryview(bytearray(BLOCK)))
        assert tier.events.drain() == [
            removed(keys[0], "n", "corrupt"),
            removed(keys[1], "n", "not_found"),
        ]
        with pytest.raises(BlockNotFoundError):  # no longer held: nothing more to say
            await tier.load(keys[1], memoryview(bytearray(BLOCK)))
        await tier.delete(keys[1])
        assert tier.events.drain() == []


@pytest.mark.parametrize("mode", ["index", "ask"])
async def test_a_miss_of_a_key_nobody_announced_says_nothing(
    make_tier: MakeS3Tier, mode: str
) -> None:
    (key,) = fresh_keys(1)
    async with make_tier(lookup_mode=mode, **INDEX_BY_HAND) as tier:
        assert await resolve_lookup(tier, key) is LookupResult.MISS
        with pytest.raises(BlockNotFoundError):
            await tier.load(key, memoryview(bytearray(BLOCK)))
        assert await tier.contains_many([key]) == [False]
        await tier.delete(key)
        await tier.refresh_index()
        assert tier.events.drain() == []


@pytest.mark.parametrize("why", ["deleted", "corrupt"])
async def test_a_block_one_node_deletes_is_removed_on_the_others(
    weed_server: WeedServer, prefix: str, why: str
) -> None:
    keys = fresh_keys(2)
    async with (
        s3_tier(weed_server, prefix, name="a", **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        for key in keys:
            await a.store(key, block())
        await a.refresh_index()
        await b.refresh_index()
        assert b.lookup(keys[0]) is LookupResult.HIT
        a.events.drain(), b.events.drain()
        if why == "deleted":
            await a.delete(keys[0])
        else:
            await overwrite(weed_server, a, keys[0], b"damaged")
            with pytest.raises(CorruptBlockError):
                await a.load(keys[0], memoryview(bytearray(BLOCK)))
            await corrupt_deleted(a, 1)
        assert a.events.drain() == [removed(keys[0], "a", why)]
        await b.refresh_index()  # nothing published yet: B still holds it
        assert b.lookup(keys[0]) is LookupResult.HIT and b.events.drain() == []
        await a.refresh_index()  # publishes the removal
        await b.refresh_index()
        assert b.events.drain() == [removed(keys[0], "b", why, "REMOTE")]
        assert b.lookup(keys[0]) is LookupResult.MISS
        assert b.lookup(keys[1]) is LookupResult.HIT
        assert b.statistics().index_forgotten == 1
        assert a.statistics().journal_segments_rejected == 0
        assert b.statistics().journal_segments_rejected == 0


@pytest.mark.parametrize("mode", ["index", "ask"])
async def test_a_block_removed_behind_kvtiers_back_is_published_by_the_node_that_found_it(
    weed_server: WeedServer, prefix: str, mode: str
) -> None:
    """Nobody deletes it through kvtier (a lifecycle rule, a person): the node whose load
    finds it gone publishes its removal, so every other node drops it and stops vouching for
    it in its full state, instead of holding it until it loads it itself."""
    keys = fresh_keys(2)
    async with (
        s3_tier(weed_server, prefix, name="a", lookup_mode=mode, **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        for key in keys:
            await a.store(key, block())
        await a.refresh_index()
        await b.refresh_index()
        assert b.lookup(keys[0]) is LookupResult.HIT
        a.events.drain(), b.events.drain()
        await overwrite(weed_server, a, keys[0], None)  # behind kvtier's back
        with pytest.raises(BlockNotFoundError):
            await a.load(keys[0], memoryview(bytearray(BLOCK)))
        assert a.events.drain() == [removed(keys[0], "a", "not_found")]
        await a.refresh_index()  # publishes the removal
        await b.refresh_index()  # reads it, finds the object gone: dropped
        assert b.events.drain() == [removed(keys[0], "b", "deleted", "REMOTE")]
        assert b.lookup(keys[0]) is LookupResult.MISS
        assert sorted(b.held_keys()) == [keys[1]]
        assert b.statistics().index_forgotten == 1


async def test_a_block_removed_behind_kvtiers_back_and_stored_again_stays_held(
    weed_server: WeedServer, prefix: str
) -> None:
    """The removal a load found is checked by the others like a delete: a node that stored
    the block again before they read it keeps it, and they with it."""
    (key,) = fresh_keys(1)
    async with (
        s3_tier(weed_server, prefix, name="a", **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
        s3_tier(weed_server, prefix, name="c", **INDEX_BY_HAND) as c,
    ):
        assert await c.wait_index_loaded()  # c never learns the key: its store lands
        await a.store(key, block())
        await a.refresh_index()
        await b.refresh_index()
        await overwrite(weed_server, a, key, None)
        with pytest.raises(BlockNotFoundError):
            await a.load(key, memoryview(bytearray(BLOCK)))
        await c.store(key, block())
        assert c.statistics().stores_skipped_existing == 0
        await a.refresh_index()  # the removal, published after c's PUT
        b.events.drain()
        await b.refresh_index()
        assert b.events.drain() == []  # checked: there again, held all along
        assert b.lookup(key) is LookupResult.HIT
        assert b.statistics().index_removals_kept == 1
        await b.load(key, memoryview(bytearray(BLOCK)))


async def test_a_block_stored_again_after_its_removal_stays_held(
    weed_server: WeedServer, prefix: str
) -> None:
    (key,) = fresh_keys(1)
    async with (
        s3_tier(weed_server, prefix, name="a", **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        await a.store(key, block())
        await a.refresh_index()
        await b.refresh_index()
        b.events.drain()
        await a.delete(key)
        await a.refresh_index()  # the removal's segment
        await a.store(key, block())
        await a.refresh_index()  # a later segment stores it again
        await b.refresh_index()  # reads both; the removal is checked against the bucket
        assert b.events.drain() == []  # held all along: nothing to tell
        assert b.lookup(key) is LookupResult.HIT
        assert b.statistics().index_removals_kept == 1
        await b.load(key, memoryview(bytearray(BLOCK)))


async def test_a_reader_that_predates_removals_ignores_them_and_keeps_the_stores(
    weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader from before removal segments decoded every segment as a store segment: it
    rejects a removal segment whole (counted) and still learns every stored key."""
    keys = fresh_keys(3)
    async with (
        s3_tier(weed_server, prefix, **INDEX_BY_HAND) as writer,
        s3_tier(weed_server, prefix, name="old", **INDEX_BY_HAND) as old,
    ):
        assert await old.wait_index_loaded()  # its load's journal read is over: the test reads
        for key in keys[:2]:
            await writer.store(key, block())
        await writer.refresh_index()
        await writer.delete(keys[0])
        await writer.store(keys[2], block())
        await writer.refresh_index()  # a store segment and a removal segment
        assert writer.statistics().journal_segments_published == 3
        monkeypatch.setattr(s3_segments, "is_removal_segment", lambda data: False)
        await old.refresh_index()
        stats = old.statistics()
        assert stats.journal_segments_read == 3 and stats.journal_segments_rejected == 1
        assert [old.lookup(key) for key in keys] == [LookupResult.HIT] * 3  # keys[0]: stale
        events = old.events.drain()
        assert {k for e in events for k in e.keys} == set(keys)
        assert all(e.kind is EventKind.STORED and e.locality == "REMOTE" for e in events)
