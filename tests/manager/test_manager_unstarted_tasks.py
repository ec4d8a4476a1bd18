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
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from inspect import CORO_CREATED, getcoroutinestate
from typing import Any

import numpy as np
import pytest

from kvtier import AdmissionPolicy, HostPool, LookupResult, MemoryTier, TieringManager
from tests.support import assert_idle

BB = 4096

# Python warns, when it collects them, that the cancelled tasks' coroutines never ran: true,
# and the point of these tests.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")


def cancel_unstarted_tasks() -> int:
    """Cancel every task of this loop that has not run yet (the manager's queued work)."""
    cancelled = 0
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        if coro is not None and getcoroutinestate(coro) == CORO_CREATED:  # type: ignore[arg-type]
            task.cancel()
            cancelled += 1
    return cancelled


@contextmanager
def cancelled_at_creation() -> Iterator[list[str]]:
    """Cancel every task created inside the block before it runs (a store yields after it
    queues its write-through, so by the time it returns those tasks have started); yields
    a description of each. The tasks themselves are not kept: their coroutines are collected
    with the rest."""
    loop = asyncio.get_running_loop()
    created: list[str] = []

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        task.cancel()
        created.append(repr(coro))
        return task

    previous = loop.get_task_factory()
    loop.set_task_factory(factory)  # type: ignore[arg-type]
    try:
        yield created
    finally:
        loop.set_task_factory(previous)


def assert_nothing_left(manager: TieringManager) -> None:
    gc.collect()  # the cancelled tasks' coroutines, which never ran
    assert_idle(manager)


async def test_a_cascade_cancelled_before_it_starts_leaves_nothing_behind(
    keys: list[bytes],
) -> None:
    manager = TieringManager(HostPool(8, BB), [MemoryTier()], close_timeout=0.2)
    await manager.__aenter__()
    with cancelled_at_creation() as cancelled:
        await manager.store(keys[:3], np.ones((3, BB), np.uint8))
    assert len(cancelled) == 1  # one cascade writes the store's three blocks
    assert manager.statistics().writes.in_flight_bytes == 3 * BB  # taken, and not given back
    await manager.aclose()
    assert_nothing_left(manager)
    stats = manager.statistics()
    assert stats.writes.cancelled == 3
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
    assert manager.statistics().promotions.cancelled == 1


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
    assert manager.statistics().writes.deferred_pending == 4
    now[0] += 1.0
    with cancelled_at_creation() as cancelled:
        await manager.store(keys[9:10], np.ones((1, BB), np.uint8))  # the group comes due
    assert len(cancelled) == 2  # the group's one task, and the new block's
    stats = manager.statistics()
    assert (
        stats.writes.deferred_pending == 0 and stats.writes.in_flight_bytes == 5 * BB
    )  # not given back
    await manager.aclose()
    assert_nothing_left(manager)
    stats = manager.statistics()
    assert stats.writes.deferred_lost == 4 and stats.writes.deferred_written == 0
