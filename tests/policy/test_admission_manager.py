"""Write-through that yields, through a real manager: back-pressure engages, drops are
counted, it recovers; write-back writes on eviction and loses nothing from a healthy tier.
Latencies are injected into the policy (a fake clock), the tiers are held with a
StallingTier; nothing here asserts a duration."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from kvtier import (
    AdmissionPolicy,
    HostPool,
    LookupResult,
    MemoryTier,
    PrimaryPool,
    SecondaryTier,
    SlotState,
    TieringManager,
)
from kvtier.pools._base import ByteSource
from kvtier.testing import StallingTier
from tests.support import GatedPool, ManualClock, random_blocks

BB = 4096


def held(tier: SecondaryTier, keys: list[bytes]) -> list[bool]:
    return [tier.lookup(key) is LookupResult.HIT for key in keys]


class CountingAdmission(AdmissionPolicy):
    """Admission that counts, by tier, the times it was asked to admit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.asked: dict[str, int] = {}

    def admit(self, tier: str, nbytes: int, *, count: int = 1) -> bool:
        self.asked[tier] = self.asked.get(tier, 0) + 1
        return super().admit(tier, nbytes, count=count)


@asynccontextmanager
async def slow_at_two_blocks() -> AsyncIterator[
    tuple[TieringManager, CountingAdmission, MemoryTier, StallingTier]
]:
    """A manager that writes through to a memory tier ``fast`` and to a tier ``slow`` whose
    stores are held until the test releases them, admitting at most two blocks in flight to
    ``slow`` (and never dropping one for its latency)."""
    policy = CountingAdmission(max_in_flight_bytes={"slow": 2 * BB}, max_write_latency=None)
    fast = MemoryTier("fast")
    slow = StallingTier(name="slow")
    slow.stall("store")
    async with TieringManager(HostPool(32, BB), [fast, slow], admission=policy) as manager:
        yield manager, policy, fast, slow


async def test_a_slow_tier_is_skipped_counted_and_admitted_again_when_it_recovers(
    keys: list[bytes],
    clock: ManualClock,
) -> None:
    policy = AdmissionPolicy(max_write_latency=0.5, probe_interval=1.0, alpha=0.5, clock=clock)
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    async with TieringManager(HostPool(32, BB), [fast, slow], admission=policy) as manager:
        policy.observe_write_latency("slow", 8.0)  # its last write took 8 s: back-pressure engages
        for i in range(3):
            await manager.store(keys[i : i + 1], random_blocks(1))
            await manager.wait_idle()
        assert held(fast, keys[:3]) == [True, True, True]  # the fast tier is not held back
        assert held(slow, keys[:3]) == [True, False, False]  # one probe; two dropped
        assert manager.statistics().writes.dropped == 2
        assert manager.statistics().admission[1].dropped_by_cause == {"latency": 2}
        # Each interval one probe measures it again; fast probes reopen it.
        i = 3
        while policy.is_closed("slow"):
            clock.now += 1.0
            await manager.store(keys[i : i + 1], random_blocks(1))
            await manager.wait_idle()
            i += 1
            assert i < 12, "the tier never recovered"
        await manager.store(keys[i : i + 3], random_blocks(3))
        await manager.wait_idle()
        assert held(slow, keys[i : i + 3]) == [True, True, True]
        assert manager.statistics().writes.dropped == 2


async def test_a_tier_at_its_in_flight_limit_drops_new_blocks_until_it_drains(
    keys: list[bytes],
) -> None:
    async with slow_at_two_blocks() as (manager, _, fast, slow):
        await manager.store(keys[:4], random_blocks(4))
        with anyio.fail_after(10):
            while slow.stalled["store"] < 2:
                await slow.wait_stalled("store")
                await anyio.lowlevel.checkpoint()
        stats = manager.statistics()
        assert stats.admission[1].dropped_by_cause == {"in_flight": 2}
        assert stats.admission[1].in_flight_bytes == 2 * BB
        slow.release("store")
        with anyio.fail_after(10):
            await manager.wait_idle()
        assert held(fast, keys[:4]) == [True] * 4
        await manager.store(keys[4:6], random_blocks(2))
        await manager.wait_idle()
        assert manager.statistics().admission[1].dropped == 2  # room again: none dropped
        assert slow.inner.statistics().blocks == 4


async def test_a_tier_that_refuses_a_block_is_not_asked_about_the_rest_of_the_store(
    keys: list[bytes],
) -> None:
    async with slow_at_two_blocks() as (manager, policy, fast, slow):
        await manager.store(keys[:6], random_blocks(6))
        assert policy.asked == {"fast": 6, "slow": 3}  # two admitted, the third refused
        stats = manager.statistics().admission[1]
        assert stats.dropped_by_cause == {"in_flight": 4}  # the rest counted for its cause
        slow.release("store")
        with anyio.fail_after(10):
            await manager.wait_idle()
        assert held(fast, keys[:6]) == [True] * 6
        assert held(slow.inner, keys[:6]) == [True, True] + [False] * 4


