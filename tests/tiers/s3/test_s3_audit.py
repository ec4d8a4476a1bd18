"""The S3 index's audit against a listing of the bucket: an object removed behind kvtier's back
that nobody loads, and a store whose journal segment never reached the others, are found,
told and published; one node audits an interval; the index's bookkeeping of an audit."""

from __future__ import annotations

import os
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from devtools.weed_server import BUCKET, WeedServer, raw_client
from kvtier import EventKind, LookupResult, TierEvent
from kvtier.tiers.s3.index import ExistenceIndex
from kvtier.tiers.s3.index._audit import audit_marker
from kvtier.tiers.s3.index._journal_format import journal_prefix
from tests.support import INDEX_BY_HAND, fresh_keys, s3_tier

BLOCK = 512


def block() -> memoryview:
    return memoryview(os.urandom(BLOCK))


def keys_of(events: list[TierEvent], kind: EventKind) -> set[bytes]:
    return {k for e in events if e.kind is kind for k in e.keys}


async def remove_behind_kvtiers_back(server: WeedServer, names: list[str]) -> None:
    async with raw_client(server.endpoint_url) as client:
        for name in names:
            await client.delete_object(Bucket=BUCKET, Key=name)


async def names_under(server: WeedServer, prefix: str) -> list[str]:
    async with raw_client(server.endpoint_url) as client:
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for item in page.get("Contents", ())]


