"""Deferred writes to a tier that packs the stores it is given together (``write_batch`` > 1,
the S3 tier): they reach it in groups, every store of a group in flight at once, and a rate
limit lets a whole group through rather than trickling one block each time it refills.

The remote here is a ``MemoryTier`` that records, for each store, how many of its stores were
in flight when it began: a group arrives as 1, 2, 3, 4. The rate limit runs on a clock the
test moves; a store to the manager is what makes the deferred writes come due.
"""

from __future__ import annotations

from collections import defaultdict

import anyio
import numpy as np
import pytest

from kvtier import (
    AdmissionPolicy,
    HostPool,
    LookupResult,
    MemoryTier,
    TieringManager,
    TierUnavailableError,
)
from tests.support import ManualClock, assert_holds, random_blocks

BB = 4096
GROUP = 4


class PackingTier(MemoryTier):
    """A tier that would rather get ``GROUP`` stores at once. ``started_with[key]``: how
    many stores were in flight when the store of ``key`` began (itself included);
    ``stored[key]`` is set once it ended. Stores of the keys in ``held`` wait for
    ``release`` (``holding`` is set once one waits)."""

    write_batch = GROUP

    def __init__(self) -> None:
        super().__init__("remote")
        self.in_flight = 0
        self.started_with: dict[bytes, int] = {}
        self.stored: defaultdict[bytes, anyio.Event] = defaultdict(anyio.Event)
        self.held: set[bytes] = set()
        self.holding = anyio.Event()
        self.release = anyio.Event()

    def starts(self, keys: list[bytes]) -> list[int]:
        """``started_with`` of those of ``keys`` whose store began, in order."""
        return [self.started_with[k] for k in keys if k in self.started_with]

    async def store(self, key: bytes, src: memoryview) -> None:
        self.in_flight += 1
        self.started_with[key] = self.in_flight
        try:
            if key in self.held:
                self.holding.set()
                await self.release.wait()
            await super().store(key, src)  # waits one checkpoint: the others of a group start
        finally:
            self.in_flight -= 1
            self.stored[key].set()


class SourceTier(MemoryTier):
    """The faster tier. It answers RETRY for a block it is still writing (as the FS tier
    does; the manager notifies it once written). A load of a key in ``gates`` waits for its
    event (``waiting`` is set once one does); ``loaded[key]`` is set when a load of ``key``
    returns; a load of a key in ``failing`` raises."""

    def __init__(self) -> None:
        super().__init__("fast")
        self.gates: dict[bytes, anyio.Event] = {}
        self.waiting = anyio.Event()
        self.loaded: defaultdict[bytes, anyio.Event] = defaultdict(anyio.Event)
        self.failing: set[bytes] = set()
        self.storing: set[bytes] = set()

    def lookup(self, key: bytes) -> LookupResult:
        if key in self.storing:
            return LookupResult.RETRY
        return super().lookup(key)

    async def store(self, key: bytes, src: memoryview) -> None:
        self.storing.add(key)
        try:
            await super().store(key, src)
        finally:
            self.storing.discard(key)

    async def load(self, key: bytes, dst: memoryview) -> None:
        gate = self.gates.get(key)
        if gate is not None:
            self.waiting.set()
            await gate.wait()
        if key in self.failing:
            raise TierUnavailableError("injected failure", tier=self.name, operation="load")
        await super().load(key, dst)
        self.loaded[key].set()


@pytest.fixture
def fast() -> SourceTier:
    return SourceTier()


@pytest.fixture
def remote() -> PackingTier:
    return PackingTier()


def paced(
    fast: MemoryTier,
    remote: MemoryTier,
    clock: ManualClock,
    *,
    rate: int = GROUP + 1,
    close_timeout: float = 5.0,
) -> TieringManager:
    """A manager writing through to ``fast`` and to ``remote``, which takes ``rate`` blocks
    a second (by default a group and one more: a second later the group goes, and the store
    that made it due is written at once); what it refuses is deferred."""
    admission = AdmissionPolicy(
        max_write_rate={"remote": rate * BB},
        max_write_latency=None,
        deferred=["remote"],
        clock=clock,
    )
    return TieringManager(
        HostPool(16, BB), [fast, remote], admission=admission, close_timeout=close_timeout
    )


async def defer_a_group(
    manager: TieringManager, keys: list[bytes], data: np.ndarray, *, rate: int = GROUP + 1
) -> list[bytes]:
    """Store as many blocks as the rate lets through, then a group more: those are
    deferred. Returns the deferred keys."""
    n = rate + GROUP
    await manager.store(keys[:n], data[:n])
    await manager.wait_idle()
    stats = manager.statistics()
    assert stats.writes.deferred == GROUP and stats.writes.deferred_pending == GROUP
    return keys[rate:n]


