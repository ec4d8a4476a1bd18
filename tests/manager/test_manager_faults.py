"""Faults around the TieringManager that must stay local: a store racing
``aclose``, a tier whose failed blocks keep answering HIT, a scan that raises, a closed
manager, and tier callbacks that raise inside background tasks. Each test fails on the code
before its fix."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier import (
    CorruptBlockError,
    HostPool,
    LifecycleError,
    LookupResult,
    MemoryTier,
    MissReason,
    OffloadScheduler,
    TieringManager,
)
from kvtier.manager._cost import ScanBudget
from kvtier.manager._failures import RecentFailures
from kvtier.testing import StallingTier
from kvtier.tiers._base import BatchResults
from tests.support import GatedPool, H, M, R, assert_idle

BB = 4096


# -- a scan that raises; a closed manager -----------------------------------------------------


async def test_closed_manager_answers_miss_unavailable(keys: list[bytes]) -> None:
    tier = MemoryTier()
    await tier.store(keys[1], memoryview(bytes(BB)))
    manager = TieringManager(HostPool(4, BB), [tier])
    async with manager:
        await manager.store(keys[:1], np.zeros((1, BB), np.uint8))
    assert manager.lookup(keys[0]) is H  # the pool outlives the manager's task group
    assert manager.lookup(keys[1]) is M  # in a tier, but nothing can promote it now
    assert manager.lookup(keys[2]) is M
    assert manager.statistics().lookups.misses_by_reason.get("unavailable") == 2


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
    assert_idle(manager)


class _Raising(TieringManager):
    """A manager whose lookup raises once armed (a bug in a custom manager, say)."""

    armed = False

    def lookup(self, key: bytes, ctx: ScanBudget | None = None) -> LookupResult:
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
    assert_idle(manager)


# -- store racing aclose -----------------------------------------------------------------------


async def test_a_store_that_outlives_aclose_fails_and_leaves_nothing(keys: list[bytes]) -> None:
    pool = GatedPool(8, BB, loads=False)
    tier = MemoryTier()
    manager = TieringManager(pool, [tier])
    errors: list[BaseException] = []

    async def store() -> None:
        try:
            await manager.store(keys[:1], np.ones((1, BB), np.uint8))
        except LifecycleError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:  # the engine's task outlives the manager
            async with manager:
                tg.start_soon(store)
                await pool.entered.wait()  # the store has its slot and is copying
            pool.open_gate()  # the copy finishes after the manager closed
    assert len(errors) == 1 and "not open" in str(errors[0])
    assert_idle(manager)
    assert manager.lookup(keys[0]) is M  # nothing of the failed store is readable
    assert tier.statistics().blocks == 0
    async with manager:  # re-opened, it has nothing left to wait for
        with anyio.fail_after(5):
            await manager.wait_idle()
        assert manager.statistics().background.tasks == 0


# -- a failed promotion is remembered by the manager -------------------------------------------


class CorruptTier(MemoryTier):
    """Every load fails verification; ``record_miss`` keeps the default (does nothing), so
    the tier goes on answering HIT for the key."""

    async def load(self, key: bytes, dst: memoryview) -> None:
        await super().load(key, dst)
        raise CorruptBlockError("checksum mismatch", tier=self.name, operation="load", key=key)


async def test_a_failed_promotion_is_not_retried_at_every_wake(keys: list[bytes]) -> None:
    tier, good = CorruptTier("corrupt"), MemoryTier("good")
    await tier.store(keys[0], memoryview(bytes(BB)))
    await tier.store(keys[1], memoryview(bytes(BB)))
    await good.store(keys[1], memoryview(bytes(BB)))
    async with TieringManager(HostPool(4, BB), [tier, good], failure_ttl=60) as manager:
        assert await manager.wait_settled(keys[0], timeout=10) is M
        stats = manager.statistics()
        assert stats.promotions.started == 1
        assert stats.promotions.failed_by_reason == {"corrupt": 1}
        assert stats.lookups.misses_by_reason == {"corrupt": 1}  # the reason is kept, not not_found
        assert tier.lookup(keys[0]) is H  # the tier itself still says HIT
        assert manager.lookup(keys[0]) is M
        # a scheduler waiting on the key answers at once, not at max_wait
        scheduler = OffloadScheduler(manager, max_wait=30)
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:1]) == 0
        assert manager.statistics().promotions.started == 1
        # the next tier down is still asked for a key that failed in the one above
        assert await manager.wait_settled(keys[1], timeout=10) is H
        stats = manager.statistics()
        assert stats.promotions.started == 3  # keys[1]: from "corrupt" (failed), from "good"
        assert stats.promotions.failed_by_reason == {"corrupt": 2}


async def test_a_remembered_failure_expires(keys: list[bytes]) -> None:
    tier = CorruptTier()
    await tier.store(keys[0], memoryview(bytes(BB)))
    async with TieringManager(HostPool(4, BB), [tier], failure_ttl=1e-9) as manager:
        assert manager.lookup(keys[0]) is R
        await manager.wait_idle()
        assert manager.lookup(keys[0]) is R  # expired at once: promoted again
        await manager.wait_idle()
        assert manager.statistics().promotions.started == 2


# -- a callback that raises in background work ----------------------------------------------


class RaisingRecordMiss(CorruptTier):
    def record_miss(self, key: bytes, reason: MissReason) -> None:
        raise RuntimeError("record_miss exploded")


class RaisingObserver:
    def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None:
        raise RuntimeError("observer exploded")


def raising_listener(key: bytes) -> None:
    raise RuntimeError("listener exploded")


@pytest.mark.parametrize("callback", ["record_miss", "observer", "listener"])
async def test_a_raising_callback_never_stops_the_engine(
    keys: list[bytes], callback: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The manager's task group lives in the engine's task: a tier's or an observer's
    callback that raises in a background task is contained, logged once per burst and
    counted, and the engine loop runs all its iterations."""
    tier = RaisingRecordMiss() if callback == "record_miss" else MemoryTier()
    for key in keys[:5]:
        await tier.store(key, memoryview(bytes(BB)))
    observer = RaisingObserver() if callback == "observer" else None
    iterations = 0
    caplog.set_level(logging.WARNING, logger="kvtier")
    with anyio.fail_after(10):
        async with TieringManager(HostPool(16, BB), [tier], latency=observer) as manager:
            if callback == "listener":
                tier.add_listener(raising_listener)
            for i in range(5):  # the engine's loop
                if callback == "listener":  # write-through notifies the tier's listeners
                    await manager.store(keys[8 + i : 9 + i], np.zeros((1, BB), np.uint8))
                    await manager.wait_idle()
                else:  # a promotion that fails (record_miss) or lands (observer)
                    assert await manager.wait_settled(keys[i], timeout=10) is (
                        M if callback == "record_miss" else H
                    )
                    await manager.wait_idle()
                iterations += 1
            stats = manager.statistics()
    assert iterations == 5
    if callback == "listener":
        assert tier.listener_failures == 5
        assert stats.writes.succeeded == 5
    else:
        assert stats.background.callback_failures == 5
    exploded = [r for r in caplog.records if "exploded" in r.getMessage()]
    assert len(exploded) == 1, "a burst of one fault logs once"
    assert_idle(manager)


