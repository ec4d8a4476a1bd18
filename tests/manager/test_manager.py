"""TieringManager: the lookup algorithm (docs/design.md, "The lookup contract"), store, load,
write-through, limits."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch

import kvtier
from kvtier import HostPool, MemoryTier, MissReason, TieringManager
from kvtier.manager._watch import KeyWatch
from kvtier.testing import FailingTier, StallingTier, resolve_lookup
from kvtier.tiers._base import BatchResults
from tests.support import H, M, P, R, assert_holds, fill, random_blocks

BB = 4096


async def test_primary_hit_and_miss(keys: list[bytes]) -> None:
    async with TieringManager(HostPool(8, BB)) as manager:
        assert manager.lookup(keys[0]) is M
        assert await manager.store(keys[:2], random_blocks(2)) == 2
        assert manager.lookup(keys[0]) is H
        assert manager.statistics().lookups.misses_by_reason == {"not_found": 1}


async def test_secondary_hit_promotes_and_second_lookup_is_pending(keys: list[bytes]) -> None:
    slow = StallingTier()
    await fill(slow.inner, keys[:1], random_blocks(1))
    slow.stall("load")
    async with TieringManager(HostPool(4, BB), [slow]) as manager:
        assert await resolve_lookup(slow, keys[0]) is H  # existence known
        assert manager.lookup(keys[0]) is R  # promotion started
        assert manager.lookup(keys[0]) is P  # the slot is reserved: no second promotion
        assert manager.statistics().promotions.started == 1
        await slow.wait_stalled("load")
        slow.release("load")
        assert await manager.wait_settled(keys[0], timeout=5) is H
        out = np.zeros((1, BB), np.uint8)
        assert await manager.load(keys[:1], out) == 1
        assert (out == random_blocks(1)).all()


async def test_tiers_are_asked_in_order_and_the_first_hit_wins(keys: list[bytes]) -> None:
    first, second = MemoryTier("first"), MemoryTier("second")
    await fill(first, keys[:1], random_blocks(1, seed=1))
    await fill(second, keys[:2], random_blocks(2, seed=2))
    async with TieringManager(HostPool(4, BB), [first, second]) as manager:
        assert manager.lookup(keys[0]) is R
        assert manager.lookup(keys[1]) is R
        assert await manager.wait_settled(keys[0], timeout=5) is H
        assert await manager.wait_settled(keys[1], timeout=5) is H
        out = np.zeros((2, BB), np.uint8)
        await manager.load(keys[:2], out)
    assert (out[0] == random_blocks(1, seed=1)[0]).all()
    assert (out[1] == random_blocks(2, seed=2)[1]).all()
    assert first.statistics().loads == 1 and second.statistics().loads == 1


async def test_retry_from_any_tier_makes_a_retry(keys: list[bytes]) -> None:
    slow = StallingTier()
    slow.stall("contains")
    async with TieringManager(HostPool(4, BB), [MemoryTier(), slow]) as manager:
        assert manager.lookup(keys[0]) is R
        await slow.wait_stalled("contains")
        slow.release("contains")
        assert await manager.wait_settled(keys[0], timeout=5) is M


async def test_primary_full_answers_miss(keys: list[bytes]) -> None:
    tier = MemoryTier()
    await fill(tier, keys[4:5], random_blocks(1))
    pool = HostPool(2, BB)
    async with TieringManager(pool, [tier]) as manager:
        await manager.store(keys[:2], random_blocks(2))
        await manager.wait_idle()  # write-through done: only our pins hold the slots
        pins = [pool.pin(key) for key in keys[:2]]
        assert manager.lookup(keys[4]) is M
        assert manager.statistics().lookups.misses_by_reason == {"primary_full": 1}
        for slot in pins:
            assert slot is not None
            pool.unpin(slot)
        assert manager.lookup(keys[4]) is R  # room again: evicts and promotes


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (kvtier.CorruptBlockError, "corrupt"),
        (kvtier.TierUnavailableError, "unavailable"),
        (kvtier.BlockNotFoundError, "not_found"),
    ],
)
async def test_failed_promotion_frees_the_slot_and_marks_a_miss(
    keys: list[bytes], error: type[kvtier.TierError], reason: str
) -> None:
    tier = FailingTier()
    await fill(tier.inner, keys[:1], random_blocks(1))
    tier.fail("load", error=error)
    pool = HostPool(4, BB)
    async with TieringManager(pool, [tier]) as manager:
        assert await resolve_lookup(tier, keys[0]) is H
        assert manager.lookup(keys[0]) is R
        assert await manager.wait_settled(keys[0], timeout=5) is M  # not a loop of retries
        stats = manager.statistics()
        assert stats.promotions.failed_by_reason == {reason: 1}
        assert stats.pool.free == 4 and stats.pool.writing == 0
        assert tier.statistics().lookups.misses_by_reason.get(reason, 0) >= 1


async def test_promotion_timeout_frees_the_slot(keys: list[bytes]) -> None:
    slow = StallingTier()
    await fill(slow.inner, keys[:1], random_blocks(1))
    slow.stall("load")
    pool = HostPool(4, BB)
    async with TieringManager(pool, [slow], promotion_timeout=0.05) as manager:
        assert await resolve_lookup(slow, keys[0]) is H
        assert manager.lookup(keys[0]) is R
        assert await manager.wait_settled(keys[0], timeout=5) is M
        assert manager.statistics().promotions.failed_by_reason == {"timeout": 1}
        assert pool.statistics().writing == 0
        slow.release("load")


async def test_store_writes_through_to_every_tier(keys: list[bytes]) -> None:
    a, b = MemoryTier("a"), MemoryTier("b")
    data = random_blocks(4)
    async with TieringManager(HostPool(8, BB), [a, b]) as manager:
        assert await manager.store(keys[:4], data) == 4
        assert await manager.store(keys[:4], data) == 0  # already present: skipped
    for tier in (a, b):
        for key, block in zip(keys[:4], data, strict=True):
            out = bytearray(BB)
            await tier.load(key, memoryview(out))
            assert out == block.tobytes()
    stats = manager.statistics()
    assert stats.writes.started == stats.writes.succeeded == 4
    assert stats.stores.skipped_present == 4
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0


class BatchRecordingTier(MemoryTier):
    """A MemoryTier that records the keys of each ``store_many`` and fails the stores of
    the keys in ``refuse`` (each on its own, the rest of the batch lands)."""

    def __init__(self, name: str, refuse: Sequence[bytes] = ()) -> None:
        super().__init__(name)
        self.batches: list[list[bytes]] = []
        self.refuse = set(refuse)

    async def _store_batch(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        self.batches.append(list(keys))
        results = await super()._store_batch(keys, srcs, deadline, pinned)
        for i, key in enumerate(keys):
            if key in self.refuse:
                await self.delete(key)
                results[i] = kvtier.TierNoSpaceError(
                    "refused", tier=self.name, operation="store", key=key
                )
        return results


async def test_a_store_is_written_through_in_one_batch_per_tier(keys: list[bytes]) -> None:
    """One cascade per store: each tier takes the store's blocks in one ``store_many``; a
    block a tier fails is counted on its own, and the tier's listeners hear of the rest."""
    a, b = BatchRecordingTier("a"), BatchRecordingTier("b", refuse=keys[1:3])
    heard: list[bytes] = []
    b.add_listener(heard.append)
    data = random_blocks(6)
    async with TieringManager(HostPool(8, BB), [a, b]) as manager:
        assert await manager.store(keys[:6], data) == 6
        await manager.wait_idle()
    assert a.batches == b.batches == [keys[:6]]
    await assert_holds(a, keys[:6], data)
    assert sorted(heard) == sorted(keys[:1] + keys[3:6])
    stats = manager.statistics()
    assert stats.writes.started == 6
    assert stats.writes.succeeded == 4
    assert stats.writes.failures_by_reason == {"no_space": 2}
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0
    assert [s.in_flight_bytes for s in stats.admission] == [0, 0]


