"""AsyncLookupManager: RETRY while checks run, batching, coalescing, TTLs, faults."""

from __future__ import annotations

import gc

import anyio
import pytest

from kvtier import AsyncLookupManager, LookupResult, MissReason, TierUnavailableError
from kvtier.tiers.fs._index import IndexLookups
from tests.support import ManualClock


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Storage:
    """A contains_many that records its batches and can be held at a gate."""

    def __init__(self, present: set[bytes]) -> None:
        self.present = present
        self.batches: list[list[bytes]] = []
        self.gate: anyio.Event | None = None
        self.entered = anyio.Event()
        self.error: Exception | None = None

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        self.batches.append(list(keys))
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return [key in self.present for key in keys]


class Waker:
    """An ``on_verdict`` callback that tests can wait on."""

    def __init__(self) -> None:
        self.changed = anyio.Event()

    def __call__(self, keys: list[bytes]) -> None:
        self.changed.set()
        self.changed = anyio.Event()


def manager_for(storage: Storage, **kwargs: object) -> AsyncLookupManager:
    waker = Waker()
    manager = AsyncLookupManager(storage.contains_many, on_verdict=waker, **kwargs)  # type: ignore[arg-type]
    manager.waker = waker  # type: ignore[attr-defined]
    return manager


async def settle(manager: AsyncLookupManager, keys: list[bytes]) -> None:
    """Wait, on the verdict notifications, until none of ``keys`` is pending."""
    waker: Waker = manager.waker  # type: ignore[attr-defined]
    with anyio.fail_after(5):
        while any(manager.lookup(key) is LookupResult.RETRY for key in keys):
            await waker.changed.wait()


async def test_unknown_key_retries_then_resolves() -> None:
    storage = Storage({k(1)})
    async with manager_for(storage) as manager:
        assert manager.lookup(k(1)) is LookupResult.RETRY
        assert manager.lookup(k(2)) is LookupResult.RETRY
        await settle(manager, [k(1), k(2)])
        assert manager.lookup(k(1)) is LookupResult.HIT
        assert manager.lookup(k(2)) is LookupResult.MISS
        stats = manager.statistics()
        assert set(stats.misses_by_reason) == {"not_found"}
        assert stats.pending == stats.in_flight == 0


async def test_duplicate_probes_coalesce_into_one_batched_check() -> None:
    storage = Storage(set())
    storage.gate = anyio.Event()
    async with manager_for(storage, batch_size=64) as manager:
        for _ in range(5):
            for i in range(10):
                assert manager.lookup(k(i)) is LookupResult.RETRY
        await storage.entered.wait()
        storage.gate.set()
        await settle(manager, [k(i) for i in range(10)])
    assert sorted(key for batch in storage.batches for key in batch) == [k(i) for i in range(10)]


async def test_batches_respect_the_batch_size() -> None:
    storage = Storage(set())
    async with manager_for(storage, batch_size=4) as manager:
        for i in range(10):
            manager.lookup(k(i))
        await settle(manager, [k(i) for i in range(10)])
    assert all(len(batch) <= 4 for batch in storage.batches)
    assert sum(len(batch) for batch in storage.batches) == 10


async def test_a_check_that_times_out_becomes_a_timeout_miss() -> None:
    storage = Storage({k(1)})
    storage.gate = anyio.Event()  # never set
    async with manager_for(storage, timeout=0.05) as manager:
        assert manager.lookup(k(1)) is LookupResult.RETRY
        await settle(manager, [k(1)])
        assert manager.lookup(k(1)) is LookupResult.MISS
        assert manager.statistics().misses_by_reason.get("timeout", 0) >= 1


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (TierUnavailableError("down", tier="t", operation="contains"), "unavailable"),
        (OSError("disk on fire"), "unavailable"),
    ],
)
async def test_a_failing_check_becomes_a_miss_with_its_reason(
    error: Exception, reason: str
) -> None:
    storage = Storage({k(1)})
    storage.error = error
    async with manager_for(storage) as manager:
        manager.lookup(k(1))
        await settle(manager, [k(1)])
        assert manager.lookup(k(1)) is LookupResult.MISS
        assert set(manager.statistics().misses_by_reason) == {reason}