@pytest.mark.parametrize("pack_blocks", [1, 4])
async def test_a_block_removed_behind_kvtiers_back_is_found_by_an_audit_and_published(
    weed_server: WeedServer, prefix: str, pack_blocks: int
) -> None:
    keys = fresh_keys(8)
    async with (
        s3_tier(weed_server, prefix, name="a", pack_blocks=pack_blocks, **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        await a.store_many(keys, [block() for _ in keys])
        await a.refresh_index()
        await b.refresh_index()
        assert all(b.lookup(k) is LookupResult.HIT for k in keys)
        # Removed by a lifecycle rule or a person: the first key's object (its pack, packed).
        where = a._index.location(keys[0])
        packs = {k: getattr(a._index.location(k), "pack", None) for k in keys}
        gone = [k for k in keys if k == keys[0] or (where and packs[k] == where.pack)]
        await remove_behind_kvtiers_back(
            weed_server, [a.object_key(keys[0]) if where is None else where.pack]
        )
        a.events.drain(), b.events.drain()
        await a.refresh_index()
        assert a.lookup(keys[0]) is LookupResult.HIT  # nobody announced it

        await a.audit_index()
        assert a.lookup(keys[0]) is LookupResult.HIT  # doubted: checked at the next round
        await a.refresh_index()  # the check: gone, dropped, told as this node's finding
        assert [k for k in keys if a.lookup(k) is LookupResult.MISS] == gone
        (event,) = a.events.drain()
        assert (event.kind, set(event.keys), event.reason) == (
            EventKind.REMOVED,
            set(gone),
            "not_found",
        )
        assert event.locality == "LOCAL"
        await a.refresh_index()  # published in a's removal segment
        await b.refresh_index()  # read, checked, dropped
        assert [k for k in keys if b.lookup(k) is LookupResult.MISS] == gone
        assert keys_of(b.events.drain(), EventKind.REMOVED) == set(gone)
        stats = a.statistics()
        assert (stats.index_audits, stats.index_audit_removed) == (1, len(gone))
        assert stats.index_audit_learnt == 0


async def test_a_store_whose_segment_nobody_read_is_learnt_by_an_audit(
    weed_server: WeedServer, prefix: str
) -> None:
    keys = fresh_keys(3)
    async with (
        s3_tier(weed_server, prefix, name="a", **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        # A node stores and dies before the others read its journal segment (here the
        # segment is removed; a SIGKILL before the publish leaves none at all).
        async with s3_tier(weed_server, prefix, pack_blocks=1, **INDEX_BY_HAND) as lost:
            await lost.store_many(keys, [block() for _ in keys])
        await remove_behind_kvtiers_back(
            weed_server, await names_under(weed_server, journal_prefix(prefix))
        )
        await a.refresh_index()
        assert all(a.lookup(k) is LookupResult.MISS for k in keys)
        a.events.drain()

        assert a.statistics().index_audit_seconds == 0.0  # no audit yet
        await a.audit_index()
        assert all(a.lookup(k) is LookupResult.HIT for k in keys)
        assert keys_of(a.events.drain(), EventKind.STORED) == set(keys)
        assert a.statistics().index_audit_learnt == len(keys)
        assert a.statistics().index_audit_seconds > 0.0  # how late its findings may be
        await a.refresh_index()  # published in a's journal
        await b.refresh_index()
        assert all(b.lookup(k) is LookupResult.HIT for k in keys)
        got = bytearray(BLOCK)
        await b.load(keys[0], memoryview(got))  # the block the dead node stored


async def test_one_node_audits_an_interval_and_clears_older_markers(
    weed_server: WeedServer, prefix: str
) -> None:
    settings: dict[str, Any] = {**INDEX_BY_HAND, "index_audit_every": 3600.0}
    async with (
        s3_tier(weed_server, prefix, name="a", **settings) as a,
        s3_tier(weed_server, prefix, name="b", **settings) as b,
    ):
        if not a.statistics().conditional_put:
            pytest.skip("this server ignores If-None-Match: every node audits")
        audits = [a._sync.audit, b._sync.audit]
        won: list[bool] = []

        async def turn(i: int) -> None:
            won.append(await audits[i].turn(7))

        async with anyio.create_task_group() as tg:
            tg.start_soon(turn, 0)
            tg.start_soon(turn, 1)
        assert sorted(won) == [False, True]
        assert a.statistics().index_audits + b.statistics().index_audits == 1
        assert await audits[0].turn(9) or await audits[1].turn(9)
        markers = await names_under(weed_server, audit_marker(prefix, 3_600_000, 0)[:-16])
        assert markers == [audit_marker(prefix, 3_600_000, 9)]  # 7's went with 9's audit


async def test_audits_run_on_their_own_every_interval(weed_server: WeedServer, prefix: str) -> None:
    key = fresh_keys(1)[0]
    async with s3_tier(
        weed_server,
        prefix,
        name="a",
        pack_blocks=1,
        index_refresh=0.2,
        index_lookback=5.0,
        index_audit_every=0.5,
    ) as a:
        await a.store(key, block())
        await remove_behind_kvtiers_back(weed_server, [a.object_key(key)])
        a.events.drain()
        with anyio.fail_after(20):  # an audit, then a refresh round's check
            while not a.events.drain():
                await anyio.lowlevel.checkpoint()
        assert a.lookup(key) is LookupResult.MISS
        assert a.statistics().index_audit_removed == 1


def index_holding(*keys: bytes) -> ExistenceIndex:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    for key in keys:
        index.add(key)
    return index


def test_an_audit_doubt_found_there_stays_and_found_gone_is_published_as_deleted() -> None:
    there, gone, deleted_meanwhile = fresh_keys(3)
    index = index_holding(there, gone, deleted_meanwhile)
    assert index.audit_doubt([there, gone, deleted_meanwhile, b"unknown"]) == 3
    taken = {key for key, _, _ in index.take_doubts(10)}
    assert taken == {there, gone, deleted_meanwhile}
    index.deleted(deleted_meanwhile, "deleted")  # this node's own act is newer
    assert index.settle(there, True) is None
    assert index.settle(gone, False) == "not_found"
    assert index.settle(deleted_meanwhile, False) is None
    assert there in index and gone not in index
    assert index.removals_kept == 0 and index.audit_removed == 1
    assert sorted(index.take_removals()) == sorted(
        [(gone, "deleted"), (deleted_meanwhile, "deleted")]
    )


def test_an_audit_does_not_learn_a_key_that_went_while_it_listed() -> None:
    known, went, new = fresh_keys(3)
    index = index_holding(known, went)
    index.begin_audit()
    index.discard(went)  # a load found it gone, or another node's removal was checked
    assert not index.audit_learn(went, None)
    assert not index.audit_learn(known, None)  # known already: nothing to publish
    assert index.audit_learn(new, None)
    index.end_audit()
    assert went not in index and new in index
    assert [key for key, _ in index.take_unpublished()] == [new]
    assert index.audit_learn(went, None)  # once the listing is over, a later audit may


async def test_an_audit_in_the_ask_mode_is_refused(weed_server: WeedServer, prefix: str) -> None:
    async with s3_tier(weed_server, prefix, lookup_mode="ask") as tier:
        with pytest.raises(ValueError, match="no index to audit"):
            await tier.audit_index()


def test_the_marker_names_its_interval_under_the_prefix() -> None:
    name = audit_marker("p", 600_000, 42)
    assert name.startswith("p/_kvtier_audits/") and name.endswith("000000000000042")
