"""The "never slower than recompute" rule through a real manager and scheduler: the tier's
speed is injected into the cost model, the tier itself is held with a StallingTier, and no
test asserts a duration (a rule that failed would wait for ``max_wait``, 30 s, and trip the
generous bound)."""

from __future__ import annotations

import anyio

from kvtier import (
    AdmissionPolicy,
    CostModel,
    HostPool,
    OffloadScheduler,
    SlotState,
    TieringManager,
)
from kvtier.testing import StallingTier, resolve_lookup
from tests.support import BB, fill, lookup_while_held, random_blocks


async def tier_holding(keys: list[bytes], *, held: str | None = None) -> StallingTier:
    """A tier named "remote" that holds ``keys``; its ``held`` operation stalls."""
    tier = StallingTier(name="remote")
    await fill(tier.inner, keys)
    if held is not None:
        tier.stall(held)
    return tier


async def known(tier: StallingTier, keys: list[bytes]) -> None:
    """Resolve ``tier``'s existence check of each of ``keys``: the manager then knows them."""
    for key in keys:
        await resolve_lookup(tier, key)


async def test_a_tier_slower_than_recompute_is_not_promoted_and_not_waited_for(
    keys: list[bytes],
) -> None:
    remote = await tier_holding(keys[1:4], held="load")
    cost = CostModel(recompute_seconds_per_block=0.001)
    cost.observe_promotion("remote", 10.0, BB, ok=True)  # this tier takes 10 s a block
    async with TieringManager(HostPool(8, BB), [remote], cost=cost) as manager:
        await manager.store(keys[:1], random_blocks(1))
        await known(remote, keys[1:4])
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:4]) == 1  # serve the resident block, now
        stats = manager.statistics()
        assert stats.promotions.started == 0
        assert stats.promotions.declined == 1
        assert stats.lookups.misses_by_reason.get("too_slow") == 1
        # Without a request's budget (a plain lookup), the seed's semantics are unchanged.
        assert manager.lookup(keys[1]).name == "RETRY"
        assert manager.statistics().promotions.started == 1
        remote.release("load")


async def test_stop_waiting_once_waiting_costs_more_than_recomputing(keys: list[bytes]) -> None:
    # Promotions start, and never land while the request waits.
    remote = await tier_holding(keys[:4], held="load")
    cost = CostModel(recompute_seconds_per_block=0.001)  # the tier's speed is not known yet
    async with TieringManager(HostPool(8, BB), [remote], cost=cost) as manager:
        await known(remote, keys[:4])
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:4]) == 0
        assert scheduler.statistics().waits_cut == 1
        assert scheduler.statistics().timeouts == 0
        # The promotions it started go on for the next request, and do not leak.
        assert manager.statistics().promotions.started == 4
        remote.release("load")
        await manager.wait_idle()
        assert all(manager.pool.state_of(key) is SlotState.READY for key in keys[:4])


async def test_keep_waiting_when_the_tier_is_faster_than_recompute(keys: list[bytes]) -> None:
    remote = await tier_holding(keys[:4], held="load")
    cost = CostModel(recompute_seconds_per_block=1000.0)
    cost.observe_promotion("remote", 0.001, BB, ok=True)
    async with TieringManager(HostPool(8, BB), [remote], cost=cost) as manager:
        await known(remote, keys[:4])
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            # it waits on the promotions, then they land
            assert await lookup_while_held(scheduler, keys[:4], remote, "load") == 4
        assert scheduler.statistics().waits_cut == 0
        assert manager.statistics().promotions.declined == 0


async def test_without_a_recompute_estimate_the_wait_lasts_until_the_timeout(
    keys: list[bytes],
) -> None:
    remote = await tier_holding(keys[:2], held="load")
    cost = CostModel()
    cost.observe_promotion("remote", 10.0, BB, ok=True)  # slow, but recompute cost unknown
    async with TieringManager(HostPool(8, BB), [remote], cost=cost) as manager:
        await known(remote, keys[:2])
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:2], timeout=0.05) == 0
        assert scheduler.statistics().timeouts == 1
        assert scheduler.statistics().waits_cut == 0
        assert manager.statistics().promotions.started == 2  # today's behaviour
        remote.release("load")


async def test_the_engine_measured_recompute_cost_is_used(keys: list[bytes]) -> None:
    remote = await tier_holding(keys[:2])
    cost = CostModel()
    cost.observe_promotion("remote", 10.0, BB, ok=True)
    cost.observe_recompute(blocks=100, seconds=0.1)  # the engine prefills 1 ms a block
    async with TieringManager(HostPool(8, BB), [remote], cost=cost) as manager:
        await known(remote, keys[:2])
        with anyio.fail_after(10):
            assert await OffloadScheduler(manager).lookup(keys[:2]) == 0
        assert manager.statistics().promotions.declined == 1


async def test_a_tier_known_only_by_its_slow_writes_is_not_waited_for(keys: list[bytes]) -> None:
    remote = StallingTier(name="remote")
    remote.stall("contains")  # its existence checks never answer while the request asks
    cost = CostModel(recompute_seconds_per_block=0.001)
    policy = AdmissionPolicy()
    async with TieringManager(HostPool(8, BB), [remote], cost=cost, admission=policy) as manager:
        policy.observe_write_latency("remote", 2.0)  # never promoted from yet; its writes take 2 s
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            assert await scheduler.lookup(keys[:4]) == 0
        assert scheduler.statistics().waits == 0  # it did not wait at all
        assert manager.statistics().lookups.misses_by_reason.get("too_slow") == 1
        remote.release("contains")


async def test_the_request_waits_for_the_fast_tier_but_not_for_a_slow_tiers_checks(
    keys: list[bytes],
) -> None:
    fast = await tier_holding(keys[:2], held="load")
    slow = StallingTier(name="slow")
    slow.stall("contains")  # key 2 is in neither; only the slow tier is still checking it
    cost = CostModel(recompute_seconds_per_block=1.0)
    cost.observe_promotion("remote", 0.001, BB, ok=True)  # the fast tier
    cost.observe_promotion("slow", 10.0, BB, ok=True)
    async with TieringManager(HostPool(8, BB), [fast, slow], cost=cost) as manager:
        await known(fast, keys[:3])
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            # it waits for the fast tier's two blocks
            assert await lookup_while_held(scheduler, keys[:3], fast, "load") == 2
        assert scheduler.statistics().waits_cut == 0
        assert manager.statistics().lookups.misses_by_reason.get("too_slow") == 1
        slow.release("contains")
