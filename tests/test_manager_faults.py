"""Faults around the TieringManager that must stay local (issue 11): a store racing
``aclose``, a tier whose failed blocks keep answering HIT, a scan that raises, a closed
manager, and tier callbacks that raise inside background tasks. Each test fails on the code
before its fix."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from kvtier import HostPool, LookupResult, MemoryTier, OffloadScheduler, TieringManager
from kvtier.testing import StallingTier

BB = 4096
H, P, R, M = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
    LookupResult.MISS,
)


def assert_clean(manager: TieringManager) -> None:
    stats = manager.statistics()
    assert stats.pool.writing == 0, "a slot was left WRITING"
    assert stats.pool.pinned == 0 and stats.pool.pins == 0, "a slot was left pinned"
    assert stats.background_tasks == 0 and stats.in_flight_bytes == 0
    manager.pool.table.check_invariants()


# -- a scan that raises; a closed manager (item 7) --------------------------------------------


async def test_closed_manager_answers_miss_unavailable(keys: list[bytes]) -> None:
    tier = MemoryTier()
    await tier.store(keys[1], memoryview(bytes(BB)))
    manager = TieringManager(HostPool(4, BB), [tier])
    async with manager:
        await manager.store(keys[:1], np.zeros((1, BB), np.uint8))
    assert manager.lookup(keys[0]) is H  # the pool outlives the manager's task group
    assert manager.lookup(keys[1]) is M  # in a tier, but nothing can promote it now
    assert manager.lookup(keys[2]) is M
    assert manager.statistics().misses_by_reason.get("unavailable") == 2


async def test_closing_while_a_request_waits_leaves_nothing_pinned(keys: list[bytes]) -> None:
    slow = StallingTier()
    for key in keys[2:4]:
        await slow.inner.store(key, memoryview(bytes(BB)))
    manager = TieringManager(HostPool(16, BB), [slow])
    scheduler = OffloadScheduler(manager)
    result: list[int] = []

    async def ask() -> None:
        result.append(await scheduler.lookup(keys[:4]))

    with anyio.fail_after(10):
        # the engine's request outlives the manager: closing wakes it, and it rescans
        async with anyio.create_task_group() as tg, manager:
            await manager.store(keys[:2], np.zeros((2, BB), np.uint8))
            await manager.wait_idle()
            slow.stall("load")
            tg.start_soon(ask)
            await slow.wait_stalled("load")
    slow.release("load")
    assert result == [2]
    assert_clean(manager)


class _Raising(TieringManager):
    """A manager whose lookup raises once armed (a bug in a custom manager, say)."""

    armed = False

    def lookup(self, key: bytes, ctx: object = None) -> LookupResult:
        if self.armed:
            raise RuntimeError("lookup failed")
        return super().lookup(key, ctx)


async def test_a_scan_that_raises_gives_back_its_pins(keys: list[bytes]) -> None:
    slow = StallingTier()
    await slow.inner.store(keys[2], memoryview(bytes(BB)))
    manager = _Raising(HostPool(16, BB), [slow])
    scheduler = OffloadScheduler(manager)
    async with manager:
        await manager.store(keys[:2], np.zeros((2, BB), np.uint8))
        await manager.wait_idle()
        slow.stall("load")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def fail_later() -> None:
                    await slow.wait_stalled("load")
                    manager.armed = True
                    slow.release("load")  # the promotion lands, the scheduler rescans

                tg.start_soon(fail_later)
                with pytest.raises(RuntimeError, match="lookup failed"):
                    await scheduler.lookup(keys[:4])  # keys[3] is a miss: the rescan asks it
        assert manager.statistics().pool.pinned == 0
        manager.armed = False
        await manager.wait_idle()
    assert_clean(manager)