async def test_write_back_writes_on_eviction_and_loses_nothing(keys: list[bytes]) -> None:
    policy = AdmissionPolicy(write_back=["remote"])
    near, remote = MemoryTier("near"), MemoryTier("remote")
    manager = TieringManager(HostPool(6, BB), [near, remote], admission=policy, write_back_limit=2)
    async with manager:
        for i in range(3):
            await manager.store(keys[i : i + 1], random_blocks(1))
            await manager.wait_idle()
        assert held(near, keys[:3]) == [True] * 3  # write-through as ever
        assert held(remote, keys[:3]) == [True, False, False]  # only the oldest left
        assert manager.statistics().writes.dirty_blocks == 2
        for i in range(3, 12):  # twice the pool: blocks must leave it to make room
            await manager.store(keys[i : i + 1], random_blocks(1))
            await manager.wait_idle()
            in_pool = [manager.pool.state_of(key) is SlotState.READY for key in keys[: i + 1]]
            assert all(p or r for p, r in zip(in_pool, held(remote, keys[: i + 1]), strict=True))
        assert manager.statistics().pool.evictions > 0
    assert held(remote, keys[:12]) == [True] * 12  # the rest were written back at close
    stats = manager.statistics()
    assert (
        stats.writes.written_back == 12
        and stats.writes.dirty_blocks == 0
        and stats.writes.dropped == 0
    )


async def test_a_block_stored_while_the_manager_closes_is_written_back_not_left_pinned(
    keys: list[bytes],
) -> None:
    pool = GatedPool(8, BB, closed=False, loads=False)
    near = StallingTier(name="near")
    remote = MemoryTier("remote")
    manager = TieringManager(
        pool, [near, remote], admission=AdmissionPolicy(write_back=["remote"]), write_back_limit=4
    )
    with anyio.fail_after(10):
        async with anyio.create_task_group() as engine:
            await manager.__aenter__()
            near.stall("store")
            await manager.store(keys[:1], random_blocks(1))  # its write-through to near is held
            pool.close_gate()
            engine.start_soon(manager.store, keys[1:2], random_blocks(1))
            await pool.entered.wait()  # the second store is copying

            async def while_it_closes() -> None:
                await anyio.wait_all_tasks_blocked()  # close waits for near's write-through
                pool.open_gate()  # the store lands while the manager closes
                await anyio.wait_all_tasks_blocked()
                near.release("store")

            engine.start_soon(while_it_closes)
            await manager.aclose()
    stats = manager.statistics()
    assert stats.writes.dirty_blocks == 0 and stats.pool.pinned == 0
    assert held(remote, keys[:2]) == [True, True]


class FailingDrainPool(HostPool):
    """A HostPool whose drains fail before handing the bytes to any tier; it drains a batch
    slot by slot, as a pool without direct views does (``PrimaryPool.drain_many``)."""

    drain_many = PrimaryPool.drain_many

    async def drain(self, slot: int, source: ByteSource) -> None:
        await anyio.lowlevel.checkpoint()
        raise OSError("staging buffer lost")


async def test_a_write_through_that_fails_before_any_tier_gives_its_admission_back(
    keys: list[bytes],
) -> None:
    policy = AdmissionPolicy(max_in_flight_bytes=BB)
    tier = MemoryTier("t")
    async with TieringManager(FailingDrainPool(8, BB), [tier], admission=policy) as manager:
        for i in range(3):  # with the admission leaked, the 2nd and 3rd would be dropped
            await manager.store(keys[i : i + 1], random_blocks(1))
            await manager.wait_idle()
        (stats,) = manager.statistics().admission
        assert stats.in_flight_bytes == 0 and stats.dropped == 0
        assert manager.statistics().writes.failures_by_reason == {"unavailable": 3}


async def test_a_store_every_tier_refuses_counts_its_later_blocks_for_each_tier(
    keys: list[bytes],
) -> None:
    limits = {"a": 2 * BB, "b": 1 * BB}
    policy = CountingAdmission(max_in_flight_bytes=limits, max_write_latency=None)
    a, b = StallingTier(name="a"), StallingTier(name="b")
    a.stall("store")
    b.stall("store")
    async with TieringManager(HostPool(32, BB), [a, b], admission=policy) as manager:
        assert await manager.store(keys[:6], random_blocks(6)) == 6
        assert policy.asked == {"a": 3, "b": 2}  # neither asked once both had refused
        stats = manager.statistics()
        assert stats.admission[0].dropped_by_cause == {"in_flight": 4}
        assert stats.admission[1].dropped_by_cause == {"in_flight": 5}
        a.release("store")
        b.release("store")
        with anyio.fail_after(10):
            await manager.wait_idle()
        assert held(a.inner, keys[:6]) == [True, True] + [False] * 4
        assert held(b.inner, keys[:6]) == [True] + [False] * 5