async def test_a_check_answering_one_verdict_too_few_is_a_tier_error_miss() -> None:
    storage = Storage({k(1), k(2)})
    short = storage.contains_many

    async def one_too_few(keys: list[bytes]) -> list[bool]:
        return (await short(keys))[:-1]

    storage.contains_many = one_too_few  # type: ignore[method-assign]
    async with manager_for(storage) as manager:
        manager.lookup(k(1))
        manager.lookup(k(2))
        await settle(manager, [k(1), k(2)])
        assert [manager.lookup(k(1)), manager.lookup(k(2))] == [LookupResult.MISS] * 2
        assert set(manager.statistics().misses_by_reason) == {"tier_error"}


async def test_misses_expire_after_their_ttl_but_hits_stay(clock: ManualClock) -> None:
    storage = Storage({k(1)})
    async with manager_for(storage, miss_ttl=2.0, clock=clock) as manager:
        manager.lookup(k(1))
        manager.lookup(k(2))
        await settle(manager, [k(1), k(2)])
        storage.present.add(k(2))  # another node writes k(2)
        clock.now = 1.0
        assert manager.lookup(k(2)) is LookupResult.MISS  # still cached
        clock.now = 3.0
        assert manager.lookup(k(2)) is LookupResult.RETRY  # expired: asked again
        assert manager.lookup(k(1)) is LookupResult.HIT
        await settle(manager, [k(2)])
        assert manager.lookup(k(2)) is LookupResult.HIT


async def test_the_verdict_cache_is_bounded() -> None:
    storage = Storage(set())
    async with manager_for(storage, max_entries=8) as manager:
        keys = [k(i) for i in range(50)]
        for key in keys:
            manager.lookup(key)
        await settle(manager, keys[-8:])
        assert manager.statistics().cached_verdicts <= 8


async def test_pending_checks_are_bounded() -> None:
    storage = Storage(set())
    storage.gate = anyio.Event()
    async with AsyncLookupManager(
        storage.contains_many, max_pending=4, batch_size=2, max_concurrency=1
    ) as manager:
        answers = [manager.lookup(k(i)) for i in range(10)]
        assert answers.count(LookupResult.RETRY) == 4
        assert answers[4:] == [LookupResult.MISS] * 6
        assert manager.statistics().misses_by_reason == {"unavailable": 6}
        storage.gate.set()


async def test_record_overrides_and_forget_clears() -> None:
    storage = Storage(set())
    async with manager_for(storage) as manager:
        manager.record(k(1), True)
        assert manager.lookup(k(1)) is LookupResult.HIT
        manager.forget(k(1))
        assert manager.lookup(k(1)) is LookupResult.RETRY
    assert storage.batches == [] or storage.batches == [[k(1)]]


async def test_a_store_that_lands_during_a_check_is_not_overwritten_by_its_stale_miss() -> None:
    # The check looked before the write-through landed, so its MISS is older
    # than the HIT the tier recorded; the key must stay a HIT.
    storage = Storage(set())
    storage.gate = anyio.Event()
    async with manager_for(storage) as manager:
        assert manager.lookup(k(1)) is LookupResult.RETRY
        await storage.entered.wait()  # the check is in flight, and will answer "absent"
        manager.record(k(1), True)  # the store landed meanwhile
        storage.gate.set()
        waker: Waker = manager.waker  # type: ignore[attr-defined]
        with anyio.fail_after(5):
            while manager.statistics().in_flight:
                await waker.changed.wait()
        assert manager.lookup(k(1)) is LookupResult.HIT
        assert manager.statistics().keys_checked == 1


async def test_a_delete_during_a_check_drops_its_stale_hit() -> None:
    storage = Storage({k(1)})
    storage.gate = anyio.Event()
    async with manager_for(storage) as manager:
        manager.lookup(k(1))
        await storage.entered.wait()
        manager.forget(k(1))  # deleted while the check (which will say "present") runs
        storage.gate.set()
        waker: Waker = manager.waker  # type: ignore[attr-defined]
        with anyio.fail_after(5):
            while manager.statistics().in_flight:
                await waker.changed.wait()
        assert manager.lookup(k(1)) is LookupResult.RETRY  # unknown again: asked anew


