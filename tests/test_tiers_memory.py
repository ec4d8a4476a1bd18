"""The conformance kit on the in-tree tiers, and the testing tiers' own controls."""

from __future__ import annotations

import anyio
import pytest

import kvtier
from kvtier import LookupResult, MemoryTier
from kvtier.testing import CHECKS, FailingTier, StallingTier, check_tier, resolve_lookup


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("make_tier", [MemoryTier, StallingTier, FailingTier])
async def test_conformance(make_tier: type[kvtier.SecondaryTier], check: str) -> None:
    await CHECKS[check](make_tier, 4096)


async def test_check_tier_runs_every_check() -> None:
    await check_tier(MemoryTier, block_bytes=256)


async def test_check_tier_catches_a_broken_tier() -> None:
    class Forgetful(MemoryTier):
        async def store(self, key: bytes, src: memoryview) -> None:
            await super().store(key, memoryview(bytes(src.nbytes)))  # loses the bytes

    with pytest.raises(AssertionError, match="round_trip"):
        await check_tier(Forgetful, block_bytes=256)


async def test_memory_tier_capacity_drops_least_recently_used(keys: list[bytes]) -> None:
    tier = MemoryTier(capacity_bytes=3 * 100)
    for key in keys[:3]:
        await tier.store(key, memoryview(bytes(100)))
    await tier.load(keys[0], memoryview(bytearray(100)))  # keys[1] is now the oldest
    await tier.store(keys[3], memoryview(bytes(100)))
    assert await tier.contains_many(keys[:4]) == [True, False, True, True]
    assert tier.statistics().evictions == 1
    with pytest.raises(kvtier.TierNoSpaceError):
        await tier.store(keys[5], memoryview(bytes(301)))


def test_memory_tier_validates_capacity() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryTier(capacity_bytes=0)


async def test_stalling_tier_holds_operations_until_released(keys: list[bytes]) -> None:
    tier = StallingTier()
    async with tier:
        tier.stall("store")
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.store, keys[0], memoryview(bytes(8)))
            await tier.wait_stalled("store")
            assert tier.stalled["store"] == 1
            assert await tier.inner.contains_many([keys[0]]) == [False]
            tier.release("store")
        assert tier.stalled["store"] == 0
        assert await resolve_lookup(tier, keys[0]) is LookupResult.HIT


async def test_failing_tier_fails_until_recovered(keys: list[bytes]) -> None:
    tier = FailingTier()
    async with tier:
        tier.fail("store", "contains")
        with pytest.raises(kvtier.TierUnavailableError):
            await tier.store(keys[0], memoryview(bytes(8)))
        assert await resolve_lookup(tier, keys[0]) is LookupResult.MISS
        assert tier.statistics().lookups.misses_by_reason == {"unavailable": 1}
        tier.recover()
        await tier.store(keys[0], memoryview(bytes(8)))
        assert tier.failures == {"contains": 1, "load": 0, "store": 1, "delete": 0}


def test_testing_tiers_reject_unknown_operations() -> None:
    with pytest.raises(ValueError, match="unknown operation"):
        StallingTier().stall("read")