async def test_write_through_is_bounded_by_in_flight_bytes(keys: list[bytes]) -> None:
    slow = StallingTier()
    slow.stall("store")
    async with TieringManager(HostPool(8, BB), [slow], max_in_flight_bytes=2 * BB) as manager:
        await manager.store(keys[:5], random_blocks(5))
        stats = manager.statistics()
        assert stats.writes.started == 2
        assert stats.writes.skipped == 3
        assert stats.writes.in_flight_bytes == 2 * BB
        slow.release("store")


async def test_failed_write_through_is_counted_and_the_block_stays(keys: list[bytes]) -> None:
    tier = FailingTier()
    tier.fail("store", error=kvtier.TierNoSpaceError)
    async with TieringManager(HostPool(8, BB), [tier]) as manager:
        await manager.store(keys[:2], random_blocks(2))
    stats = manager.statistics()
    assert stats.writes.failures_by_reason == {"no_space": 2}
    assert stats.pool.ready == 2 and stats.pool.pinned == 0


async def test_exit_finishes_cascades_then_cancels_the_rest(keys: list[bytes]) -> None:
    slow = StallingTier()
    fast = MemoryTier()
    slow.stall("store")
    async with TieringManager(HostPool(8, BB), [fast, slow], close_timeout=0.05) as manager:
        await manager.store(keys[:3], random_blocks(3))
    stats = manager.statistics()
    assert stats.writes.cancelled == 3
    assert stats.background.tasks == 0
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0
    assert fast.statistics().blocks == 3  # the healthy tier got its writes


