"""Prefetch: a queued request's prefix fetched before its lookup, within a share of the pool,
released when claimed, cancelled or expired; never promoted twice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from kvtier import (
    CostModel,
    HostPool,
    MemoryTier,
    OffloadScheduler,
    PrefetchHandle,
    PrefetchState,
    SecondaryTier,
    SlotState,
    TieringManager,
)
from kvtier.manager._watch import KeyWatch
from kvtier.testing import FailingTier, StallingTier
from tests.support import BB, assert_idle, fill, random_blocks


async def stalled(keys: list[bytes], *operations: str) -> StallingTier:
    """A tier holding ``keys`` whose ``operations`` are held until released."""
    tier = StallingTier(name="stalling")
    await fill(tier.inner, keys)
    tier.stall(*operations)
    return tier


async def holding(keys: list[bytes]) -> MemoryTier:
    """A memory tier holding ``keys``."""
    tier = MemoryTier("mem")
    await fill(tier, keys)
    return tier


@asynccontextmanager
async def prefetching(
    tier: SecondaryTier, blocks: int = 8, share: float = 0.5, cost: CostModel | None = None
) -> AsyncIterator[tuple[TieringManager, OffloadScheduler]]:
    async with TieringManager(HostPool(blocks, BB), [tier], cost=cost) as manager:
        yield manager, OffloadScheduler(manager, prefetch_share=share)


async def test_a_prefetched_prefix_is_a_hit_for_its_lookup(keys: list[bytes]) -> None:
    tier = await holding(keys[:6])
    async with prefetching(tier, 16) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:8])
        with anyio.fail_after(10):
            assert await handle.wait() == 6  # up to the first miss
        assert handle.reason == "not_found"
        assert handle.state.value == "holding"
        assert all(manager.pool.state_of(k) is SlotState.READY for k in keys[:6])
        assert manager.statistics().pool.pinned == 6  # held for the request
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:8]) == 6
        assert handle.state is PrefetchState.CLAIMED
        stats = scheduler.statistics().prefetch
        assert stats is not None
        assert (stats.started, stats.blocks_prefetched, stats.blocks_claimed) == (1, 6, 6)
        assert stats.bytes_prefetched == 6 * BB and stats.held == 0
        assert manager.statistics().promotions.started == 6  # the lookup promoted nothing
        await manager.wait_idle()
        assert_idle(manager)


async def test_a_queued_prefix_found_whole_in_the_pool_is_only_touched(
    keys: list[bytes],
) -> None:
    """A queued request's prefix all in the pool is not held (its request is next in
    line); a session's bring-back, which holds across a lead, pins it (test_bring_back)."""
    async with prefetching(MemoryTier("mem"), 16) as (manager, scheduler):
        await manager.store(keys[:6], random_blocks(6))
        await manager.wait_idle()
        handle = scheduler.prefetch(keys[:6])
        with anyio.fail_after(10):
            assert await handle.wait() == 6
        assert handle.held == 0 and manager.statistics().pool.pinned == 0
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:6]) == 6
        assert handle.state is PrefetchState.CLAIMED
        await manager.wait_idle()
        assert_idle(manager)


async def test_prefetch_holds_at_most_its_share_and_never_evicts_a_pinned_block(
    keys: list[bytes],
) -> None:
    tier = await holding(keys[4:12])
    async with prefetching(tier, share=0.25) as (manager, scheduler):  # 2 of 8 slots
        await manager.store(keys[:4], random_blocks(4))
        running = manager.pin_ready(keys[:4])  # a running request's blocks
        assert len(running) == 4
        first = scheduler.prefetch(keys[4:8])
        second = scheduler.prefetch(keys[8:12])
        with anyio.fail_after(10):
            assert await first.wait() == 2
            assert await second.wait() == 0  # the first holds the whole share
        assert first.reason == second.reason == "prefetch_share"
        assert second.state is PrefetchState.RUNNING  # waiting for the share
        stats = scheduler.statistics().prefetch
        assert stats is not None and stats.held == 2 and stats.capped == 2
        assert all(manager.pool.state_of(k) is SlotState.READY for k in keys[:4])
        first.cancel()  # gives the share back: the second scans again and fills it
        await anyio.wait_all_tasks_blocked()
        assert second.prefix == 2
        assert all(manager.pool.state_of(k) is SlotState.READY for k in keys[:4])
        stats = scheduler.statistics().prefetch
        assert stats is not None and stats.held == 2
        second.cancel()
        manager.unpin_slots(running)


async def test_a_cancelled_prefetch_releases_everything(keys: list[bytes]) -> None:
    tier = await stalled(keys[:4], "load")
    async with prefetching(tier) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:4])
        with anyio.fail_after(10):
            await tier.wait_stalled("load")  # its promotions are in flight
        handle.cancel()
        handle.cancel()  # idempotent
        assert handle.state is PrefetchState.CANCELLED and handle.done
        stats = scheduler.statistics().prefetch
        assert stats is not None and stats.cancelled == 1 and stats.held == 0
        tier.release("load")
        with anyio.fail_after(10):
            await manager.wait_idle()
        assert_idle(manager)  # nothing pinned, nothing left WRITING
        # what was in flight landed as ordinary cache entries
        assert all(manager.pool.state_of(k) is SlotState.READY for k in keys[:4])


class CancelsOnFire(KeyWatch):
    """A watch registered after a prefetch's: it ends the prefetch inside the very change
    that has just woken the prefetch's scan (an engine aborting the request then)."""

    def __init__(self, handle: PrefetchHandle) -> None:
        super().__init__()
        self.handle = handle

    def fire(self, key: bytes) -> None:
        super().fire(key)
        self.handle.cancel()


