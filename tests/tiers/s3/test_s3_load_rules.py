"""The S3 existence index's rules while a background load fills it (no event loop): what
the load brings, what it must not bring back, and what it remembers (bounded)."""

from __future__ import annotations

import os

from kvtier import MissReason
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3.index import ExistenceIndex


def test_a_load_brings_keys_but_never_one_found_gone_since_it_began() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    a, b, c, d = (os.urandom(16) for _ in range(4))
    where = Location("p/_kvtier_packs/00/ab-cd-1", 0, 100)
    index.begin_load()
    assert index.loading
    index.wrote(a)
    index.deleted(a, "deleted")  # deleted here while the load runs
    index.suppress(b, MissReason.NOT_FOUND)  # not indexed yet: may be in a pack, not gone
    index.add(b)
    index.discard(b)  # indexed, then found gone: gone
    assert index.doubt([c], "deleted") == 0  # another node's removal of a key not loaded yet
    assert index.load_many([(a, where), (b, None), (c, None), (d, where)]) == 1
    assert (a in index, b in index, c in index, d in index) == (False, False, False, True)
    assert index.load_skipped == 3 and index.location(d) == where
    index.end_load()
    assert not index.loading
    assert index.load_one(a)  # after the load, a listing's word counts again


def test_a_key_written_again_during_the_load_is_brought_by_it() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    key = os.urandom(16)
    index.begin_load()
    index.wrote(key)
    index.deleted(key, "deleted")
    index.wrote(key)  # stored again: newer than the delete
    index.discard(key)
    index.add(key)  # learnt again (a journal, a HIT)
    assert index.load_many([(key, None)]) == 0 and key in index and index.load_skipped == 0


def test_a_key_not_found_by_its_own_name_while_loading_may_still_be_in_a_pack() -> None:
    """A GET by a key's own name that found nothing, while the index does not know the key
    yet, says nothing of a pack holding it: the load still brings it. Once indexed, a miss
    of its own object (or its pack section) is news, and the load skips it."""
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    packed, alone = os.urandom(16), os.urandom(16)
    where = Location("p/_kvtier_packs/00/ab-cd-1", 0, 100)
    index.begin_load()
    index.suppress(packed, MissReason.NOT_FOUND)
    index.add(alone)
    index.suppress(alone, MissReason.NOT_FOUND)
    assert index.load_many([(packed, where), (alone, None)]) == 1
    assert packed in index and index.location(packed) == where and alone not in index


def test_without_a_load_nothing_is_remembered_as_gone() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    key = os.urandom(16)
    index.add(key)
    index.discard(key)
    assert index.load_many([(key, None)]) == 1 and key in index


def test_what_a_load_remembers_is_bounded() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=4)
    index.begin_load()
    keys = [os.urandom(16) for _ in range(10)]
    for key in keys:
        index.deleted(key, "deleted")
    assert len(index._gone) == 4
    index.end_load()
    assert not index._gone
