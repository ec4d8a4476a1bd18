"""A block promoted from a lower tier is written to the faster tiers above it (the
multi-node story: a node that reads a block from the shared S3 tier keeps it on its own FS
tier), through the same admission and in-flight accounting as a store's write-through; from a
host pool, when the pool evicts it rather than when it arrives."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier import (
    AdmissionPolicy,
    HostPool,
    InvalidArgumentError,
    LookupResult,
    MemoryTier,
    PrimaryPool,
    TieringManager,
)
from kvtier.manager import ManagerStatistics
from kvtier.testing import StallingTier

BB = 4096


def block(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * BB)


async def promote(manager: TieringManager, key: bytes) -> None:
    """Look ``key`` up until its promotion has landed in the pool."""
    assert await manager.wait_settled(key, timeout=30) is LookupResult.HIT


async def promoted_once(
    pool: HostPool, tiers: list[MemoryTier], key: bytes, **options: Any
) -> ManagerStatistics:
    """The manager's statistics, before it closes, once ``key`` is promoted and every write
    that started has finished."""
    async with TieringManager(pool, tiers, **options) as manager:
        await promote(manager, key)
        await manager.wait_idle()
        return manager.statistics()


async def test_a_block_promoted_from_a_lower_tier_lands_in_the_tiers_above_when_evicted(
    keys: list[bytes],
) -> None:
    fast, middle, slow = MemoryTier("fast"), MemoryTier("middle"), MemoryTier("slow")
    await slow.store(keys[0], block(7))
    await middle.store(keys[1], block(8))
    for i in (2, 3):  # blocks of the first tier: promoting them evicts the first two
        await fast.store(keys[i], block(i))
    async with TieringManager(HostPool(2, BB), [fast, middle, slow]) as manager:
        await promote(manager, keys[0])
        await promote(manager, keys[1])
        await manager.wait_idle()
        stats = manager.statistics()
        # In the pool, they are not copied anywhere yet: the engine may need them right now.
        assert (stats.promotions.written_up, stats.promotions.write_ups_waiting) == (0, 2)
        assert fast.lookup(keys[0]) is LookupResult.MISS
        await promote(manager, keys[2])  # evicts keys[0]: copied up now
        await promote(manager, keys[3])  # evicts keys[1]
        await manager.wait_idle()
        stats = manager.statistics()
    assert (stats.promotions.written_up, stats.promotions.write_ups_waiting) == (2, 0)
    out = bytearray(BB)
    for tier in (fast, middle):  # the block from the slowest tier reached both above it
        await tier.load(keys[0], memoryview(out))
        assert out == block(7)
    await fast.load(keys[1], memoryview(out))
    assert out == block(8)  # the bytes it had in the pool, copied before its slot was reused
    assert slow.lookup(keys[1]) is LookupResult.MISS  # never written down
    assert stats.writes.started == 2 and stats.writes.succeeded == 2
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0


async def test_a_promoted_block_still_in_the_pool_at_close_is_not_copied(
    keys: list[bytes],
) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await slow.store(keys[0], block(5))
    async with TieringManager(HostPool(4, BB), [fast, slow]) as manager:
        await promote(manager, keys[0])
        assert manager.statistics().promotions.write_ups_waiting == 1
    stats = manager.statistics()
    assert (stats.promotions.written_up, stats.promotions.write_ups_waiting) == (0, 0)
    assert fast.lookup(keys[0]) is LookupResult.MISS  # it is still in the slow tier


async def test_a_discarded_promoted_block_is_forgotten_not_copied(keys: list[bytes]) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await slow.store(keys[0], block(3))
    await slow.store(keys[1], block(4))
    async with TieringManager(HostPool(1, BB), [fast, slow]) as manager:
        await promote(manager, keys[0])
        assert manager.statistics().promotions.write_ups_waiting == 1
        assert manager.pool.discard(keys[0])  # its bytes are known bad, say
        assert manager.statistics().promotions.write_ups_waiting == 0
        await promote(manager, keys[1])  # takes the slot keys[0] had: nothing to copy
        await manager.wait_idle()
        stats = manager.statistics()
    assert (stats.promotions.written_up, stats.writes.started) == (0, 0)
    assert fast.lookup(keys[0]) is LookupResult.MISS


async def stalled_fast_over_slow(keys: list[bytes]) -> tuple[StallingTier, MemoryTier]:
    """A fast tier whose stores stall, above a slow tier that holds ``keys`` (``block(i)``
    for the i-th)."""
    fast = StallingTier(MemoryTier("fast-inner"), name="fast")
    slow = MemoryTier("slow")
    for i, key in enumerate(keys):
        await slow.store(key, block(i))
    fast.stall("store")
    return fast, slow


class _DeviceLikePool(HostPool):
    """A pool that cannot copy a slot at once on the loop (as a GPU pool cannot)."""

    # HostPool narrows copy_slot to always answer; this pool is the kind that may not.
    copy_slot = PrimaryPool.copy_slot  # type: ignore[assignment]


async def test_a_pool_that_cannot_copy_at_eviction_writes_up_at_once(keys: list[bytes]) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await slow.store(keys[0], block(6))
    stats = await promoted_once(_DeviceLikePool(4, BB), [fast, slow], keys[0])
    assert (stats.promotions.written_up, stats.promotions.write_ups_waiting) == (1, 0)
    out = bytearray(BB)
    await fast.load(keys[0], memoryview(out))
    assert out == block(6)


async def test_a_block_promoted_from_the_first_tier_is_not_written_anywhere(
    keys: list[bytes],
) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await fast.store(keys[0], block(1))
    stats = await promoted_once(HostPool(8, BB), [fast, slow], keys[0])
    assert stats.promotions.written_up == 0 and stats.writes.started == 0
    assert slow.lookup(keys[0]) is LookupResult.MISS


async def test_no_write_up_when_it_is_off(keys: list[bytes]) -> None:
    fast, slow = MemoryTier("fast"), MemoryTier("slow")
    await slow.store(keys[0], block(1))
    stats = await promoted_once(HostPool(8, BB), [fast, slow], keys[0], promote_write_up=False)
    assert stats.promotions.written_up == 0 and stats.writes.started == 0
    assert fast.lookup(keys[0]) is LookupResult.MISS


async def test_write_up_yields_to_back_pressure_and_counts_the_drops(keys: list[bytes]) -> None:
    fast, slow = await stalled_fast_over_slow(keys[:4])
    policy = AdmissionPolicy(max_in_flight_bytes={"fast": BB}, max_write_latency=None)
    async with TieringManager(HostPool(1, BB), [fast, slow], admission=policy) as manager:
        await promote(manager, keys[0])
        await promote(manager, keys[1])  # evicts keys[0]: its write-up holds fast's only room
        await fast.wait_stalled("store")
        await promote(manager, keys[2])  # evicts keys[1]: no room, dropped
        await promote(manager, keys[3])  # evicts keys[2]: dropped
        stats = manager.statistics()
        assert stats.promotions.written_up == 1
        assert stats.writes.dropped == 2
        (fast_admission,) = [a for a in stats.admission if a.name == "fast"]
        assert fast_admission.dropped_by_cause == {"in_flight": 2}
        # Written from a copy: the evicted slot went straight back to work, unpinned.
        assert stats.writes.in_flight_bytes == BB and stats.pool.pinned == 0
        fast.release("store")
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0
    assert fast.lookup(keys[0]) is not LookupResult.MISS
    assert fast.inner.lookup(keys[1]) is LookupResult.MISS


async def test_write_up_respects_the_global_in_flight_limit(keys: list[bytes]) -> None:
    fast, slow = await stalled_fast_over_slow(keys[:3])
    async with TieringManager(HostPool(1, BB), [fast, slow], max_in_flight_bytes=BB) as manager:
        await promote(manager, keys[0])
        await promote(manager, keys[1])  # evicts keys[0]: written up, stalled
        await fast.wait_stalled("store")
        await promote(manager, keys[2])  # evicts keys[1]: the in-flight limit skips it
        stats = manager.statistics()
        assert stats.promotions.written_up == 1 and stats.writes.skipped == 1
        fast.release("store")


def test_promote_write_up_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="promote_write_up"):
        TieringManager(HostPool(4, BB), [MemoryTier()], promote_write_up="yes")  # type: ignore[arg-type]