async def test_exit_waits_for_cascades_that_finish_in_time(keys: list[bytes]) -> None:
    slow = StallingTier()
    slow.stall("store")
    manager = TieringManager(HostPool(8, BB), [slow], close_timeout=30)
    async with anyio.create_task_group() as tg, manager:
        await manager.store(keys[:2], random_blocks(2))
        await slow.wait_stalled("store")
        tg.start_soon(lambda: _release_later(slow))
    assert manager.statistics().writes.cancelled == 0
    assert slow.inner.statistics().blocks == 2


async def _release_later(tier: StallingTier) -> None:
    await anyio.lowlevel.checkpoint()
    tier.release("store")


async def test_load_accepts_numpy_torch_and_lists(keys: list[bytes]) -> None:
    data = random_blocks(3)
    async with TieringManager(HostPool(8, BB)) as manager:
        await manager.store(keys[:3], torch.from_numpy(data.copy()).view(torch.float16))
        out_np = np.zeros((3, BB), np.uint8)
        assert await manager.load(keys[:3], out_np) == 3
        out_t = torch.zeros(3, BB // 2, dtype=torch.bfloat16)
        assert await manager.load(keys[:3], out_t) == 3
        out_list = [np.zeros(BB // 4, np.float32) for _ in range(3)]
        assert await manager.load(keys[:3], out_list) == 3
    assert (out_np == data).all()
    assert (out_t.view(torch.uint8).numpy() == data).all()
    assert all((o.view(np.uint8) == d).all() for o, d in zip(out_list, data, strict=True))


async def test_load_stops_at_the_first_block_not_in_the_pool(keys: list[bytes]) -> None:
    async with TieringManager(HostPool(8, BB)) as manager:
        await manager.store([keys[0], keys[2]], random_blocks(2))
        out = np.zeros((3, BB), np.uint8)
        assert await manager.load(keys[:3], out) == 1
        assert manager.statistics().pool.pinned == 0


async def test_large_copies_leave_the_loop_responsive(keys: list[bytes]) -> None:
    big = 1 << 20
    data = np.ones((4, big), np.uint8)
    async with TieringManager(HostPool(4, big)) as manager:
        assert await manager.store(keys[:4], data) == 4  # 4 MiB: copied in a worker thread
        out = np.zeros_like(data)
        assert await manager.load(keys[:4], out) == 4
    assert (out == 1).all()


async def test_dtype_is_enforced_when_configured(keys: list[bytes]) -> None:
    async with TieringManager(HostPool(8, BB), dtype=torch.float16) as manager:
        with pytest.raises(
            ValueError, match="dtype float32 but this manager was configured for float16"
        ):
            await manager.store(keys[:1], np.zeros((1, BB // 4), np.float32))
        await manager.store(keys[:1], np.zeros((1, BB // 2), np.float16))


@pytest.mark.parametrize(
    ("make_blocks", "message"),
    [
        (lambda: np.zeros((2, BB), np.uint8), "has 2 blocks along its first axis but 3 keys"),
        (
            lambda: np.zeros((3, BB + 1), np.uint8),
            "holds 4097 bytes but the pool's blocks are 4096",
        ),
        (lambda: [np.zeros(BB, np.uint8)] * 2, "has 2 blocks but 3 keys"),
        (lambda: np.zeros((3, BB), object), "dtype object"),
        (lambda: np.zeros((3, 2 * BB), np.uint8)[:, ::2], "C-contiguous"),
        (lambda: "bytes please", "must be an array with a leading block axis"),
    ],
)
async def test_bad_blocks_raise_before_anything_changes(
    keys: list[bytes], make_blocks: object, message: str
) -> None:
    async with TieringManager(HostPool(8, BB), [MemoryTier()]) as manager:
        await manager.store(keys[3:4], random_blocks(1))
        await manager.wait_idle()  # its write-through done: the pool holds still
        before = manager.statistics()
        with pytest.raises(ValueError, match=message):
            await manager.store(keys[:3], make_blocks())  # type: ignore[operator]
        with pytest.raises(ValueError, match=message):
            await manager.load(keys[:3], make_blocks())  # type: ignore[operator]
        after = manager.statistics()
        assert after.pool == before.pool


async def test_bad_keys_say_what_to_fix(keys: list[bytes]) -> None:
    async with TieringManager(HostPool(8, BB)) as manager:
        with pytest.raises(ValueError, match=r"keys\[1\] must be bytes"):
            await manager.store([keys[0], "abc"], random_blocks(2))  # type: ignore[list-item]
        with pytest.raises(ValueError, match="not one key"):
            await manager.store(keys[0], random_blocks(1))  # type: ignore[arg-type]
        out = np.zeros((1, BB), np.uint8)
        out.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            await manager.load(keys[:1], out)


def test_constructor_validates(keys: list[bytes]) -> None:
    pool = HostPool(2, BB)
    with pytest.raises(ValueError, match="pool must be a kvtier pool"):
        TieringManager(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="list of tiers"):
        TieringManager(pool, MemoryTier())  # type: ignore[arg-type]
    tier = MemoryTier()
    with pytest.raises(ValueError, match="listed twice"):
        TieringManager(pool, [tier, tier])
    with pytest.raises(ValueError, match="promotion_timeout must be a positive number"):
        TieringManager(pool, promotion_timeout=0)


async def test_use_outside_async_with_is_a_clear_error(keys: list[bytes]) -> None:
    manager = TieringManager(HostPool(2, BB), [MemoryTier()])
    with pytest.raises(kvtier.LifecycleError, match="async with"):
        manager.lookup(keys[0])
    with pytest.raises(kvtier.LifecycleError, match="async with"):
        await manager.store(keys[:1], random_blocks(1))


async def test_manager_can_be_reentered_and_tiers_keep_their_blocks(keys: list[bytes]) -> None:
    tier = StallingTier()
    manager = TieringManager(HostPool(4, BB), [tier])
    async with manager:
        await manager.store(keys[:2], random_blocks(2))
    async with manager:
        assert manager.lookup(keys[0]) is H
    manager2 = TieringManager(HostPool(4, BB), [tier])
    async with manager2:
        assert await manager2.wait_settled(keys[1], timeout=5) is H
    assert "closed" in repr(manager2)


async def test_statistics_add_up(keys: list[bytes]) -> None:
    tier = MemoryTier()
    await fill(tier, keys[10:12], random_blocks(2))
    async with TieringManager(HostPool(8, BB), [tier]) as manager:
        await manager.store(keys[:3], random_blocks(3))
        for key in keys[:3] + keys[10:12] + keys[15:16]:
            manager.lookup(key)
        await manager.wait_settled(keys[10], timeout=5)
        await manager.wait_settled(keys[11], timeout=5)
        stats = manager.statistics()
    total = stats.lookups.hit + stats.lookups.hit_pending + stats.lookups.retry + stats.lookups.miss
    assert total >= 6
    assert stats.promotions.started == stats.promotions.succeeded == 2
    assert stats.pool.ready == 5 and stats.pool.commits == 5
    assert stats.lookups.misses_by_reason == {MissReason.NOT_FOUND.value: 1}


async def test_latency_observers_see_promotions_and_lookups(keys: list[bytes]) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.promotions: list[tuple[str, bool]] = []
            self.lookups: list[float] = []

        def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None:
            assert seconds >= 0
            self.promotions.append((tier, ok))

        def observe_lookup(self, seconds: float) -> None:
            self.lookups.append(seconds)

    recorder = Recorder()
    tier = MemoryTier("mem")
    await fill(tier, keys[:2], random_blocks(2))
    async with TieringManager(HostPool(4, BB), [tier], latency=recorder) as manager:
        scheduler = kvtier.OffloadScheduler(manager, latency=recorder)
        assert await scheduler.lookup(keys[:2]) == 2
    assert recorder.promotions == [("mem", True), ("mem", True)]
    assert len(recorder.lookups) == 1


async def test_promotions_in_flight_are_counted_for_the_cost_model_and_given_back(
    keys: list[bytes],
) -> None:
    """Each promotion is counted in flight from the lookup that starts it, so the next key of
    the same scan is expected behind it; finished, failed or cancelled before it ran, each
    gives its count back."""
    slow = StallingTier()
    await fill(slow.inner, keys[:4], random_blocks(4))
    slow.stall("load")
    async with TieringManager(HostPool(8, BB), [slow]) as manager:
        for key in keys[:4]:
            assert await resolve_lookup(slow, key) is H
        for key in keys[:3]:
            assert manager.lookup(key) is R
        (tier,) = manager.statistics().cost.tiers
        assert tier.in_flight == 3
        await slow.wait_stalled("load")
        slow.release("load")
        await manager.wait_idle()
        (tier,) = manager.statistics().cost.tiers
        assert tier.in_flight == 0
        assert tier.idle_latency_seconds is not None  # the first one found the tier idle
        slow.stall("load")
        assert manager.lookup(keys[3]) is R  # promoted, then the manager closes under it
    (tier,) = manager.statistics().cost.tiers
    assert tier.in_flight == 0


async def test_a_promoted_block_is_pinned_for_the_lookup_waiting_on_it(keys: list[bytes]) -> None:
    """A block lands in the lease of the lookup that waits on it, before that lookup runs
    again: a pool that turns over faster than the loop resumes its waiters evicted it first,
    and the block was promoted again and again without ever being counted."""
    tier = MemoryTier()
    data = random_blocks(1)
    await tier.store(keys[0], memoryview(data[0].tobytes()))
    async with TieringManager(HostPool(4, BB), [tier]) as manager:
        watch = KeyWatch()
        lease: list[int] = []
        watch.lease = lease
        manager.watch([keys[0]], watch)
        assert manager.lookup(keys[0]) is R  # its promotion starts
        await manager.wait_idle()  # landed; the waiter has not run since
        assert len(lease) == 1 and manager.statistics().pool.pinned == 1
        await manager.store(keys[1:8], random_blocks(7))  # the pool turns over
        assert manager.lookup(keys[0]) is H  # still there, for the waiter to count
        assert manager.statistics().pool.evictions == 0  # without the pin, it went first
        manager.unpin_slots(lease)
        manager.unwatch([keys[0]], watch)
        await manager.wait_idle()
        assert manager.statistics().pool.pinned == 0


async def test_a_store_yields_before_and_after_placing_and_a_cancelled_one_stores_nothing(
    keys: list[bytes],
) -> None:
    """``store`` takes two loop steps even when its copy never waits: another task runs once
    before it places anything and once after, before it returns, and a store cancelled at the
    first has placed nothing."""
    order: list[str] = []

    async def other(manager: TieringManager) -> None:
        for _ in range(2):
            order.append("hit" if manager.lookup(keys[0]) is H else "miss")
            await anyio.lowlevel.checkpoint()

    async with TieringManager(HostPool(8, BB), [MemoryTier()]) as manager:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other, manager)
            assert await manager.store(keys[:2], random_blocks(2)) == 2
            order.append("stored")
        assert order == ["miss", "hit", "stored"]
        with anyio.CancelScope() as scope:
            scope.cancel()
            await manager.store(keys[2:4], random_blocks(2))
        assert scope.cancelled_caught
        assert manager.statistics().pool.ready == 2


async def test_a_store_cancelled_after_it_placed_its_blocks_keeps_them(keys: list[bytes]) -> None:
    """Cancelled at its second yield, once the blocks are placed, a store raises and the
    blocks stay stored, their write-through started."""
    scope = anyio.CancelScope()

    async def store(manager: TieringManager) -> None:
        with scope:
            await manager.store(keys[:2], random_blocks(2))

    async def cancel_once_placed(manager: TieringManager) -> None:
        while manager.lookup(keys[0]) is not H:
            await anyio.lowlevel.checkpoint()
        scope.cancel()

    tier = MemoryTier()
    async with TieringManager(HostPool(8, BB), [tier]) as manager:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store, manager)
            tg.start_soon(cancel_once_placed, manager)
        assert scope.cancelled_caught
        await manager.wait_idle()
        assert manager.statistics().pool.ready == 2
        assert all(tier.lookup(key) is H for key in keys[:2])
