"""Deferred writes: a write that back-pressure drops for a ``deferred`` tier is queued (key
only) and copied later from a faster tier that holds the block, so a shared remote tier gets
every block at the pace it can take, without pinning the pool."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from kvtier import (
    AdmissionPolicy,
    HostPool,
    InvalidArgumentError,
    LookupResult,
    MemoryTier,
    SecondaryTier,
    TieringManager,
)
from kvtier.testing import StallingTier
from kvtier.tiers._base import BatchResults
from kvtier.tiers.fs import FSTier
from kvtier.writes._deferred import DeferredWrites
from tests.support import assert_holds, random_blocks

BB = 4096


def stalled_remote() -> StallingTier:
    """The slower tier, its stores held until the test releases them."""
    remote = StallingTier(MemoryTier("remote-inner"), name="remote")
    remote.stall("store")
    return remote


def over(
    fast: SecondaryTier,
    remote: SecondaryTier,
    *,
    deferred: bool = True,
    close_timeout: float = 5.0,
) -> TieringManager:
    """A manager writing through to ``fast`` and ``remote``, the remote's room one block."""
    return TieringManager(
        HostPool(8, BB),
        [fast, remote],
        admission=policy(deferred=deferred),
        close_timeout=close_timeout,
    )


def policy(*, deferred: bool) -> AdmissionPolicy:
    return AdmissionPolicy(
        max_in_flight_bytes={"remote": BB},
        max_write_latency=None,
        deferred=["remote"] if deferred else [],
    )


async def test_dropped_writes_reach_the_deferred_tier_once_it_has_room(
    keys: list[bytes],
) -> None:
    fast = MemoryTier("fast")
    remote = stalled_remote()
    data = random_blocks(4)
    async with over(fast, remote) as manager:
        await manager.store(keys[:4], data)
        await remote.wait_stalled("store")
        stats = manager.statistics()
        assert stats.writes.dropped == 3  # not written at store time ...
        assert stats.writes.deferred == 3 and stats.writes.deferred_pending == 3  # ... but kept
        remote.release("store")
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.writes.deferred_written == 3 and stats.writes.deferred_pending == 0
    assert stats.writes.deferred_lost == 0
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0
    await assert_holds(remote.inner, keys[:4], data)


async def test_without_deferred_the_dropped_writes_are_lost(keys: list[bytes]) -> None:
    fast = MemoryTier("fast")
    remote = stalled_remote()
    async with over(fast, remote, deferred=False) as manager:
        await manager.store(keys[:4], random_blocks(4))
        await remote.wait_stalled("store")
        remote.release("store")
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.writes.deferred == 0 and stats.writes.deferred_written == 0
    assert sum(remote.inner.lookup(k) is LookupResult.HIT for k in keys[:4]) == 1


async def test_a_deferred_write_whose_block_left_the_faster_tiers_is_given_up(
    keys: list[bytes],
) -> None:
    fast = MemoryTier("fast")
    remote = stalled_remote()
    async with over(fast, remote) as manager:
        await manager.store(keys[:2], random_blocks(2))
        await remote.wait_stalled("store")
        await fast.delete(keys[1])  # evicted from the fast tier before its turn came
        remote.release("store")
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.writes.deferred == 1 and stats.writes.deferred_lost == 1
    assert stats.writes.deferred_written == 0
    assert stats.admission[1].in_flight_bytes == 0
    assert remote.inner.lookup(keys[1]) is LookupResult.MISS


async def test_closing_gives_up_the_deferred_writes_and_leaves_nothing_behind(
    keys: list[bytes],
) -> None:
    fast = MemoryTier("fast")
    remote = stalled_remote()
    async with over(fast, remote, close_timeout=0.1) as manager:
        await manager.store(keys[:3], random_blocks(3))
        await remote.wait_stalled("store")
    stats = manager.statistics()
    assert stats.writes.deferred == 2 and stats.writes.deferred_lost == 2
    assert stats.writes.deferred_pending == 0
    assert stats.pool.pinned == 0 and stats.writes.in_flight_bytes == 0
    assert stats.background.tasks == 0