def test_cached_verdicts_add_no_objects_for_the_garbage_collector() -> None:
    manager = AsyncLookupManager(Storage(set()).contains_many, max_entries=50_000)
    keys = [k(i) for i in range(20_000)]
    gc.collect()
    before = len(gc.get_objects())
    for i, key in enumerate(keys):
        manager.record(key, i % 2 == 0, MissReason.TIMEOUT)
    after = len(gc.get_objects())
    assert manager.statistics().cached_verdicts == 20_000
    assert after - before < 100, f"{after - before} more tracked objects for 20,000 verdicts"
    assert manager.lookup(keys[0]) is LookupResult.HIT
    assert manager.lookup(keys[1]) is LookupResult.MISS
    assert manager.statistics().misses_by_reason == {"timeout": 1}


async def test_closing_resolves_pending_keys_and_wakes_listeners() -> None:
    storage = Storage({k(1)})
    storage.gate = anyio.Event()
    woken: list[bytes] = []
    manager = AsyncLookupManager(storage.contains_many, on_verdict=woken.extend)
    async with manager:
        manager.lookup(k(1))
        manager.lookup(k(2))
        await storage.entered.wait()
    assert sorted(woken) == [k(1), k(2)]
    assert manager.lookup(k(1)) is LookupResult.MISS  # closed: nothing can answer
    stats = manager.statistics()
    assert stats.pending == stats.in_flight == 0
    async with manager:  # and it can be opened again
        assert manager.lookup(k(3)) is LookupResult.RETRY


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"timeout": -1}, "timeout"),
        ({"miss_ttl": "2"}, "miss_ttl"),
        ({"hit_ttl": 0}, "hit_ttl"),
    ],
)
def test_bad_arguments_say_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncLookupManager(Storage(set()).contains_many, **kwargs)  # type: ignore[arg-type]


async def test_lookup_with_reason_says_why_each_miss_is_one() -> None:
    """The reason comes with the answer, the same one the miss is counted under, and the
    call counts as one lookup."""
    storage = Storage({k(1)})
    async with manager_for(storage) as manager:
        assert manager.lookup_with_reason(k(1)) == (LookupResult.RETRY, None)
        await settle(manager, [k(1), k(2)])
        before = manager.statistics()
        assert manager.lookup_with_reason(k(1)) == (LookupResult.HIT, None)
        assert manager.lookup_with_reason(k(2)) == (LookupResult.MISS, MissReason.NOT_FOUND)
        manager.record(k(3), False, MissReason.CORRUPT)
        assert manager.lookup_with_reason(k(3)) == (LookupResult.MISS, MissReason.CORRUPT)
        assert manager.lookup_with_reason(k(1)) == (LookupResult.HIT, None)  # no stale reason
        after = manager.statistics()
        assert (after.hits - before.hits, after.misses - before.misses) == (2, 2)
        assert after.misses_by_reason == {
            "not_found": before.misses_by_reason["not_found"] + 1,
            "corrupt": 1,
        }
    assert manager.lookup_with_reason(k(4)) == (LookupResult.MISS, MissReason.UNAVAILABLE)


def test_index_lookups_say_why_each_miss_is_one(clock: ManualClock) -> None:
    """The FS index's answers carry the reason too: absent keys are not_found, a held key
    whose load failed keeps that failure's reason until it expires."""
    held = {k(1), k(2)}
    index = IndexLookups(held.__contains__, miss_ttl=1.0, clock=clock)
    assert index.lookup_with_reason(k(1)) == (LookupResult.MISS, MissReason.UNAVAILABLE)
    anyio.run(index.__aenter__)
    assert index.lookup_with_reason(k(1)) == (LookupResult.HIT, None)
    assert index.lookup_with_reason(k(3)) == (LookupResult.MISS, MissReason.NOT_FOUND)
    index.record(k(2), False, MissReason.TIMEOUT)
    assert index.lookup_with_reason(k(2)) == (LookupResult.MISS, MissReason.TIMEOUT)
    clock.now = 2.0
    assert index.lookup_with_reason(k(2)) == (LookupResult.HIT, None)
    assert index.statistics().misses_by_reason == {
        "unavailable": 1,
        "not_found": 1,
        "timeout": 1,
    }
