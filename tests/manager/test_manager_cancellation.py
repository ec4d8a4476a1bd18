"""Cancel a store, a load and a promotion in the middle, then check nothing leaked: no slot
WRITING or pinned, no task running, and the pool's statistics add up."""

from __future__ import annotations

import asyncio

import anyio
import numpy as np
import pytest

from kvtier import HostPool, LookupResult, TieringManager
from kvtier.testing import StallingTier, resolve_lookup
from tests.support import GatedPool, assert_idle

BB = 4096


def assert_no_stray_tasks() -> None:
    others = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    assert not others, f"tasks left running: {others}"


async def test_cancelled_store_leaves_nothing_reserved(keys: list[bytes]) -> None:
    pool = GatedPool(8, BB)
    async with TieringManager(pool, [StallingTier()]) as manager:
        async with anyio.create_task_group() as tg:
            tg.start_soon(manager.store, keys[:4], np.ones((4, BB), np.uint8))
            await pool.entered.wait()
            assert pool.statistics().writing == 4
            tg.cancel_scope.cancel()
        assert all(manager.lookup(key) is LookupResult.RETRY for key in keys[:1])
        assert pool.statistics().aborts == 4
    assert_idle(manager)
    assert_no_stray_tasks()


async def test_cancelled_load_leaves_nothing_pinned(keys: list[bytes]) -> None:
    pool = GatedPool(8, BB)
    pool.open_gate()
    async with TieringManager(pool) as manager:
        await manager.store(keys[:4], np.ones((4, BB), np.uint8))
        pool.close_gate()
        async with anyio.create_task_group() as tg:
            tg.start_soon(manager.load, keys[:4], np.zeros((4, BB), np.uint8))
            await pool.entered.wait()
            assert pool.statistics().pinned == 4
            tg.cancel_scope.cancel()
        assert_idle(manager)
        pool.open_gate()
        out = np.zeros((4, BB), np.uint8)
        assert await manager.load(keys[:4], out) == 4  # still all there
        assert (out == 1).all()
    assert_no_stray_tasks()


async def test_promotion_cancelled_by_exit_frees_its_slot(keys: list[bytes]) -> None:
    slow = StallingTier()
    for key in keys[:3]:
        await slow.inner.store(key, memoryview(bytes(BB)))
    slow.stall("load")
    async with TieringManager(HostPool(8, BB), [slow]) as manager:
        for key in keys[:3]:
            assert await resolve_lookup(slow, key) is LookupResult.HIT
            assert manager.lookup(key) is LookupResult.RETRY
        await slow.wait_stalled("load")
        assert manager.statistics().pool.writing == 3
    stats = manager.statistics()
    assert stats.promotions.cancelled == 3
    assert slow.stalled["load"] == 0
    assert_idle(manager)
    assert_no_stray_tasks()


async def test_cancelled_scheduler_lookup_leaves_no_watchers(keys: list[bytes]) -> None:
    from kvtier import OffloadScheduler

    slow = StallingTier()
    slow.stall("contains")
    async with TieringManager(HostPool(8, BB), [slow]) as manager:
        scheduler = OffloadScheduler(manager)
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.lookup, keys[:4])
            await slow.wait_stalled("contains")
            tg.cancel_scope.cancel()
        assert len(manager._watchers) == 0
        slow.release("contains")
    assert_idle(manager)
    assert_no_stray_tasks()


@pytest.mark.parametrize("cancel_after", [0, 1, 2, 5])
async def test_manager_body_cancelled_at_any_point(keys: list[bytes], cancel_after: int) -> None:
    """Cancel the whole engine task while stores, promotions and write-through are running."""
    slow = StallingTier()
    for key in keys[8:12]:
        await slow.inner.store(key, memoryview(bytes(BB)))
    manager = TieringManager(HostPool(6, BB), [slow], close_timeout=0.05)
    with anyio.CancelScope() as scope:
        async with manager:
            await manager.store(keys[:4], np.ones((4, BB), np.uint8))
            for key in keys[8:12]:
                manager.lookup(key)
            for _ in range(cancel_after):
                await anyio.lowlevel.checkpoint()
            scope.cancel()
            await anyio.sleep_forever()
    assert_idle(manager)
    assert_no_stray_tasks()