async def test_a_group_is_loaded_whole_then_stored_all_at_once(
    keys: list[bytes], clock: ManualClock, fast: SourceTier, remote: PackingTier
) -> None:
    """No store of a group reaches the tier while a block of the group is still being
    loaded; then all of them start together."""
    data = random_blocks(10)
    async with paced(fast, remote, clock) as manager:
        group = await defer_a_group(manager, keys, data)
        fast.gates[group[-1]] = gate = anyio.Event()
        clock.now += 1.0  # a group's worth again, and one more block
        await manager.store(keys[9:10], data[9:10])  # the deferred writes come due
        await remote.stored[keys[9]].wait()  # the store that made them due: written at once
        await fast.waiting.wait()
        for key in group[:-1]:
            await fast.loaded[key].wait()
        assert remote.starts(group) == []  # three blocks loaded, and not one stored yet
        gate.set()
        await manager.wait_idle()
        stats = manager.statistics()
        assert remote.starts(group) == [1, 2, 3, 4]
        assert stats.writes.deferred_written == GROUP and stats.writes.deferred_pending == 0
    await assert_holds(remote, keys[:10], data)


async def test_a_rate_limit_lets_whole_groups_through_not_single_blocks(
    keys: list[bytes],
    clock: ManualClock,
    fast: SourceTier,
    remote: PackingTier,
) -> None:
    data = random_blocks(11)
    async with paced(fast, remote, clock, rate=GROUP) as manager:
        group = await defer_a_group(manager, keys, data, rate=GROUP)
        clock.now += 0.25  # one block's worth: not a group
        await manager.store(keys[8:9], data[8:9])  # joins the queue behind the group
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred_written == 0 and remote.starts(keys[4:9]) == []
        assert stats.writes.deferred == 5 and stats.writes.deferred_pending == 5
        clock.now += 0.75  # a group's worth
        await manager.store(keys[9:10], data[9:10])
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred_written == GROUP and remote.starts(group) == [1, 2, 3, 4]
        assert stats.writes.deferred_pending == 2  # keys 8 and 9
        clock.now += 0.5  # two blocks' worth, and two wait: fewer than a group, they go
        await manager.store(keys[10:11], data[10:11])
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred_written == GROUP + 2 and remote.starts(keys[8:10]) == [1, 2]
    stats = manager.statistics()
    assert (
        stats.writes.deferred_written == stats.writes.deferred and stats.writes.deferred_lost == 0
    )
    await assert_holds(remote, keys[:11], data)


async def test_a_block_no_faster_tier_gives_is_lost_and_the_rest_of_its_group_written(
    keys: list[bytes],
    clock: ManualClock,
    fast: SourceTier,
    remote: PackingTier,
) -> None:
    data = random_blocks(10)
    async with paced(fast, remote, clock) as manager:
        group = await defer_a_group(manager, keys, data)
        await fast.delete(group[1])  # evicted from the faster tier before its turn came
        fast.failing.add(group[2])  # and this one cannot be read from it
        clock.now += 1.0
        await manager.store(keys[9:10], data[9:10])
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.writes.deferred_lost == 2
    assert stats.writes.deferred_written == GROUP - 2 and stats.writes.deferred_pending == 0
    assert stats.writes.failures_by_reason == {"unavailable": 1}
    assert all(a.in_flight_bytes == 0 for a in stats.admission)
    assert remote.lookup(group[1]) is LookupResult.MISS
    assert remote.lookup(group[2]) is LookupResult.MISS
    await assert_holds(remote, [group[0], group[3]], data[[5, 8]])


async def test_closing_mid_group_accounts_for_every_key(
    keys: list[bytes], clock: ManualClock, fast: SourceTier, remote: PackingTier
) -> None:
    data = random_blocks(10)
    async with paced(fast, remote, clock, close_timeout=0.1) as manager:
        group = await defer_a_group(manager, keys, data)
        remote.held = set(group[1:])  # three stores of the group never end
        clock.now += 1.0
        await manager.store(keys[9:10], data[9:10])
        await remote.holding.wait()
    stats = manager.statistics()
    assert (
        stats.writes.deferred_written == 1 and stats.writes.deferred_lost == 3
    )  # cancelled at close
    assert stats.writes.deferred_written + stats.writes.deferred_lost == stats.writes.deferred
    assert stats.writes.deferred_pending == 0
    assert stats.writes.cancelled == 3
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0
    assert all(a.in_flight_bytes == 0 for a in stats.admission)
    assert stats.background.tasks == 0
    await assert_holds(remote, group[:1], data[5:6])


async def test_a_group_is_cut_to_what_the_tier_in_flight_limit_holds(
    keys: list[bytes], fast: SourceTier, remote: PackingTier
) -> None:
    """A tier whose in-flight limit holds two blocks gets its deferred writes two at a
    time: a group of four would never be admitted whole."""
    remote.held = set(keys[:2])
    admission = AdmissionPolicy(
        max_in_flight_bytes={"remote": 2 * BB}, max_write_latency=None, deferred=["remote"]
    )
    data = random_blocks(8)
    async with TieringManager(HostPool(16, BB), [fast, remote], admission=admission) as manager:
        await manager.store(keys[:8], data)
        await remote.holding.wait()  # the first two fill the remote's room: six are deferred
        assert manager.statistics().writes.deferred_pending == 6
        remote.release.set()
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred_written == 6 and remote.starts(keys[2:8]) == [1, 2] * 3
    await assert_holds(remote, keys[:8], data)
