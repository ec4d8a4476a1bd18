"""Lazy promotion: a scheduler's scan resolves existence first and promotes only the blocks
it will count; the lookup results keep their meaning (docs/design.md, "The lookup contract")."""

from __future__ import annotations

import anyio

from kvtier import (
    HostPool,
    LookupResult,
    MemoryTier,
    OffloadScheduler,
    SlotState,
    TieringManager,
)
from kvtier.testing import StallingTier, resolve_lookup
from tests.support import BB, fill, lookup_while_held, random_blocks


async def test_no_promotion_starts_beyond_the_first_miss_of_a_prefix(keys: list[bytes]) -> None:
    checking = StallingTier(name="checking")  # holds nothing; its checks are held
    holding = MemoryTier("holding")  # answers at once: keys 1-3 are here, key 0 is not
    await fill(holding, keys[1:4])
    checking.stall("contains")
    async with TieringManager(HostPool(8, BB), [checking, holding]) as manager:
        scheduler = OffloadScheduler(manager)

        async def key_0_still_unknown() -> None:
            assert manager.statistics().promotions.started == 0

        with anyio.fail_after(10):
            # released, key 0 is in no tier: the prefix ends there
            answer = await lookup_while_held(
                scheduler, keys[:4], checking, "contains", key_0_still_unknown
            )
        assert answer == 0
        stats = manager.statistics()
        assert stats.promotions.started == 0
        assert stats.promotions.deferred >= 3
        assert all(manager.pool.state_of(key) is SlotState.FREE for key in keys[:4])


async def test_once_the_prefix_resolves_the_whole_run_is_promoted(keys: list[bytes]) -> None:
    checking = StallingTier(name="checking")
    await fill(checking.inner, keys[:1])
    holding = MemoryTier("holding")
    await fill(holding, keys[1:4])
    checking.stall("contains")
    async with TieringManager(HostPool(8, BB), [checking, holding]) as manager:
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(10):
            assert await lookup_while_held(scheduler, keys[:4], checking, "contains") == 4
        assert manager.statistics().promotions.started == 4


async def test_the_synchronous_scans_keep_promoting_every_secondary_hit(keys: list[bytes]) -> None:
    checking = StallingTier(name="checking")
    holding = MemoryTier("holding")
    await fill(holding, keys[1:4])
    checking.stall("contains")
    async with TieringManager(HostPool(8, BB), [checking, holding]) as manager:
        # the scan unchanged: RETRY does not stop it, and the manager
        # promotes each secondary hit the scan meets.
        assert OffloadScheduler(manager).maximal_prefix_lookup(keys[:4]) is None
        assert manager.statistics().promotions.started == 3
        checking.release("contains")


async def test_a_request_that_stopped_waiting_cannot_evict_what_a_waiting_one_counted(
    keys: list[bytes],
) -> None:
    w0, w1, wx, s0 = keys[:4]
    remote = StallingTier(name="remote")
    await fill(remote.inner, [wx, s0])
    remote.stall("load")
    async with TieringManager(HostPool(3, BB), [remote]) as manager:
        await manager.store([w0, w1], random_blocks(2))
        for key in (wx, s0):
            await resolve_lookup(remote, key)
        scheduler = OffloadScheduler(manager)

        async def while_w0_w1_counted_and_wx_in_flight() -> None:
            assert await scheduler.lookup([s0], timeout=0) == 0  # gives up at once
            assert manager.pool.state_of(w0) is SlotState.READY
            assert manager.pool.state_of(w1) is SlotState.READY

        with anyio.fail_after(10):
            answer = await lookup_while_held(
                scheduler, [w0, w1, wx], remote, "load", while_w0_w1_counted_and_wx_in_flight
            )
        assert answer == 3
        assert manager.statistics().lookups.misses_by_reason.get("primary_full") == 1


async def test_a_key_held_behind_an_unknown_one_wakes_when_both_change_at_once(
    keys: list[bytes],
) -> None:
    # Key 1 is a tier hit held back (lazy promotion) until key 0's existence is known. A store
    # of key 0 wakes key 1 and then key 0 in one batch: the resumed scan must ask key 0 first,
    # or key 1 is held behind a key that will never change again and the request waits out
    # its deadline (seen once in CI as a scheduler timeout under load).
    k0, k1 = keys[:2]
    checking = StallingTier(name="checking", lookup_timeout=60)  # no timeout verdict either
    await fill(checking.inner, [k1])
    async with TieringManager(HostPool(8, BB), [checking]) as manager:
        assert await resolve_lookup(checking, k1) is LookupResult.HIT
        # Key 0's existence check stays unanswered throughout, and its write-through too (a
        # store landing in the tier would wake key 1 again and hide the bug).
        checking.stall("contains", "store")
        scheduler = OffloadScheduler(manager)
        answer: list[int] = []

        async def request() -> None:
            answer.append(await scheduler.lookup([k0, k1], timeout=10))

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(request)
                await checking.wait_stalled("contains")
                await manager.store([k0], random_blocks(1))
            checking.release("contains", "store")
        assert answer == [2]
        assert scheduler.statistics().timeouts == 0
        assert manager.pool.state_of(k1) is SlotState.READY
