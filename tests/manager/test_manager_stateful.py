"""A hypothesis state machine that drives a TieringManager through random stores, lookups,
scheduler lookups, loads, cancellations, tier failures and recoveries, stalls, and manager
exits and re-entries; after every step nothing has leaked and every hit has the right bytes.

The cost and admission policies are driven too: the recompute cost comes and goes, tier
latencies are injected (so promotions are declined and waits cut), write latencies close and
reopen a tier's admission, and the file tier is written back (its blocks wait in the pool,
pinned, until they must leave it).

A third, "remote" tier is ``deferred`` and paced by ``max_write_rate`` (on a clock the machine
moves forward): writes it drops wait in a queue and are copied to it later from the memory
tier; it fails and recovers too. Promotions from the lower tiers are written up to the memory
tier (``promote_write_up``). Once settled, every deferred write is written, lost (counted) or
still queued, and every block any tier holds reads back with the bytes that were stored.

The manager lives in an event loop thread behind an anyio blocking portal, so the state
machine itself stays synchronous; the portal keeps ``async with`` in one task.

Examples: ``KVTIER_STATEFUL_EXAMPLES`` (default 25 in CI; the nox ``stress`` session raises it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path

import anyio
import anyio.from_thread
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier import (
    AdmissionPolicy,
    BlockNotFoundError,
    FSTier,
    HostPool,
    LookupResult,
    MemoryTier,
    OffloadScheduler,
    SecondaryTier,
    TieringManager,
    block_keys,
)
from kvtier.testing import FailingTier, StallingTier

BB = 512
KEYS = block_keys(list(range(24)), 1, namespace=b"stateful")
EXAMPLES = int(os.environ.get("KVTIER_STATEFUL_EXAMPLES", "25"))


def payload(key: bytes) -> np.ndarray:
    """The one right content of ``key``: derived from it, so any mix-up shows."""
    digest = hashlib.blake2b(key, digest_size=64).digest()
    return np.frombuffer(digest * (BB // 64), np.uint8)


key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)


class ManagerMachine(RuleBasedStateMachine):
    REMOTE_WRITE_BATCH = 1  # the remote's write_batch: > 1, its deferred writes go in groups

    def __init__(self) -> None:
        super().__init__()
        self.portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self.portal = self.portal_cm.__enter__()
        self.folder = Path(tempfile.mkdtemp(prefix="kvtier-stateful-"))
        self.stalling = StallingTier(MemoryTier("stall.inner"), name="stalling", lookup_timeout=0.5)
        self.failing = FailingTier(FSTier(self.folder, fsync="never"), name="failing")
        self.remote = FailingTier(MemoryTier("remote.inner"), name="remote")
        self.remote.write_batch = self.REMOTE_WRITE_BATCH
        self.clock_offset = 0.0  # the admission clock runs ahead of real time by this much
        self.manager = TieringManager(
            HostPool(8, BB, policy="arc"),
            [self.stalling, self.failing, self.remote],
            promotion_timeout=0.5,
            store_timeout=2.0,
            close_timeout=0.2,
            max_in_flight_bytes=6 * BB,
            admission=AdmissionPolicy(
                max_in_flight_bytes=3 * BB,
                write_back=["failing"],
                deferred=["remote"],
                max_write_rate={"remote": 2 * BB},  # two blocks a second: most writes wait
                probe_interval=0.05,
                clock=lambda: time.monotonic() + self.clock_offset,
            ),
            write_back_limit=2,
            promote_write_up=True,
        )
        self.scheduler = OffloadScheduler(self.manager, max_wait=3.0)
        self.entered: AbstractContextManager[TieringManager] | None = None
        self.enter()

    # -- helpers -------------------------------------------------------------------------------

    def enter(self) -> None:
        self.entered = self.portal.wrap_async_context_manager(self.manager)
        self.entered.__enter__()

    def check_loaded(self, keys: list[bytes], out: np.ndarray, n: int) -> None:
        for i in range(n):
            assert (out[i] == payload(keys[i])).all(), "a hit loaded the wrong bytes"

    def stalled(self) -> bool:
        return any(self.stalling.stalled.values()) or bool(self.stalling.stalled_operations)

    def check_deferred_accounting(self, *, settled: bool) -> None:
        """Every write queued for the deferred tier is written, lost (counted) or queued;
        once settled, none is in flight, so the three add up exactly."""
        stats = self.manager.statistics()
        ended = (
            stats.writes.deferred_written
            + stats.writes.deferred_lost
            + stats.writes.deferred_pending
        )
        if settled:
            assert ended == stats.writes.deferred, stats
        else:
            assert ended <= stats.writes.deferred, stats

    def tier_contents(self, tier: SecondaryTier) -> dict[bytes, bytes]:
        """What ``tier`` holds, read back block by block (a missing block is skipped)."""

        async def read() -> dict[bytes, bytes]:
            out: dict[bytes, bytes] = {}
            for key in KEYS:
                buffer = bytearray(BB)
                try:
                    await tier.load(key, memoryview(buffer))
                except BlockNotFoundError:
                    continue
                out[key] = bytes(buffer)
            return out

        return self.portal.call(read)

    # -- rules ---------------------------------------------------------------------------------

    @rule(keys=key_lists)
    def store(self, keys: list[bytes]) -> None:
        blocks = np.stack([payload(k) for k in keys])
        stored = self.portal.call(self.manager.store, keys, blocks)
        assert 0 <= stored <= len(keys)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: bytes) -> None:
        result = self.portal.call(self.manager.lookup, key)
        assert isinstance(result, LookupResult)

    @rule(keys=key_lists, window=st.none() | st.integers(1, 3))
    def scheduler_lookup_then_load(self, keys: list[bytes], window: int | None) -> None:
        async def run() -> tuple[int, int, np.ndarray]:
            n = await self.scheduler.lookup(keys, sliding_window_size=window, timeout=1.0)
            out = np.zeros((len(keys), BB), np.uint8)
            loaded = await self.manager.load(keys, out)
            return n, loaded, out

        n, loaded, out = self.portal.call(run)
        assert 0 <= n <= len(keys)
        self.check_loaded(keys, out, loaded)

    @rule(keys=key_lists, checkpoints=st.integers(0, 4), what=st.sampled_from(["store", "load"]))
    def cancelled_operation(self, keys: list[bytes], checkpoints: int, what: str) -> None:
        blocks = np.stack([payload(k) for k in keys])

        async def run() -> None:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    if what == "store":
                        tg.start_soon(self.manager.store, keys, blocks)
                    else:
                        tg.start_soon(self.manager.load, keys, np.zeros_like(blocks))
                    for _ in range(checkpoints):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

        self.portal.call(run)

    @rule(
        ops=st.sets(st.sampled_from(["contains", "load", "store"]), min_size=1),
        which=st.sampled_from(["failing", "remote"]),
    )
    def tier_fails(self, ops: set[str], which: str) -> None:
        (self.failing if which == "failing" else self.remote).fail(*ops)

    @rule(which=st.sampled_from(["failing", "remote"]))
    def tier_recovers(self, which: str) -> None:
        (self.failing if which == "failing" else self.remote).recover()

    @rule(seconds=st.sampled_from([0.5, 1.0, 5.0]))
    def time_passes(self, seconds: float) -> None:
        """The remote tier's write budget refills (and writes in flight look older)."""
        self.clock_offset += seconds

    @rule(start=st.integers(0, len(KEYS) - 1))
    def promotion_is_written_up(self, start: int) -> None:
        """A block only a lower tier holds is promoted; it waits in the pool and is written
        to the memory tier above it when evicted, unless admission dropped or skipped that
        write (counted)."""
        ready = self.manager.pool.table.ready
        key = next((k for k in KEYS[start:] + KEYS[:start] if k not in ready), None)
        if self.stalled() or key is None:
            return

        async def run() -> int:
            await self.stalling.delete(key)  # the top tier loses it (forgets its verdict too)
            await self.remote.inner.store(key, payload(key).data)
            self.remote.record_hit(key)
            n = await self.scheduler.lookup([key], timeout=1.0)
            with anyio.fail_after(10):
                await self.manager.wait_idle()
            return n

        before = self.manager.statistics()
        promoted = self.portal.call(run)
        after = self.manager.statistics()
        if not promoted or after.promotions.succeeded == before.promotions.succeeded:
            return  # declined as too slow, failed (an injected fault), or still pending
        if key in self.manager._promotions.up_when_evicted:  # in the pool: copied when evicted
            assert key in self.manager.pool.table.ready
        elif after.promotions.written_up > before.promotions.written_up:
            # Evicted at once (by a later promotion in the same scan) and written up.
            held = self.tier_contents(self.stalling.inner)
            assert held.get(key) == payload(key).tobytes(), "a written-up block is missing"
        else:
            dropped = after.writes.dropped > before.writes.dropped
            skipped = after.writes.skipped > before.writes.skipped
            assert dropped or skipped, "a promoted block was neither written up nor dropped"

    @rule(ops=st.sets(st.sampled_from(["contains", "load", "store"]), min_size=1))
    def tier_stalls(self, ops: set[str]) -> None:
        self.portal.call(lambda: self.stalling.stall(*ops))

    @rule()
    def tier_unstalls(self) -> None:
        self.portal.call(self.stalling.release)

    @rule(per_block=st.none() | st.floats(0.0, 0.01))
    def recompute_cost(self, per_block: float | None) -> None:
        self.manager.cost.set_recompute_cost(per_block)

    @rule(tier=st.sampled_from(["stalling", "failing", "remote"]), seconds=st.floats(0.0, 5.0))
    def promotion_latency_observed(self, tier: str, seconds: float) -> None:
        self.manager.cost.observe_promotion(tier, seconds, BB, ok=True)

    @rule(tier=st.sampled_from(["stalling", "failing", "remote"]), seconds=st.floats(0.0, 2.0))
    def write_latency_observed(self, tier: str, seconds: float) -> None:
        self.manager.admission.observe_write_latency(tier, seconds)

    @rule()
    def exit_and_reenter(self) -> None:
        assert self.entered is not None
        self.entered.__exit__(None, None, None)
        stats = self.manager.statistics()
        assert stats.background.tasks == 0
        assert stats.pool.writing == 0 and stats.pool.pinned == 0
        assert stats.writes.dirty_blocks == 0  # written back at close
        assert stats.writes.deferred_pending == 0  # written within close_timeout, or counted lost
        self.check_deferred_accounting(settled=True)
        self.enter()

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def nothing_leaked(self) -> None:
        self.manager.pool.table.check_invariants()
        stats = self.manager.statistics()
        assert (
            stats.writes.in_flight_bytes <= 6 * BB + 3 * BB
        )  # write-back: its tier's own cap only
        pool = stats.pool
        assert pool.reservations == pool.commits + pool.aborts + pool.writing
        assert stats.writes.dirty_blocks <= pool.pinned  # a block waiting for write-back is held
        # A promoted block waiting to be copied up when evicted is still in the pool.
        waiting = self.manager._promotions.up_when_evicted
        assert stats.promotions.write_ups_waiting == len(waiting) <= pool.num_blocks
        assert all(key in self.manager.pool.table.ready for key in waiting)
        for a in stats.admission:
            assert 0 <= a.in_flight_bytes <= 3 * BB or a.write_back
        self.check_deferred_accounting(settled=False)

    @invariant()
    def settles_when_nothing_stalls(self) -> None:
        """With no stall, background work finishes and leaves nothing pinned or WRITING."""
        if self.stalled():
            return

        async def settle() -> None:
            with anyio.fail_after(10):
                await self.manager.wait_idle()

        self.portal.call(settle)
        stats = self.manager.statistics()
        pool = stats.pool
        # only blocks waiting for write-back stay pinned, one pin each
        assert pool.writing == 0 and pool.pinned == stats.writes.dirty_blocks == pool.pins
        leftovers = list(self.folder.rglob(".tmp-*"))
        assert not leftovers, f"temporary files left: {leftovers}"
        self.check_deferred_accounting(settled=True)
        # Every tier holds only the right bytes (read past the fault injection).
        for tier in (self.stalling.inner, self.failing.inner, self.remote.inner):
            for key, data in self.tier_contents(tier).items():
                assert data == payload(key).tobytes(), f"{tier.name} holds wrong bytes"

    def teardown(self) -> None:
        try:
            self.failing.recover()
            self.remote.recover()
            self.portal.call(self.stalling.release)
            if self.entered is not None:
                # nothing stays RETRY or HIT_PENDING past its deadline: every key settles
                async def every_key_settles() -> None:
                    for key in KEYS:
                        await self.scheduler.lookup([key], timeout=3.0)

                timeouts = self.scheduler.statistics().timeouts
                self.portal.call(every_key_settles)
                assert self.scheduler.statistics().timeouts == timeouts, "a key never settled"
                self.entered.__exit__(None, None, None)
                stats = self.manager.statistics()
                assert stats.background.tasks == 0 and stats.pool.pinned == 0
                assert stats.writes.deferred_pending == 0
                self.check_deferred_accounting(settled=True)
        finally:
            self.portal_cm.__exit__(None, None, None)
            shutil.rmtree(self.folder, ignore_errors=True)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None)


class PackingRemoteMachine(ManagerMachine):
    """The same, with a remote that packs what it is given together (the S3 tier): its
    deferred writes go in groups of up to three (cut to its in-flight limit), each
    admitted whole."""

    REMOTE_WRITE_BATCH = 4


TestPackingRemoteMachine = PackingRemoteMachine.TestCase
TestPackingRemoteMachine.settings = TestManagerMachine.settings