def test_the_queue_is_bounded() -> None:
    queue = DeferredWrites(["remote"], limit=2)
    for key in (b"a", b"b", b"b", b"c"):
        queue.add("remote", key)
    assert len(queue) == 2 and queue.deferred == 3 and queue.lost == 1
    admission = AdmissionPolicy(max_in_flight_bytes=3, max_write_latency=None)
    assert queue.due(admission, 1, room=10) == [("remote", b"b"), ("remote", b"c")]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deferred": "s3"}, "deferred"),
        ({"deferred": ["s3"], "write_back": ["s3"]}, "both"),
    ],
)
def test_deferred_is_validated(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        AdmissionPolicy(**kwargs)  # type: ignore[arg-type]


async def test_closing_writes_what_waits_even_to_a_tier_closed_by_latency(
    keys: list[bytes],
) -> None:
    """A node leaving the cluster (a session moving to another node) hands its deferred
    blocks to the shared tier within ``close_timeout``, even though the tier's latency had
    closed it to new writes."""
    now = [0.0]
    fast = MemoryTier("fast")
    remote = StallingTier(MemoryTier("remote-inner"), name="remote")
    admission = AdmissionPolicy(
        max_in_flight_bytes={"remote": BB},
        max_write_latency=0.1,
        deferred=["remote"],
        clock=lambda: now[0],
    )
    admission.observe_write_latency("remote", 5.0)  # closed: its writes average 5 s
    async with TieringManager(
        HostPool(8, BB), [fast, remote], admission=admission, close_timeout=30
    ) as manager:
        await manager.store(keys[:3], random_blocks(3))
        await manager.wait_idle()
        stats = manager.statistics()
        # one probe write went through; the others wait, and no probe is due yet
        assert stats.writes.deferred == 2 and stats.writes.deferred_pending == 2
    stats = manager.statistics()
    assert stats.writes.deferred_written == 2 and stats.writes.deferred_lost == 0
    assert all(remote.inner.lookup(k) is LookupResult.HIT for k in keys[:3])


def test_a_rate_limit_drops_past_its_budget_and_refills_with_time() -> None:
    now = [0.0]
    policy = AdmissionPolicy(
        max_write_rate={"remote": 3 * BB}, max_write_latency=None, clock=lambda: now[0]
    )
    assert [policy.admit("remote", BB) for _ in range(4)] == [True, True, True, False]
    assert policy.admit("fast", BB)  # other tiers are not limited
    for _ in range(3):
        policy.finished("remote", BB, 0.01)
    assert not policy.has_room("remote", BB)
    now[0] += 1 / 3  # a third of a second: one block's worth
    assert policy.has_room("remote", BB) and policy.admit("remote", BB)
    assert not policy.admit("remote", BB)
    (remote,) = [s for s in policy.statistics() if s.name == "remote"]
    assert remote.dropped_by_cause == {"rate": 2}
    assert policy.has_room("remote", BB, ignore_latency=True)  # closing ignores the rate


async def test_rate_limited_writes_are_deferred_and_written_at_close(keys: list[bytes]) -> None:
    now = [0.0]
    fast, remote = MemoryTier("fast"), MemoryTier("remote")
    admission = AdmissionPolicy(
        max_write_rate={"remote": BB},
        max_write_latency=None,
        deferred=["remote"],
        clock=lambda: now[0],
    )
    async with TieringManager(HostPool(8, BB), [fast, remote], admission=admission) as manager:
        await manager.store(keys[:4], random_blocks(4))
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred == 3 and stats.writes.deferred_pending == 3
        now[0] += 1.0  # room for one more block: the next store lets the oldest through
        await manager.store(keys[4:5], random_blocks(1))
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred_written == 1
    stats = manager.statistics()
    assert stats.writes.deferred_written == 4 and stats.writes.deferred_lost == 0
    assert all(remote.lookup(k) is LookupResult.HIT for k in keys[:5])


def test_max_write_rate_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="max_write_rate"):
        AdmissionPolicy(max_write_rate=0)
    with pytest.raises(InvalidArgumentError, match="max_write_rate"):
        AdmissionPolicy(max_write_rate={"s3": -1.0})


