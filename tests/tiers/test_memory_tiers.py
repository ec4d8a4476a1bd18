"""The conformance kit on the in-tree tiers, and the testing tiers' own controls."""

from __future__ import annotations

import anyio
import pytest

import kvtier
from kvtier import LookupResult, MemoryTier
from kvtier.testing import FailingTier, StallingTier, check_tier, resolve_lookup


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


async def test_lookup_with_reason_defaults_to_not_found_from_lookup(keys: list[bytes]) -> None:
    """The base answers from ``lookup`` (one lookup, counted once): a miss is not_found,
    any other answer has no reason."""
    tier = MemoryTier()
    await tier.store(keys[0], memoryview(bytes(8)))
    assert tier.lookup_with_reason(keys[0]) == (LookupResult.HIT, None)
    assert tier.lookup_with_reason(keys[1]) == (LookupResult.MISS, kvtier.MissReason.NOT_FOUND)
    lookups = tier.statistics().lookups
    assert (lookups.hits, lookups.misses) == (1, 1)


async def test_a_tier_that_overrides_lookup_alone_answers_for_its_own_lookup(
    keys: list[bytes],
) -> None:
    """A subclass that overrides ``lookup`` but not ``lookup_with_reason`` gets the default
    built from its own ``lookup``, never the parent's answer with a reason."""

    class Knowing(MemoryTier):
        def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, kvtier.MissReason | None]:
            return LookupResult.MISS, kvtier.MissReason.CORRUPT

    class Busy(Knowing):
        def lookup(self, key: bytes) -> LookupResult:
            return LookupResult.RETRY

    assert Knowing().lookup_with_reason(keys[0]) == (LookupResult.MISS, kvtier.MissReason.CORRUPT)
    assert Busy().lookup_with_reason(keys[0]) == (LookupResult.RETRY, None)
    retrying = StallingTier()
    async with retrying:
        assert retrying.lookup_with_reason(keys[0]) == (LookupResult.RETRY, None)


async def test_check_tier_catches_a_reason_that_disagrees_with_lookup() -> None:
    class Contrary(MemoryTier):
        def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, kvtier.MissReason | None]:
            return LookupResult.MISS, kvtier.MissReason.CORRUPT

    with pytest.raises(AssertionError, match="lookup_reason"):
        await check_tier(Contrary, block_bytes=256)