class RaisingLookupObserver:
    def observe_lookup(self, seconds: float) -> None:
        raise RuntimeError("lookup observer exploded")


async def test_a_raising_lookup_observer_never_fails_the_request(keys: list[bytes]) -> None:
    async with TieringManager(HostPool(4, BB)) as manager:
        await manager.store(keys[:2], np.zeros((2, BB), np.uint8))
        scheduler = OffloadScheduler(manager, latency=RaisingLookupObserver())
        assert await scheduler.lookup(keys[:3]) == 2
        assert await scheduler.lookup(keys[:3]) == 2
        assert scheduler.statistics().callback_failures == 2


def test_recent_failures_expire_and_stay_bounded() -> None:
    now = [0.0]
    failures = RecentFailures(2.0, max_entries=3, clock=lambda: now[0])
    failures.remember("a", b"k1", MissReason.CORRUPT)
    assert failures.get("a", b"k1") is MissReason.CORRUPT
    assert failures.get("b", b"k1") is None  # per tier
    now[0] = 2.0
    assert failures.get("a", b"k1") is None and len(failures) == 0  # expired, dropped
    for i in range(5):
        failures.remember("a", bytes([i]), MissReason.TIMEOUT)
    assert len(failures) == 3 and failures.get("a", bytes([4])) is MissReason.TIMEOUT
    now[0] = 10.0
    failures.remember("a", b"new", MissReason.NOT_FOUND)
    assert len(failures) == 1  # the expired ones went on the way


# -- a tier that breaks its own contract -------------------------------------------------------


class ShortAnswerTier(MemoryTier):
    """A tier with a bug: its batch call ``short`` (``load_many`` or ``store_many``) does all
    its work but answers for one key fewer than it was asked."""

    def __init__(self, short: str) -> None:
        super().__init__("short")
        self.short = short

    def _answer(self, call: str, results: BatchResults) -> BatchResults:
        return list(results)[:-1] if call == self.short else results

    async def load_many(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], **options: Any
    ) -> BatchResults:
        return self._answer("load_many", await super().load_many(keys, dsts, **options))

    async def store_many(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], **options: Any
    ) -> BatchResults:
        return self._answer("store_many", await super().store_many(keys, srcs, **options))


async def test_a_short_batch_answer_fails_its_blocks_and_frees_their_slots(
    keys: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    tier = ShortAnswerTier("load_many")
    for key in keys[:3]:
        await tier.store(key, memoryview(bytes(BB)))
    manager = TieringManager(HostPool(8, BB), [tier])
    with anyio.fail_after(10):
        async with manager:
            assert [manager.lookup(k) for k in keys[:3]] == [R, R, R]  # one batch of three
            await manager.wait_idle()  # the engine's own task lives on through the batch
            stats = manager.statistics()
            assert stats.promotions.failed_by_reason == {"tier_error": 3}
            assert [manager.lookup(k) for k in keys[:3]] == [M, M, M]
            assert manager.statistics().lookups.misses_by_reason == {"tier_error": 3}
            assert_idle(manager)
    logged = [r for r in caplog.records if "tier_error" in r.getMessage()]
    assert len(logged) == 1, "a failed batch is logged once, not per block"


async def test_a_short_batch_store_answer_fails_each_write_as_tier_error(
    keys: list[bytes],
) -> None:
    tier = ShortAnswerTier("store_many")
    async with TieringManager(HostPool(8, BB), [tier]) as manager:
        with anyio.fail_after(10):
            await manager.store(keys[:3], np.zeros((3, BB), np.uint8))
            await manager.wait_idle()
        writes = manager.statistics().writes
        assert writes.failures_by_reason == {"tier_error": 3}  # not one for some, none for others
        assert writes.succeeded == 0
        assert_idle(manager)