class LookupWatch:
    """For a tier's ``lookup`` to pass its answers through ``seen``: ``asked`` is set once it
    is asked about one of ``keys``."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = set(keys)
        self.asked = anyio.Event()

    def seen(self, key: bytes, answer: LookupResult) -> LookupResult:
        if key in self.keys:
            self.asked.set()
        return answer


class AskedTier(StallingTier):
    """A StallingTier whose lookups of ``watched`` keys set ``watch.asked``."""

    def __init__(self, name: str, watched: list[bytes]) -> None:
        super().__init__(name=name)
        self.watch = LookupWatch(watched)

    def lookup(self, key: bytes) -> LookupResult:
        return self.watch.seen(key, super().lookup(key))


async def test_a_deferred_write_waits_for_the_faster_tier_still_writing_the_block(
    keys: list[bytes],
) -> None:
    """The deferred writes come due while the faster tier is still writing their blocks (it
    answers RETRY for them): they wait for its answer and copy the blocks once written,
    instead of giving them up as lost."""
    fast = AskedTier("fast", keys[1:4])
    remote = stalled_remote()
    data = random_blocks(4)
    async with over(fast, remote) as manager:
        await manager.store(keys[:1], data[:1])
        await remote.wait_stalled("store")  # keys[0] holds the remote's in-flight room
        fast.stall("store")
        await manager.store(keys[1:4], data[1:4])  # dropped for the remote: deferred
        await fast.wait_stalled("store")
        assert manager.statistics().writes.deferred == 3
        remote.release("store")  # room again: the deferred writes start ...
        await fast.watch.asked.wait()  # ... and ask the fast tier, which is still writing them
        fast.release("store")
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.writes.deferred_written == 3 and stats.writes.deferred_lost == 0
    await assert_holds(remote.inner, keys[:4], data)


class HeldFSTier(FSTier):
    """An FSTier whose stores can be held in flight (the key taken, its file not written
    yet), and whose lookups of ``watched`` keys set ``watch.asked``. Its batches store key
    by key (``SecondaryTier``'s own ``store_many``), so each block's store can be held."""

    async def _store_batch(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        return await SecondaryTier._store_batch(self, keys, srcs, deadline, pinned)

    def __init__(self, root: Path, *, shared: bool, watched: list[bytes]) -> None:
        super().__init__(root, shared=shared)
        self.watch = LookupWatch(watched)
        self.gate: anyio.Event | None = None
        self.holding = 0
        self._more_held = anyio.Event()

    def lookup(self, key: bytes) -> LookupResult:
        return self.watch.seen(key, super().lookup(key))

    async def _store(self, key: bytes, payload: memoryview) -> None:
        gate = self.gate
        if gate is not None:
            self.holding += 1
            self._more_held.set()
            await gate.wait()
        await super()._store(key, payload)

    async def wait_held(self, n: int) -> None:
        while self.holding < n:
            self._more_held = anyio.Event()
            await self._more_held.wait()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "exclusive"])
async def test_a_deferred_write_waits_for_the_file_tier_still_writing_the_block(
    keys: list[bytes], tmp_path: Path, shared: bool
) -> None:
    """The demo's layout, FS then a deferred slower tier: FS writes queue during a burst, the
    deferred writes come due meanwhile and find the blocks still being written to FS. They
    wait for those writes and copy the blocks, instead of counting them lost."""
    fs = HeldFSTier(tmp_path / "fs", shared=shared, watched=keys[1:4])
    remote = stalled_remote()
    data = random_blocks(4)
    async with over(fs, remote) as manager:
        await manager.store(keys[:1], data[:1])
        await remote.wait_stalled("store")  # keys[0] holds the remote's in-flight room
        fs.gate = gate = anyio.Event()
        await manager.store(keys[1:4], data[1:4])  # dropped for the remote: deferred
        await fs.wait_held(3)
        assert manager.statistics().writes.deferred == 3
        remote.release("store")  # room again: the deferred writes start ...
        await fs.watch.asked.wait()  # ... and ask FS, which is still writing them
        gate.set()
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.writes.deferred_written == 3 and stats.writes.deferred_lost == 0
    await assert_holds(remote.inner, keys[:4], data)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "exclusive"])
async def test_a_burst_stored_just_before_close_reaches_the_deferred_tier(
    keys: list[bytes], tmp_path: Path, shared: bool
) -> None:
    """Closing right after a store hands the deferred writes out at once, before the
    store's own writes to FS have started: they wait for those writes, not miss them."""
    remote = MemoryTier("remote")
    admission = AdmissionPolicy(
        max_write_rate={"remote": BB}, max_write_latency=None, deferred=["remote"]
    )
    data = random_blocks(8)
    async with TieringManager(
        HostPool(8, BB), [FSTier(tmp_path / "fs", shared=shared), remote], admission=admission
    ) as manager:
        await manager.store(keys[:8], data)  # one block's worth of rate: 7 deferred
    stats = manager.statistics()
    assert stats.writes.deferred == 7
    assert stats.writes.deferred_written == 7 and stats.writes.deferred_lost == 0
    await assert_holds(remote, keys[:8], data)


class Landed:
    """An event set once every one of ``keys`` has been written to ``tier`` (told by its
    notifications)."""

    def __init__(self, tier: SecondaryTier, keys: list[bytes]) -> None:
        self.waiting = set(keys)
        self.all = anyio.Event()
        tier.add_listener(self._heard)

    def _heard(self, key: bytes) -> None:
        self.waiting.discard(key)
        if not self.waiting:
            self.all.set()


async def test_deferred_writes_drain_on_their_own_as_the_rate_budget_refills(
    keys: list[bytes],
) -> None:
    """A node whose sessions moved away stores nothing more: its paced writes still reach
    the slower tier as the rate allows, without waiting for another store or for close."""
    fast, remote = MemoryTier("fast"), MemoryTier("remote")
    admission = AdmissionPolicy(
        max_write_rate={"remote": 8 * BB}, max_write_latency=None, deferred=["remote"]
    )
    data = random_blocks(16)
    landed = Landed(remote, keys[:16])
    async with TieringManager(HostPool(16, BB), [fast, remote], admission=admission) as manager:
        await manager.store(keys[:16], data)  # a second's worth goes at once, the rest waits
        assert manager.statistics().writes.deferred > 0
        with anyio.fail_after(10):  # about a second at this pace
            await landed.all.wait()
        await manager.wait_idle()
        stats = manager.statistics()
        assert stats.writes.deferred_pending == 0 and stats.writes.deferred_lost == 0
        assert stats.writes.deferred_written == stats.writes.deferred
    await assert_holds(remote, keys[:16], data)


async def test_closing_with_a_wake_up_pending_writes_what_waits_at_once(
    keys: list[bytes],
) -> None:
    """The wake-up of a slow pace (a block a hundred seconds) does not hold up closing,
    which writes what waits within ``close_timeout`` as before."""
    fast, remote = MemoryTier("fast"), MemoryTier("remote")
    admission = AdmissionPolicy(
        max_write_rate={"remote": BB / 100}, max_write_latency=None, deferred=["remote"]
    )
    data = random_blocks(4)
    with anyio.fail_after(10):
        async with TieringManager(HostPool(8, BB), [fast, remote], admission=admission) as manager:
            await manager.store(keys[:4], data)
            await manager.wait_idle()
            assert manager.statistics().writes.deferred_pending == 3
    stats = manager.statistics()
    assert stats.writes.deferred_written == 3 and stats.writes.deferred_lost == 0
    assert stats.background.tasks == 0
    await assert_holds(remote, keys[:4], data)
