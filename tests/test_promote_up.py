"""A block promoted from a lower tier is written to the faster tiers above it (issue 10's
multi-node story: a node that reads a block from the shared S3 tier keeps it on its own FS
tier), through the same admission and in-flight accounting as a store's write-through."""

from __future__ import annotations

import anyio
import pytest

from kvtier import (
    AdmissionPolicy,
    HostPool,
    InvalidArgumentError,
    LookupResult,
    MemoryTier,
    TieringManager,
)
from kvtier.testing import StallingTier

BB = 4096


def block(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * BB)


async def promote(manager: TieringManager, key: bytes) -> None:
    """Look ``key`` up until its promotion has landed in the pool."""
    with anyio.fail_after(30):
        while manager.lookup(key) is not LookupResult.HIT:
            await manager.watch([key]).wait()  # set when its promotion lands


async def test_a_block_promoted_from_a_lower_tier_lands_in_the_tiers_above(
    keys: list[bytes],
) -> None:
    fast, middle, slow = MemoryTier("fast"), MemoryTier("middle"), MemoryTier("slow")
    await slow.store(keys[0], block(7))
    await middle.store(keys[1], block(8))
    async with TieringManager(HostPool(8, BB), [fast, middle, slow]) as manager:
        await promote(manager, keys[0])
        await promote(manager, keys[1])
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.promotions_written_up == 2
    out = bytearray(BB)
    for tier in (fast, middle):  # the block from the slowest tier reached both above it
        await tier.load(keys[0], memoryview(out))
        assert out == block(7)
    await fast.load(keys[1], memoryview(out))
    assert out == block(8)
    assert slow.lookup(keys[1]) is LookupResult.MISS  # never written down
    assert stats.cascades_started == 2 and stats.cascades_succeeded == 2
    assert stats.pool.pinned == 0 and stats.in_flight_bytes == 0


async def test_a_block_promoted_from_the_first_tier_is_not_written_anywhere(
    keys: list[bytes],
) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await fast.store(keys[0], block(1))
    async with TieringManager(HostPool(8, BB), [fast, slow]) as manager:
        await promote(manager, keys[0])
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.promotions_written_up == 0 and stats.cascades_started == 0
    assert slow.lookup(keys[0]) is LookupResult.MISS


async def test_no_write_up_when_it_is_off(keys: list[bytes]) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await slow.store(keys[0], block(1))
    async with TieringManager(HostPool(8, BB), [fast, slow], promote_write_up=False) as manager:
        await promote(manager, keys[0])
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.promotions_written_up == 0 and stats.cascades_started == 0
    assert fast.lookup(keys[0]) is LookupResult.MISS


async def test_write_up_yields_to_back_pressure_and_counts_the_drops(keys: list[bytes]) -> None:
    fast = StallingTier(MemoryTier("fast-inner"), name="fast")
    slow = MemoryTier("slow")
    for i in range(3):
        await slow.store(keys[i], block(i))
    fast.stall("store")
    policy = AdmissionPolicy(max_in_flight_bytes={"fast": BB}, max_write_latency=None)
    async with TieringManager(HostPool(8, BB), [fast, slow], admission=policy) as manager:
        await promote(manager, keys[0])  # its write-up holds the fast tier's only room
        await fast.wait_stalled("store")
        await promote(manager, keys[1])
        await promote(manager, keys[2])
        stats = manager.statistics()
        assert stats.promotions_written_up == 1
        assert stats.cascades_dropped == 2
        (fast_admission,) = [a for a in stats.admission if a.name == "fast"]
        assert fast_admission.dropped_by_cause == {"in_flight": 2}
        assert stats.in_flight_bytes == BB and stats.pool.pinned == 1
        fast.release("store")
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.pool.pinned == 0 and stats.in_flight_bytes == 0
    assert fast.lookup(keys[0]) is not LookupResult.MISS
    assert fast.inner.lookup(keys[1]) is LookupResult.MISS


async def test_write_up_respects_the_global_in_flight_limit(keys: list[bytes]) -> None:
    fast = StallingTier(MemoryTier("fast-inner"), name="fast")
    slow = MemoryTier("slow")
    for i in range(2):
        await slow.store(keys[i], block(i))
    fast.stall("store")
    async with TieringManager(HostPool(8, BB), [fast, slow], max_in_flight_bytes=BB) as manager:
        await promote(manager, keys[0])
        await fast.wait_stalled("store")
        await promote(manager, keys[1])
        stats = manager.statistics()
        assert stats.promotions_written_up == 1 and stats.cascades_skipped == 1
        fast.release("store")


def test_promote_write_up_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="promote_write_up"):
        TieringManager(HostPool(4, BB), [MemoryTier()], promote_write_up="yes")  # type: ignore[arg-type]
