"""A background task cancelled before its first step never reaches its own ``finally``.

The manager pins the slot, counts the bytes in flight and the task before it starts a
write-through or a promotion task; the task gives them back when it ends. anyio itself never
cancels a task that has not started, but asyncio does when something cancels the task
directly (``asyncio.run`` cancelling every task at shutdown, a supervisor that walks
``asyncio.all_tasks()``). These tests cancel the manager's queued tasks that way, then close
the manager and check that nothing was left pinned, reserved or counted.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from inspect import CORO_CREATED, getcoroutinestate

import numpy as np

from kvtier import AdmissionPolicy, HostPool, LookupResult, MemoryTier, TieringManager
from tests.support import assert_idle

BB = 4096


def cancel_unstarted_tasks() -> int:
    """Cancel every task of this loop that has not run yet (the manager's queued work)."""
    cancelled = 0
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        if coro is not None and getcoroutinestate(coro) == CORO_CREATED:  # type: ignore[arg-type]
            task.cancel()
            cancelled += 1
    return cancelled


def forget_unrun_coroutines() -> None:
    """Collect the cancelled tasks' coroutines now: Python warns that they never ran (true,
    and the point of the test) when they are collected."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        gc.collect()


def assert_nothing_left(manager: TieringManager) -> None:
    forget_unrun_coroutines()
    assert_idle(manager)


async def test_a_cascade_cancelled_before_it_starts_leaves_nothing_behind(
    keys: list[bytes],
) -> None:
    manager = TieringManager(HostPool(8, BB), [MemoryTier()], close_timeout=0.2)
    await manager.__aenter__()
    await manager.store(keys[:3], np.ones((3, BB), np.uint8))
    assert manager.statistics().in_flight_bytes == 3 * BB  # queued, not started
    assert cancel_unstarted_tasks() == 1  # one cascade writes the store's three blocks
    await asyncio.sleep(0)  # let the cancellations land (an ordering step, not a wait)
    await manager.aclose()
    assert_nothing_left(manager)
    stats = manager.statistics()
    assert stats.cascades_cancelled == 3
    assert stats.pool.ready == 3  # the stored blocks themselves stay


async def test_a_promotion_cancelled_before_it_starts_leaves_nothing_behind(
    keys: list[bytes],
) -> None:
    tier = MemoryTier()
    await tier.store(keys[0], memoryview(bytes(BB)))
    manager = TieringManager(HostPool(8, BB), [tier], close_timeout=0.2)
    await manager.__aenter__()
    assert manager.lookup(keys[0]) is LookupResult.RETRY  # its promotion is queued
    assert cancel_unstarted_tasks() == 1
    await asyncio.sleep(0)
    await manager.aclose()
    assert_nothing_left(manager)
    assert manager.statistics().promotions_cancelled == 1


class PackingTier(MemoryTier):
    write_batch = 4


async def test_a_group_of_deferred_writes_cancelled_before_it_starts_leaves_nothing_behind(
    keys: list[bytes],
) -> None:
    now = [0.0]
    admission = AdmissionPolicy(
        max_write_rate={"remote": 5 * BB},  # a group of four and one more block a second
        max_write_latency=None,
        deferred=["remote"],
        clock=lambda: now[0],
    )
    manager = TieringManager(
        HostPool(16, BB),
        [MemoryTier("fast"), PackingTier("remote")],
        admission=admission,
        close_timeout=0.2,
    )
    await manager.__aenter__()
    await manager.store(keys[:9], np.ones((9, BB), np.uint8))
    await manager.wait_idle()
    assert manager.statistics().deferred_pending == 4
    now[0] += 1.0
    await manager.store(keys[9:10], np.ones((1, BB), np.uint8))  # the group comes due
    stats = manager.statistics()
    assert stats.deferred_pending == 0 and stats.in_flight_bytes == 5 * BB  # queued
    assert cancel_unstarted_tasks() == 2  # the group's one task, and the new block's
    await asyncio.sleep(0)
    await manager.aclose()
    assert_nothing_left(manager)
    stats = manager.statistics()
    assert stats.deferred_lost == 4 and stats.deferred_written == 0
