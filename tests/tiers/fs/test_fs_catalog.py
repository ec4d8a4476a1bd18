"""The FS tier's catalog as a synchronous state machine: no event loop, no files.

The catalog is what ``FSTier`` knows about its folder (index and LRU order, used and reserved
bytes against the capacity, eviction victims, keys being stored, watcher epochs). The tier
does the I/O around it; these tests drive it directly with the calls the tier makes, in the
orders the tier makes them, and check its state after each.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from kvtier.tiers.fs._catalog import Catalog, NoRoom, Reservation
from kvtier.tiers.fs._layout import name_of
from kvtier.tiers.fs._reconcile import Difference, apply


def key(i: int) -> bytes:
    return bytes([1]) + i.to_bytes(15, "big")


def name(i: int) -> str:
    return name_of(key(i))


def filled(capacity: int | None, *sizes: int) -> Catalog[str]:
    """A ready catalog holding blocks ``0..n-1`` of ``sizes``, block 0 least recently used."""
    catalog: Catalog[str] = Catalog(capacity)
    catalog.reset((name(i), size) for i, size in enumerate(sizes))
    return catalog


def written(catalog: Catalog[Any], res: Reservation) -> list[tuple[str, int]]:
    return catalog.settle(res, res.size, written=True, touched=True)


# -- reservation against the capacity -------------------------------------------------------------


def test_reset_counts_the_folder_and_makes_it_ready() -> None:
    catalog = filled(None, 10, 20, 30)
    assert catalog.ready and catalog.blocks == 3 and catalog.used == 60
    assert catalog.names() == [name(0), name(1), name(2)]
    assert catalog.holds(key(1)) and not catalog.holds(key(9))
    catalog.ready = False  # closed, or the root went away: it holds nothing it can serve
    assert not catalog.holds(key(1))


def test_without_a_capacity_nothing_is_evicted() -> None:
    catalog = filled(None, 100, 100)
    res = catalog.reserve(key(5), name(5), 1000)
    assert res.victims == [] and catalog.reserved == 1000 and catalog.fits(10**12)
    assert written(catalog, res) == []
    assert catalog.reserved == 0 and catalog.used == 1200 and catalog.blocks == 3


def test_a_full_disk_takes_the_least_recently_used_as_more_victims() -> None:
    catalog = filled(None, 10, 20, 30, 40)  # no capacity: only the disk says it is full
    catalog.loaded(name(0), 10)  # block 0 is the most recently used now
    res = catalog.reserve(key(1), name(1), 25)  # block 1 is being stored again: never a victim
    assert catalog.evict_more(res, 25) == 1  # past its own file: the oldest, enough
    assert res.victims == [(name(2), 30)]
    assert catalog.used == 70 and catalog.names() == [name(3), name(0), name(1)]
    assert catalog.evict_more(res, 100) == 2  # as many as there are, short of 100 bytes
    assert res.victims == [(name(2), 30), (name(3), 40), (name(0), 10)]
    assert catalog.evict_more(res, 100) == 0  # only its own file is left
    assert written(catalog, res) == [(name(2), 30), (name(3), 40), (name(0), 10)]
    assert catalog.names() == [name(1)] and catalog.used == 25 and catalog.reserved == 0


def test_a_reservation_that_fits_evicts_nothing_and_holds_its_room() -> None:
    catalog = filled(100, 30)
    res = catalog.reserve(key(1), name(1), 40)
    assert res.victims == [] and catalog.reserved == 40 and catalog.used == 30
    # The 30 bytes published can be evicted; the 40 reserved cannot until their store ends.
    assert catalog.fits(60) and not catalog.fits(61)
    written(catalog, res)
    assert catalog.reserved == 0 and catalog.used == 70


def test_a_block_larger_than_the_capacity_has_no_room_and_reserves_nothing() -> None:
    catalog = filled(100, 50)
    with pytest.raises(NoRoom) as info:
        catalog.reserve(key(1), name(1), 101)
    assert info.value.size == 101 and info.value.capacity == 100
    assert catalog.reserved == 0 and catalog.used == 50 and catalog.blocks == 1


def test_stores_in_flight_count_against_the_capacity() -> None:
    catalog = filled(100, 40, 40)
    first = catalog.reserve(key(2), name(2), 20)  # 80 + 20 fits
    assert first.victims == []
    second = catalog.reserve(key(3), name(3), 20)  # 80 + 20 reserved + 20: one must go
    assert second.victims == [(name(0), 40)]
    assert catalog.reserved == 40 and catalog.used == 40
    written(catalog, first)
    written(catalog, second)
    assert catalog.reserved == 0 and catalog.used == 80
    assert catalog.names() == [name(1), name(2), name(3)]


# -- eviction order ------------------------------------------------------------------------------


def test_victims_are_least_recently_used_first() -> None:
    catalog = filled(100, 25, 25, 25, 25)
    res = catalog.reserve(key(9), name(9), 50)
    assert res.victim_names == [name(0), name(1)]
    assert name(0) not in catalog and name(1) not in catalog and catalog.used == 50


def test_a_load_makes_a_block_the_most_recently_used() -> None:
    catalog = filled(100, 25, 25, 25, 25)
    catalog.loaded(name(0), 25)
    assert catalog.names()[-1] == name(0)
    res = catalog.reserve(key(9), name(9), 50)
    assert res.victim_names == [name(1), name(2)]


def test_a_load_of_a_file_the_catalog_did_not_know_adds_it() -> None:
    catalog = filled(None, 10)
    catalog.loaded(name(7), 33)  # another process wrote it
    assert catalog.names() == [name(0), name(7)] and catalog.used == 43


def test_a_block_stored_again_is_never_its_own_victim() -> None:
    catalog = filled(100, 50, 50)
    res = catalog.reserve(key(0), name(0), 50)  # block 0 is least recently used, and the one
    assert res.victim_names == [name(1)]  # being stored: it stays, the next one goes
    assert name(0) in catalog


def test_a_lone_block_stored_again_stops_the_search() -> None:
    catalog = filled(50, 50)
    res = catalog.reserve(key(0), name(0), 50)
    assert res.victims == [] and catalog.names() == [name(0)]


# -- how a store ends ----------------------------------------------------------------------------


def test_a_written_block_counts_and_its_victims_are_gone() -> None:
    catalog = filled(100, 50, 50)
    res = catalog.reserve(key(2), name(2), 50)
    assert written(catalog, res) == [(name(0), 50)]
    assert catalog.names() == [name(1), name(2)] and catalog.used == 100


def test_a_block_that_was_there_already_gives_its_victims_back_in_their_place() -> None:
    catalog = filled(100, 30, 30, 30)
    res = catalog.reserve(key(7), name(7), 60)
    assert res.victim_names == [name(0), name(1)]
    gone = catalog.settle(res, 60, written=False, touched=True)  # EXISTS: it needed no room
    assert gone == []
    assert catalog.names() == [name(0), name(1), name(2), name(7)] and catalog.used == 150
    assert catalog.reserved == 0


def test_a_store_that_never_reached_the_disk_gives_its_victims_back() -> None:
    catalog = filled(100, 50, 50)
    res = catalog.reserve(key(2), name(2), 50)
    assert catalog.settle(res, None, written=False, touched=False) == []
    assert catalog.names() == [name(0), name(1)] and catalog.used == 100
    assert catalog.reserved == 0 and name(2) not in catalog


def test_a_failed_store_that_may_have_removed_its_victims_never_counts_them_again() -> None:
    catalog = filled(100, 50, 50)
    res = catalog.reserve(key(2), name(2), 50)
    assert catalog.settle(res, None, written=False, touched=True) == [(name(0), 50)]
    assert catalog.names() == [name(1)] and catalog.used == 50 and catalog.reserved == 0


def test_a_victim_known_again_meanwhile_is_not_counted_twice() -> None:
    catalog = filled(100, 50, 50)
    res = catalog.reserve(key(2), name(2), 50)
    catalog.checked(name(0), 50, catalog.watch())  # a check found it while the store ran
    catalog.unwatch()
    catalog.settle(res, None, written=False, touched=False)
    assert catalog.used == 100 and catalog.blocks == 2


# -- keys being stored ---------------------------------------------------------------------------


def test_a_key_being_stored_answers_retry_until_its_store_ends() -> None:
    catalog = filled(None)
    assert not catalog.retry_while_writing(key(1))  # not being stored
    catalog.begin_store(key(1), "waiter")
    assert catalog.storing.get(key(1)) == "waiter"  # a second store waits on it
    assert catalog.retry_while_writing(key(1))
    assert catalog.retry_while_writing(key(1))
    assert catalog.writing_retries == 2
    res = catalog.reserve(key(1), name(1), 10)
    written(catalog, res)  # the file landed: the index holds it now, it is a hit
    assert not catalog.retry_while_writing(key(1))
    assert catalog.end_store(key(1)) == "waiter" and key(1) not in catalog.storing
    assert catalog.told_after([key(1)]) == [key(1)]  # answered RETRY: told once
    assert catalog.told_after([key(1)]) == []


def test_only_keys_answered_retry_are_told_when_their_store_ends() -> None:
    catalog = filled(None)
    for i in range(3):
        catalog.begin_store(key(i), f"w{i}")
    assert catalog.retry_while_writing(key(1))
    for i in range(3):
        catalog.end_store(key(i))
    assert catalog.told_after([key(0), key(1), key(2)]) == [key(1)]


def test_a_failed_store_is_told_too() -> None:
    catalog = filled(None)
    catalog.begin_store(key(4), "w")
    assert catalog.retry_while_writing(key(4))
    catalog.settle(catalog.reserve(key(4), name(4), 10), None, written=False, touched=False)
    catalog.end_store(key(4))
    assert catalog.told_after([key(4)]) == [key(4)] and not catalog.holds(key(4))


def test_a_key_is_stored_by_one_store_at_a_time() -> None:
    catalog = filled(None)
    catalog.begin_store(key(1), "first")
    with pytest.raises(AssertionError):
        catalog.begin_store(key(1), "second")


def test_while_the_root_is_not_ready_a_held_key_being_stored_answers_retry() -> None:
    catalog = filled(None, 10)
    catalog.ready = False
    catalog.begin_store(key(0), "w")
    assert catalog.retry_while_writing(key(0))


# -- epochs of watchers --------------------------------------------------------------------------


def test_a_stale_no_such_file_does_not_drop_a_block_stored_since() -> None:
    catalog = filled(None)
    since = catalog.watch()  # a check starts: no file yet
    written(catalog, catalog.reserve(key(1), name(1), 10))  # a store lands meanwhile
    catalog.checked(name(1), None, since)  # the check answers "no such file": stale
    assert name(1) in catalog and catalog.used == 10
    catalog.unwatch()


def test_no_such_file_drops_a_block_known_from_before_the_check() -> None:
    catalog = filled(None, 10)
    since = catalog.watch()
    catalog.checked(name(0), None, since)  # another process evicted it
    assert name(0) not in catalog and catalog.used == 0
    catalog.unwatch()


def test_a_block_added_before_a_later_check_began_can_be_dropped_by_it() -> None:
    catalog = filled(None)
    first = catalog.watch()
    written(catalog, catalog.reserve(key(1), name(1), 10))
    second = catalog.watch()  # began after the store: its answer is not stale for it
    catalog.drop_unless_newer(name(1), second)
    assert name(1) not in catalog
    catalog.unwatch()
    catalog.unwatch()
    assert first < second


def test_names_added_are_kept_only_while_a_watcher_runs() -> None:
    catalog = filled(None)
    with catalog.watching() as since:
        written(catalog, catalog.reserve(key(1), name(1), 10))
        catalog.drop_unless_newer(name(1), since)
        assert name(1) in catalog
    # No watcher left: nothing is remembered, so an old epoch no longer protects it.
    catalog.drop_unless_newer(name(1), since)
    assert name(1) not in catalog


def test_a_check_that_finds_a_file_another_process_wrote_counts_it() -> None:
    catalog = filled(None, 10)
    with catalog.watching() as since:
        catalog.checked(name(5), 20, since)
        catalog.checked(name(0), 10, since)  # known already: left where it is
    assert catalog.names() == [name(0), name(5)] and catalog.used == 30


def test_delete_drops_and_a_second_drop_is_harmless() -> None:
    catalog = filled(None, 10, 20)
    catalog.drop(name(0))
    catalog.drop(name(0))
    assert catalog.names() == [name(1)] and catalog.used == 20
    assert "blocks=1" in repr(catalog)


# -- a read of the folder while stores, deletes and evictions go on --------------------------------


def test_a_read_of_the_folder_keeps_what_was_stored_while_it_ran() -> None:
    catalog = filled(None, 10)
    with catalog.watching() as since:
        written(catalog, catalog.reserve(key(1), name(1), 20))  # lands after the read passed
        gone = catalog.reset([(name(0), 10)], since)
    assert gone == [] and catalog.names() == [name(0), name(1)] and catalog.used == 30


def test_a_read_of_the_folder_does_not_bring_back_what_was_removed_while_it_ran() -> None:
    catalog = filled(10, 10)
    with catalog.watching() as since:
        catalog.drop(name(0))  # deleted after the read saw its file
        gone = catalog.reset([(name(0), 10)], since)
    assert gone == [] and catalog.blocks == 0 and catalog.used == 0
    with catalog.watching() as since:  # an eviction that took its file while the read ran
        written(catalog, catalog.reserve(key(2), name(2), 10))
        victims = written(catalog, catalog.reserve(key(3), name(3), 10))
        assert victims == [(name(2), 10)]
        catalog.reset([(name(2), 10), (name(3), 10)], since)
    assert catalog.names() == [name(3)] and catalog.used == 10


def test_a_victim_put_back_is_what_the_read_says() -> None:
    catalog = filled(10, 10)
    with catalog.watching() as since:
        res = catalog.reserve(key(1), name(1), 10)  # takes block 0 out as its victim
        assert catalog.settle(res, None, written=False, touched=False) == []  # put back
        catalog.reset([(name(0), 10)], since)
    assert catalog.names() == [name(0)]


def test_a_read_without_an_epoch_is_the_whole_truth() -> None:
    catalog = filled(None, 10, 20)
    assert catalog.reset([(name(1), 20)]) == [name(0)]
    assert catalog.names() == [name(1)] and catalog.used == 20


# -- a walk of the folder meanwhile ----------------------------------------------------------------


@pytest.mark.parametrize("settled", [False, True], ids=["store-in-flight", "store-ended"])
async def test_a_walk_does_not_take_back_a_victim_whose_file_it_saw_before_removal(
    settled: bool,
) -> None:
    """A store's victim leaves the index before its file is removed: a walk that began after
    and saw the file must not take it back in, whether the store is still in flight when the
    walk's difference is applied (``changing``) or ended after the walk began."""
    catalog: Catalog[anyio.Event] = Catalog(100)
    catalog.reset([(name(0), 50), (name(1), 50)])
    res = catalog.reserve(key(2), name(2), 50)  # block 0 is its victim
    since = catalog.watch()  # the walk begins, and sees block 0's file still there
    if settled:
        assert written(catalog, res) == [(name(0), 50)]
    found: list[str] = []
    await apply(catalog, Difference([(name(0), 50)], []), since, lambda _: None, found.extend)
    assert found == [] and name(0) not in catalog
    if not settled:
        assert written(catalog, res) == [(name(0), 50)]
    catalog.unwatch()
    assert catalog.names() == [name(1), name(2)]
    assert not catalog.changing(name(0)) and not catalog.changing(name(2))
