"""The scheduler scans (docs/design.md, "The lookup contract"), one test per listed case,
asserting the result and how many lookups were made; then the async layer."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import kvtier
from kvtier import LookupResult, OffloadScheduler
from kvtier.manager._watch import KeyWatch
from kvtier.testing import StallingTier
from tests.support import H, M, P, R


class ScriptedManager:
    """Answers a fixed result per key and counts the calls."""

    def __init__(self, results: list[LookupResult]) -> None:
        self.keys = [i.to_bytes(16, "big") for i in range(len(results))]
        self.results = dict(zip(self.keys, results, strict=True))
        self.calls = 0

    def lookup(self, key: bytes, ctx: object = None) -> LookupResult:
        self.calls += 1
        return self.results[key]


def prefix(results: list[LookupResult]) -> tuple[int | None, int]:
    manager = ScriptedManager(results)
    return OffloadScheduler(manager).maximal_prefix_lookup(manager.keys), manager.calls


def window(results: list[LookupResult], size: int) -> tuple[int | None, int]:
    manager = ScriptedManager(results)
    return OffloadScheduler(manager).sliding_window_lookup(manager.keys, size), manager.calls


class TestMaximalPrefix:
    def test_all_hits(self) -> None:
        assert prefix([H, H, H]) == (3, 3)

    def test_empty(self) -> None:
        assert prefix([]) == (0, 0)

    def test_miss_first(self) -> None:
        assert prefix([M, H, H]) == (0, 1)

    def test_hits_then_miss(self) -> None:
        assert prefix([H, H, M, H]) == (2, 3)

    def test_pending_hit_does_not_stop_the_scan(self) -> None:
        assert prefix([P, H, H]) == (None, 3)

    def test_retry_does_not_stop_the_scan_but_a_later_miss_does(self) -> None:
        assert prefix([R, H, M, H, H]) == (None, 3)

    def test_retry_after_hits_defers(self) -> None:
        assert prefix([H, H, R]) == (None, 3)

    def test_pending_after_hits_defers(self) -> None:
        assert prefix([H, H, P]) == (None, 3)

    def test_miss_after_pending_still_defers(self) -> None:
        assert prefix([H, P, M, H]) == (None, 3)


class TestSlidingWindow:
    def test_all_hits_returns_rightmost_window_end(self) -> None:
        assert window([H, H, H, H], 2) == (4, 2)

    def test_empty(self) -> None:
        assert window([], 2) == (0, 0)

    def test_pending_counts_toward_the_streak_but_defers(self) -> None:
        assert window([M, P, H], 2) == (None, 2)

    def test_retry_resets_the_streak(self) -> None:
        # from the right: H, R (reset), H, H -> window [0, 2)
        assert window([H, H, R, H], 2) == (None, 4)

    def test_gap_resets_the_streak(self) -> None:
        assert window([H, H, M, H], 2) == (2, 4)

    def test_rightmost_full_window_wins(self) -> None:
        assert window([H, H, M, H, H, M], 2) == (5, 3)

    def test_window_of_one(self) -> None:
        assert window([M, H, M, M], 1) == (2, 3)

    def test_prefix_fallback_when_no_window_is_full(self) -> None:
        assert window([H, M, H, M], 3) == (1, 4)

    def test_no_window_and_miss_first_returns_zero(self) -> None:
        assert window([M, H, M], 2) == (0, 3)

    def test_retry_before_the_window_does_not_defer(self) -> None:
        # the window ends the scan before the retry is ever seen
        assert window([R, H, H], 2) == (3, 2)

    def test_retry_and_no_full_window_defers(self) -> None:
        assert window([H, R, H], 2) == (None, 3)

    def test_window_size_must_be_positive(self) -> None:
        with pytest.raises(ValueError, match="sliding_window_size"):
            window([H], 0)


def test_fast_path_matches_the_per_key_scan() -> None:
    """A manager offering primary_hit_prefix gives the same answers as per-key lookups."""

    class FastManager(ScriptedManager):
        """The rest of what the scheduler uses when a manager offers it (SupportsScheduling)."""

        cost = kvtier.CostModel()
        prefixes = 0

        def primary_hit_prefix(self, keys: list[bytes]) -> int:
            self.prefixes += 1
            n = 0
            for key in keys:
                if self.results[key] is not H:
                    break
                n += 1
            return n

        def pin_ready(self, keys: list[bytes]) -> list[int]:
            return [0] * len(keys)

        def unpin_slots(self, slots: list[int]) -> None:
            pass

        def watch(self, keys: object, watch: KeyWatch | None = None) -> KeyWatch:
            return KeyWatch() if watch is None else watch

        def unwatch(self, keys: object, watch: KeyWatch) -> None:
            pass

    for results in ([H, H, H], [H, P, M], [H, R, H, M], [M], [H, H, M, H], []):
        fast = FastManager(results)
        slow = ScriptedManager(results)
        assert OffloadScheduler(fast).maximal_prefix_lookup(fast.keys) == OffloadScheduler(
            slow
        ).maximal_prefix_lookup(slow.keys)
        assert fast.prefixes == 1  # the fast path ran


def test_scheduler_rejects_objects_without_lookup() -> None:
    with pytest.raises(ValueError, match="lookup"):
        OffloadScheduler(object())  # type: ignore[arg-type]


# -- the async layer -------------------------------------------------------------------------


async def test_async_lookup_waits_for_promotions_without_polling(keys: list[bytes]) -> None:
    slow = StallingTier()
    blocks = np.random.default_rng(0).integers(0, 255, (8, 4096), dtype=np.uint8)
    for key, block in zip(keys[:8], blocks, strict=True):
        await slow.inner.store(key, memoryview(block.tobytes()))
    slow.stall("load")
    async with kvtier.TieringManager(kvtier.HostPool(16, 4096), [slow]) as manager:
        scheduler = OffloadScheduler(manager)
        result: list[int] = []

        async def ask() -> None:
            result.append(await scheduler.lookup(keys[:8]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await slow.wait_stalled("load")
            assert not result
            scans_while_stalled = scheduler.statistics().scans
            slow.release("load")
        assert result == [8]
        # it woke on notifications: a handful of rescans, not a polling loop
        assert scheduler.statistics().scans - scans_while_stalled <= 9
        assert scheduler.statistics().timeouts == 0


async def test_async_lookup_returns_hit_count_at_the_deadline(keys: list[bytes]) -> None:
    slow = StallingTier()
    for key in keys[2:4]:
        await slow.inner.store(key, memoryview(bytes(4096)))
    slow.stall("load")
    pool = kvtier.HostPool(16, 4096)
    async with kvtier.TieringManager(pool, [slow]) as manager:
        await manager.store(keys[:2], np.zeros((2, 4096), np.uint8))
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(5):
            got = await scheduler.lookup(keys[:4], timeout=0.05)
        assert got == 2  # the two primary hits; the promotions are still stalled
        assert scheduler.statistics().timeouts == 1
        assert manager.statistics().background.tasks == 1  # one batch of two, left running
        slow.release("load")
        with anyio.fail_after(5):
            assert await scheduler.lookup(keys[:4]) == 4


async def test_async_window_lookup(keys: list[bytes]) -> None:
    async with kvtier.TieringManager(kvtier.HostPool(16, 4096), [kvtier.MemoryTier()]) as m:
        await m.store(keys[2:6], np.zeros((4, 4096), np.uint8))
        scheduler = OffloadScheduler(m)
        assert await scheduler.lookup(keys[:8], sliding_window_size=3) == 6
        assert await scheduler.lookup(keys[:8]) == 0


async def test_async_lookup_validates_arguments(keys: list[bytes]) -> None:
    async with kvtier.TieringManager(kvtier.HostPool(4, 64)) as manager:
        scheduler = OffloadScheduler(manager)
        with pytest.raises(ValueError, match="timeout"):
            await scheduler.lookup(keys, timeout=-1)
        with pytest.raises(ValueError, match="bytes"):
            await scheduler.lookup(["not-bytes"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="list of keys"):
            await scheduler.lookup(keys[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="watch"):
        await OffloadScheduler(ScriptedManager([H])).lookup([bytes(16)])


async def test_a_waiting_request_keeps_its_hits(keys: list[bytes]) -> None:
    """While a request waits for the rest of its prefix, the hits it already has are leased
    to it: another request's promotions cannot evict them, so they are never promoted twice
    (without the lease, small pools thrash: each request evicts what the other promoted)."""
    slow, fast = StallingTier(), kvtier.MemoryTier()
    for key in keys[4:6]:
        await slow.inner.store(key, memoryview(bytes(4096)))
    for key in keys[:4] + keys[6:12]:
        await fast.store(key, memoryview(bytes(4096)))
    async with kvtier.TieringManager(kvtier.HostPool(8, 4096), [slow, fast]) as manager:
        await manager.store(keys[:4], np.zeros((4, 4096), np.uint8))  # a's cached prefix
        await manager.wait_idle()
        promotions_before = manager.statistics().promotions.started
        slow.stall("load")
        scheduler = OffloadScheduler(manager, max_wait=5)
        results: dict[str, int] = {}

        async def ask(name: str, prefix: list[bytes]) -> None:
            results[name] = await scheduler.lookup(prefix)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "a", keys[:6])
            await slow.wait_stalled("load")  # a holds k0..k3 and waits for k4, k5
            await ask("b", keys[6:12])  # b competes for the pool meanwhile
            slow.release("load")
        assert results["a"] == 6
        assert 0 < results["b"] < 6  # b got what was not leased to a
        promotions = manager.statistics().promotions.started - promotions_before
        assert promotions == 2 + results["b"]  # a's cached blocks were never promoted again
        assert manager.statistics().pool.pinned == 0  # the leases were given back
