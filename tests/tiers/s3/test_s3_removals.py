"""Removals in the S3 tier's journal: the removal segment's format by example (the fuzzing is
in ``test_s3_untrusted``), and the index's bookkeeping of keys deleted here and elsewhere."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from kvtier._format import IntegrityKey
from kvtier.tiers.s3._index import ExistenceIndex
from kvtier.tiers.s3._journal import (
    MAX_SEGMENT_ENTRIES,
    SegmentError,
    decode_removals,
    decode_segment,
    encode_removals,
    encode_segment,
    is_removal_segment,
)
from kvtier.tiers.s3._pack import Location, pack_name
from tests.tiers.s3.s3_forge import forged_removals

KEY = IntegrityKey("correct horse battery staple 0123456789")


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


def test_signed_removals_verify_only_under_their_key_and_prefix() -> None:
    entries = [(os.urandom(16), "deleted")]
    signed = encode_removals(entries, "p", integrity_key=KEY)
    assert signed[:4] == b"KVR2"
    assert decode_removals(signed, "p", integrity_key=KEY) == (entries, 0)
    other = IntegrityKey("another secret of at least sixteen bytes")
    attempts: dict[str, Callable[[], object]] = {
        "another key": lambda: decode_removals(signed, "p", integrity_key=other),
        "another prefix": lambda: decode_removals(signed, "q", integrity_key=KEY),
        "no key": lambda: decode_removals(signed, "p"),
        "unsigned": lambda: decode_removals(encode_removals(entries, "p"), "p", integrity_key=KEY),
        "a store segment": lambda: decode_removals(
            encode_segment([(entries[0][0], None)], "p", integrity_key=KEY), "p", integrity_key=KEY
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
    removal = encode_removals([(os.urandom(16), "deleted")], "p", integrity_key=key)
    with pytest.raises(SegmentError, match="not a kvtier journal segment"):
        decode_segment(removal, "p", integrity_key=key)
    stores: list[tuple[bytes, Location | None]] = [(os.urandom(16), None)]
    store = encode_segment(stores, "p", integrity_key=key)
    assert not is_removal_segment(store)
    assert decode_segment(store, "p", integrity_key=key) == (stores, 0)


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


def test_another_nodes_removal_drops_only_what_this_node_did_not_write_since() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    learnt, mine, unknown = (os.urandom(16) for _ in range(3))
    index.add(learnt)
    index.wrote(mine)  # not published yet: its segment will be later than the removal
    assert index.forget([learnt, mine, unknown]) == [learnt]
    assert learnt not in index and mine in index and index.forgotten == 1
    assert index.forget([learnt]) == []
    index.take_unpublished()
    assert index.forget([mine]) == [mine]
