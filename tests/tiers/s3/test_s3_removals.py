"""Removals in the S3 tier's journal: the removal segment's format by example (the fuzzing is
in ``test_s3_untrusted``), the index's bookkeeping of keys deleted here and elsewhere, and
several nodes on the run's SeaweedFS deleting and storing one key again."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from devtools.weed_server import WeedServer
from kvtier import BlockNotFoundError, EventKind, IntegrityKey, LookupResult
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index import ExistenceIndex
from kvtier.tiers.s3.index._journal_format import (
    MAX_SEGMENT_ENTRIES,
    SegmentError,
    decode_removals,
    decode_segment,
    encode_removals,
    encode_segment,
    is_removal_segment,
    journal_prefix,
    segment_name,
)
from tests.support import INDEX_BY_HAND, ManualClock, fresh_keys, s3_tier
from tests.tiers.s3.s3_forge import forged_removals

KEY = IntegrityKey("correct horse battery staple 0123456789")
WRITER = "0123456789abcdef"
NAME = segment_name("p", 1500, WRITER, 3)  # the object a segment is read from


def test_removal_segment_round_trip_and_damage() -> None:
    entries = [(os.urandom(16), "deleted"), (os.urandom(255), "corrupt"), (b"k", "deleted")]
    data = encode_removals(entries, "p")
    assert data[:4] == b"KVR1" and is_removal_segment(data)
    assert decode_removals(data, "p") == (entries, 0)
    assert decode_removals(encode_removals([], "p"), "p") == ([], 0)
    flipped = bytearray(data)
    flipped[12] ^= 1
    for bad in (bytes(flipped), data[:-3], b"", data + b"x", b"KVJ1" + data[4:]):
        with pytest.raises(SegmentError):
            decode_removals(bad, "p")
    with pytest.raises(ValueError, match="at most"):
        encode_removals([(b"k", "deleted")] * (MAX_SEGMENT_ENTRIES + 1), "p")


def test_removal_entries_with_a_bad_key_or_reason_are_ignored_and_counted() -> None:
    good = [(os.urandom(16), 1), (os.urandom(32), 2)]
    bad = [(b"", 1), (os.urandom(256), 1), (os.urandom(16), 0), (os.urandom(16), 3)]
    found, rejected = decode_removals(forged_removals([*good, *bad]), "p")
    assert found == [(good[0][0], "deleted"), (good[1][0], "corrupt")]
    assert rejected == len(bad)


def test_signed_removals_verify_only_under_their_key_prefix_and_name() -> None:
    entries = [(os.urandom(16), "deleted")]
    signed = encode_removals(entries, "p", integrity_key=KEY, name=NAME)
    assert signed[:4] == b"KVR3"
    assert decode_removals(signed, "p", integrity_key=KEY, name=NAME) == (entries, 0)
    other = IntegrityKey("another secret of at least sixteen bytes")
    # Signed as before the MAC covered the name: refused, it could be replayed under any.
    body = b"KVR2" + signed[4:-32]
    unnamed = body + KEY.mac(body, journal_prefix("p").encode())

    def read(data: bytes, prefix: str = "p", **kw: Any) -> object:
        given: dict[str, Any] = {"integrity_key": KEY, "name": NAME}
        return decode_removals(data, prefix, **(given | kw))

    attempts: dict[str, Callable[[], object]] = {
        "another key": lambda: read(signed, integrity_key=other),
        "another prefix": lambda: read(signed, "q", name=segment_name("q", 1500, WRITER, 3)),
        "another name": lambda: read(signed, name=segment_name("p", 2500, WRITER, 4)),
        "no name": lambda: read(signed, name=None),
        "no key": lambda: read(signed, integrity_key=None),
        "unsigned": lambda: read(encode_removals(entries, "p")),
        "signed without its name": lambda: read(unnamed),
        "a store segment": lambda: read(
            encode_segment([(entries[0][0], None)], "p", integrity_key=KEY, name=NAME)
        ),
    }
    for what, attempt in attempts.items():
        with pytest.raises(SegmentError):  # noqa: PT012 - the message names the case
            attempt()
            pytest.fail(what)


@pytest.mark.parametrize("signed", [False, True])
def test_the_store_decoder_refuses_removal_segments_whole(signed: bool) -> None:
    """What a reader from before removals does with one: an unknown magic, the segment
    ignored (and counted by its caller); store segments are as they were."""
    key = KEY if signed else None
    removal = encode_removals([(os.urandom(16), "deleted")], "p", integrity_key=key, name=NAME)
    with pytest.raises(SegmentError, match="not a kvtier journal segment"):
        decode_segment(removal, "p", integrity_key=key, name=NAME)
    stores: list[tuple[bytes, Location | None]] = [(os.urandom(16), None)]
    store = encode_segment(stores, "p", integrity_key=key, name=NAME)
    assert not is_removal_segment(store)
    assert decode_segment(store, "p", integrity_key=key, name=NAME) == (stores, 0)


def test_a_key_is_published_as_the_later_of_its_store_and_its_delete() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    a, b, c = (os.urandom(16) for _ in range(3))
    where = Location(pack_name("p", a, "0123456789abcdef", 1), 400, 4200)
    index.wrote(a, where)
    index.wrote(b)
    index.deleted(a, "deleted")  # deleted after its store: only the removal goes out
    index.deleted(c, "corrupt")  # never indexed here: published all the same
    index.wrote(c)  # stored again: only the store goes out
    assert a not in index and index.location(a) is None
    assert index.take_unpublished() == [(b, None), (c, None)]
    assert index.take_removals() == [(a, "deleted")]
    index.deleted(b, "deleted")
    index.requeue([(b, None)])  # a failed publish does not bring back a deleted key
    assert index.take_unpublished() == [] and index.take_removals() == [(b, "deleted")]
    index.wrote(b)
    index.requeue_removals([(b, "deleted")])  # nor a failed removal a key stored again
    assert index.take_removals() == [] and index.take_unpublished() == [(b, None)]


def test_removals_queue_in_order_and_within_the_bound() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=3)
    keys = [os.urandom(16) for _ in range(5)]
    for key in keys:
        index.deleted(key, "deleted")
    assert index.unpublished_dropped == 2
    first = index.take_removals(2)
    assert first == [(k, "deleted") for k in keys[:2]]
    index.requeue_removals(first)  # its PUT failed: first in line again
    assert [k for k, _ in index.take_removals()] == keys[:3]


def test_another_nodes_removal_drops_a_key_only_once_the_bucket_says_it_is_gone() -> None:
    """A removal read from another node's segment doubts the keys this index holds; each
    stays a HIT until its check settles: gone, it is dropped (and not published as this
    node's store); there, it stays; a failed check is retried; a key this node stores, or
    deletes, while it is checked is not touched by that check."""
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    gone, there, failed, stored, unknown = (os.urandom(16) for _ in range(5))
    pack = Location(pack_name("p", there, "0123456789abcdef", 1), 400, 4200)
    for key in (failed, stored):
        index.add(key)
    index.wrote(gone)  # written here before the removal was read: not published yet
    index.wrote(there, pack)
    assert index.doubt([gone, there, failed, stored, unknown], "deleted") == 4
    assert all(key in index for key in (gone, there, failed, stored))  # still HITs
    batch = index.take_doubts(10)
    assert [(key, why) for key, why, _ in batch] == [
        (k, "deleted") for k in (gone, there, failed, stored)
    ]
    assert {key: where for key, _, where in batch}[there] == pack
    index.wrote(stored)  # stored here while its check ran: newer than the removal
    assert index.settle(gone, False) == "deleted" and gone not in index
    assert index.settle(there, True, pack) is None and there in index
    assert index.location(there) is None  # its pack is gone, its own object is there
    assert index.settle(failed, None) is None and failed in index
    assert index.settle(stored, False) is None and stored in index
    assert (index.forgotten, index.removals_kept) == (1, 1)
    assert [key for key, _, _ in index.take_doubts(10)] == [failed]  # tried again
    index.deleted(failed, "deleted")  # deleted here meanwhile
    assert index.settle(failed, True) is None and index.removals_kept == 1
    index.doubt([there], "corrupt")
    assert index.settle(there, False) is None  # not taken for a check: nothing to settle
    assert index.take_unpublished() == [(there, pack), (stored, None)]  # "gone": not sent


@pytest.mark.parametrize("skew", [0.0, 30.0, -30.0])
async def test_a_removal_published_after_a_later_store_never_hides_the_block(
    weed_server: WeedServer, prefix: str, skew: float
) -> None:
    """Node A deletes K, node B then stores K again: B publishes its store segment first and A
    its removal later (A's clock on time, ahead or behind). The block is in the bucket, so it
    stays a HIT on every node, and loads."""
    (key,) = fresh_keys(1)
    payload = os.urandom(512)
    now = time.time()
    walls = [ManualClock(now + skew), ManualClock(now), ManualClock(now)]
    async with (
        s3_tier(weed_server, prefix, name="a", **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
        s3_tier(weed_server, prefix, name="c", **INDEX_BY_HAND) as c,
    ):
        nodes = (a, b, c)
        for tier, wall in zip(nodes, walls, strict=True):
            tier._sync._wall = wall

        async def refresh(*tiers: S3Tier) -> None:
            for wall in walls:
                wall.advance(1.0)  # each round later than the last, on every clock
            for tier in tiers:
                await tier.refresh_index()

        await a.store(key, memoryview(payload))
        await refresh(a, b, c)
        assert [tier.lookup(key) for tier in nodes] == [LookupResult.HIT] * 3
        await a.delete(key)  # the object is gone; A publishes the removal later
        with pytest.raises(BlockNotFoundError):  # B finds it gone, then stores it again
            await b.load(key, memoryview(bytearray(512)))
        await b.store(key, memoryview(payload))
        await refresh(b)  # B's store segment first
        await refresh(a)  # A's removal segment after it
        await refresh(b, c)
        await refresh(a, b, c)
        for tier in nodes:
            assert tier.lookup(key) is LookupResult.HIT, tier.name
            out = bytearray(512)
            await tier.load(key, memoryview(out))
            assert bytes(out) == payload
        assert not [e for e in c.events.drain() if e.kind is EventKind.REMOVED]