async def test_a_prefetch_cancelled_as_its_scan_wakes_pins_nothing_for_it(
    keys: list[bytes],
) -> None:
    tier = await stalled(keys[:2], "load")
    async with prefetching(tier) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:2])
        with anyio.fail_after(10):
            await tier.wait_stalled("load")  # the scan waits for its promotions to land
        manager.watch(keys[:1], CancelsOnFire(handle))
        tier.release("load")
        with anyio.fail_after(10):
            await handle.wait_ended()
            await manager.wait_idle()
        assert handle.state is PrefetchState.CANCELLED
        assert all(manager.pool.state_of(k) is SlotState.READY for k in keys[:2])
        assert_idle(manager)  # the woken scan pinned nothing into the ended prefetch


async def test_an_unclaimed_prefetch_expires_and_its_blocks_stay_as_cache(
    keys: list[bytes],
) -> None:
    tier = await holding(keys[:3])
    async with prefetching(tier) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:3], ttl=0.01)
        with anyio.fail_after(10):
            assert await handle.wait_ended() is PrefetchState.EXPIRED
        stats = scheduler.statistics().prefetch
        assert stats is not None
        assert (stats.blocks_prefetched, stats.blocks_expired, stats.blocks_claimed) == (3, 3, 0)
        await manager.wait_idle()
        assert_idle(manager)
        assert all(manager.pool.state_of(k) is SlotState.READY for k in keys[:3])
        with anyio.fail_after(10):  # a later lookup claims nothing but finds them
            assert await scheduler.lookup(keys[:3]) == 3


async def test_a_prefetch_racing_its_own_lookup_promotes_once(keys: list[bytes]) -> None:
    tier = await stalled(keys[:5], "load")
    async with prefetching(tier, 16) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:5])
        answer: list[int] = []

        async def request() -> None:
            answer.append(await scheduler.lookup(keys[:5]))

        with anyio.fail_after(10):
            await tier.wait_stalled("load")
            async with anyio.create_task_group() as tg:
                tg.start_soon(request)
                await anyio.wait_all_tasks_blocked()  # the lookup waits on the same blocks
                assert manager.statistics().lookups.hit_pending >= 1
                tier.release("load")
        assert answer == [5]
        assert handle.state is PrefetchState.CLAIMED
        assert manager.statistics().promotions.started == 5
        assert tier.statistics().loads == 5
        await manager.wait_idle()
        assert_idle(manager)


async def test_a_failing_tier_during_prefetch_is_a_miss_with_a_reason(
    keys: list[bytes],
) -> None:
    tier = FailingTier(name="failing")
    await fill(tier.inner, keys[:4])
    tier.fail("load")
    async with prefetching(tier) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:4])
        with anyio.fail_after(10):
            assert await handle.wait() == 0
        # the failure is counted with its reason, and the tier (told by record_miss) answers
        # a miss for the block from then on: the prefix ends there, with that reason
        assert set(manager.statistics().promotions.failed_by_reason) == {"unavailable"}
        assert handle.reason == "not_found"
        handle.cancel()
        await manager.wait_idle()
        assert_idle(manager)


async def test_closing_the_manager_ends_a_running_prefetch(keys: list[bytes]) -> None:
    tier = await stalled(keys[:2], "contains", "load")
    async with prefetching(tier) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:2])
        with anyio.fail_after(10):
            await tier.wait_stalled("contains")
    assert handle.state is PrefetchState.CANCELLED
    assert manager.statistics().pool.pinned == 0
    tier.release("contains", "load")


async def test_a_prefetch_on_a_closed_manager_ends_at_once_and_leaves_nothing(
    keys: list[bytes],
) -> None:
    tier = await holding(keys[:2])
    async with prefetching(tier) as (manager, scheduler):
        pass
    handle = scheduler.prefetch(keys[:2])  # an engine racing its own shutdown: no exception
    assert handle.done and handle.state is PrefetchState.CANCELLED
    assert handle.reason == "unavailable"
    with anyio.fail_after(5):
        assert await handle.wait() is None
    stats = scheduler.statistics().prefetch
    assert stats is not None and stats.held == 0 and stats.cancelled == 1
    with anyio.fail_after(5):
        assert await scheduler.lookup(keys[:2], timeout=1) == 0
    assert handle.state is PrefetchState.CANCELLED  # no orphan left for a lookup to claim
    assert_idle(manager)


async def test_prefetch_arguments_are_checked(keys: list[bytes]) -> None:
    async with prefetching(MemoryTier("mem")) as (manager, scheduler):
        with pytest.raises(ValueError, match="deadline must be a positive number"):
            scheduler.prefetch(keys[:2], deadline=0)
        with pytest.raises(ValueError, match="ttl must be a positive number"):
            scheduler.prefetch(keys[:2], ttl=-1)
        handle = scheduler.prefetch([])
        assert handle.done and handle.prefix == 0
    with pytest.raises(ValueError, match="prefetch_share must be a share"):
        OffloadScheduler(manager, prefetch_share=1.5)


async def test_no_prefetch_from_a_tier_slower_than_recompute(keys: list[bytes]) -> None:
    tier = await holding(keys[:4])
    cost = CostModel(recompute_seconds_per_block=0.001, probe_interval=3600.0)
    for _ in range(5):  # the tier takes a second a promotion: far slower than recompute
        cost.observe_promotion("mem", 1.0, BB, True)
    async with prefetching(tier, cost=cost) as (manager, scheduler):
        handle = scheduler.prefetch(keys[:4])
        with anyio.fail_after(10):
            assert await handle.wait() == 0
        assert handle.reason == "too_slow"
        assert manager.statistics().promotions.started == 0
        handle.cancel()
        assert_idle(manager)
