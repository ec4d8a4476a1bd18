"""Promotions: copying a tier's block into the slot ``lookup`` reserved, and copying it up.

Promotions run in batches: the keys one scan (or several in the same loop iteration) promotes
from one tier join one batch, and one background task fills all their slots with one
``load_many`` under one ``promotion_timeout``. A task, its cancel scope and its timer per block
cost more loop time than the block's own bookkeeping, and they live long enough to reach the
collector's oldest generation, which makes full collections frequent. Each block of a batch is
then settled on its own: its slot committed (or freed on failure, remembering the failure so
the key is not promoted again at every lookup), the cost model and the latency observer fed,
the key's watchers woken.

With ``write_up``, a promoted block is also written to the write-through tiers listed before
its source: at once with a GPU pool, or when the pool evicts it with a host
pool (``leaving`` is the pool's hook for that), so a block that stays in the pool is never
copied.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

import anyio
import anyio.abc

from kvtier.common._background import Background, Callbacks
from kvtier.common._logging import BurstLogger
from kvtier.manager._cost import CostModel
from kvtier.manager._decision import TierHits
from kvtier.manager._failures import RecentFailures
from kvtier.manager._statistics import PromotionCounts
from kvtier.manager._watch import Watchers
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier, one_per_key
from kvtier.writes._account import bump, reason_of_failure
from kvtier.writes._writethrough import WriteThrough

__all__ = ["PromotionObserver", "Promotions"]

# Keys of one tier in one batch at most: a larger batch makes its first block wait for more
# of the others, and one stuck read holds more of them.
MAX_BATCH = 64
# How long past ``promotion_timeout`` a batch may take before it is cancelled: the tier's own
# deadline (``load_many``'s ``timeout``) ends it first and says which blocks made it.
_GRACE = 1.0


@dataclass(eq=False, slots=True)
class _Batch:
    """Keys promoted together from one tier: their reserved slots, and how many promotions
    from the tier were in flight when each started (for the cost model)."""

    tier: SecondaryTier
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)


class PromotionObserver(Protocol):
    """Receives each promotion's latency (``kvtier.LatencyHistograms`` is one)."""

    def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None: ...


@dataclass(eq=False, repr=False)
class Promotions:
    """Runs the promotions ``lookup`` starts and the copies up they lead to.

    The manager opens it (``opened``: the task group promotions run in, and the pool's hook
    for evicted blocks) and closes it in steps (``closing``, ``stopped``, ``closed``); its
    statistics come as one group (``counts``).
    """

    pool: PrimaryPool
    _: KW_ONLY
    timeout: float
    cost: CostModel
    failed: RecentFailures
    writer: WriteThrough
    watchers: Watchers
    background: Background
    callbacks: Callbacks
    burst_log: BurstLogger
    latency: PromotionObserver | None
    write_up: bool
    # The manager's task group while it is open (``opened`` to ``stopped``).
    _task_group: anyio.abc.TaskGroup | None = field(default=None, init=False)
    # Set once the manager begins to close: no new copy up starts (a block still in the pool
    # is still in its tier).
    _shutting_down: bool = field(default=False, init=False)
    # key -> when its promotion should land
    landing: dict[bytes, float] = field(default_factory=dict, init=False)
    # Promoted blocks to copy up to the faster tiers when the pool evicts them.
    up_when_evicted: dict[bytes, SecondaryTier] = field(default_factory=dict, init=False)
    succeeded: int = field(default=0, init=False)
    cancelled: int = field(default=0, init=False)
    failures: dict[str, int] = field(default_factory=dict, init=False)
    # The batch per tier that new promotions still join (until its task starts).
    _open: dict[SecondaryTier, _Batch] = field(default_factory=dict, init=False)

    def opened(self, task_group: anyio.abc.TaskGroup) -> None:
        """The manager is open: promotions and copies up run in ``task_group``, and with a
        pool that copies a slot out at once, promoted blocks are copied up as they leave."""
        self._task_group, self._shutting_down = task_group, False
        if self.copies_on_evict():
            self.pool.table.on_leave = self.leaving

    def closing(self) -> None:
        """The manager begins to close: promotions go on (they are only reads), but no
        new copy up starts."""
        self._shutting_down = True

    def stopped(self) -> None:
        """The manager's task group is about to be cancelled: nothing starts in it any
        more, and promoted blocks still in the pool are not copied up (they are still in
        the tier they came from)."""
        self._task_group = None
        self.pool.table.on_leave = None
        self.up_when_evicted.clear()

    def closed(self) -> None:
        """The tiers are closed: no promotion is expected to land any more."""
        self.landing.clear()

    def copies_on_evict(self) -> bool:
        """Whether promoted blocks are copied up when evicted (a pool that can copy a slot
        out at once, such as the host pool) rather than as soon as they land."""
        return self.write_up and type(self.pool).copy_slot is not PrimaryPool.copy_slot

    def start(self, key: bytes, tier: SecondaryTier, slot: int, ready_at: float) -> None:
        """Promote ``key`` from ``tier`` into the reserved ``slot`` in the background, in the
        batch of ``tier`` that is still open (a new one if none is)."""
        task_group = self._task_group
        assert task_group is not None, "lookup promotes only while the manager is open"
        batch = self._open.get(tier)
        if batch is None or len(batch.keys) >= MAX_BATCH:
            batch = _Batch(tier)
            undo = functools.partial(self._never_ran, batch)
            try:
                self.background.start_soon(task_group, undo, self._promote, batch)
            except BaseException:
                self.pool.abort(slot)  # no batch to join: give back the slot lookup reserved
                self.cancelled += 1
                raise
            self._open[tier] = batch
        self.landing[key] = ready_at
        # Counted in flight from now, so the next key of this scan expects its promotion
        # behind this one.
        batch.queued.append(self.cost.promotion_started(tier.name))
        batch.keys.append(key)
        batch.slots.append(slot)

    async def _promote(self, batch: _Batch) -> None:
        if self._open.get(batch.tier) is batch:
            del self._open[batch.tier]  # started: later promotions open the next batch
        tier, started = batch.tier, time.perf_counter()
        lender = self.pool.lender(batch.slots)  # the tier may read straight into them

        async def load(dsts: Sequence[memoryview]) -> Sequence[Exception | None]:
            results = await tier.load_many(batch.keys, dsts, timeout=self.timeout, lender=lender)
            return one_per_key(results, batch.keys, tier.name, "load_many")

        outcomes: Sequence[BaseException | None] = ()
        try:
            with anyio.fail_after(self.timeout + _GRACE):
                outcomes = await self.pool.fill_many(batch.slots, load)
        except BaseException as exc:
            outcomes = [exc] * len(batch.keys)
            if not isinstance(exc, Exception):
                raise  # cancelled: settled below, then the cancellation goes on
        finally:
            self._settle(batch, outcomes, time.perf_counter() - started)

    def _settle(
        self, batch: _Batch, outcomes: Sequence[BaseException | None], seconds: float
    ) -> None:
        """Commit each block that landed, free the others; feed the cost model and wake each
        key's watchers."""
        tier, block_bytes = batch.tier, self.pool.block_bytes
        for key, slot, queued, outcome in zip(
            batch.keys, batch.slots, batch.queued, outcomes, strict=True
        ):
            ok = outcome is None
            failed = isinstance(outcome, Exception)
            if ok:
                self._landed(key, tier, slot)
                self._pin_for_waiters(key)
            else:
                if isinstance(outcome, Exception):
                    self._failed_with(key, tier, outcome)
                self.pool.abort(slot)
                self.cancelled += not failed
            self.cost.promotion_finished(tier.name)
            if ok or failed:  # a cancelled promotion says nothing about the tier
                self.cost.observe_promotion(tier.name, seconds, block_bytes, ok, queued=queued)
            if self.latency is not None:
                self.callbacks(
                    "latency observer", self.latency.observe_promotion, tier.name, seconds, ok
                )
            self.landing.pop(key, None)
            self.watchers.notify(key)

    def _pin_for_waiters(self, key: bytes) -> None:
        """Pin the landed block into the lease of each lookup waiting on it, as that lookup
        would once it runs again. Until then the block is evictable like any other, and in
        a pool that turns over faster than a busy loop resumes its waiters, the block was
        promoted again and again, each time evicted before the lookup it was for could count
        it."""
        for lease in self.watchers.leases(key):
            slot = self.pool.pin(key)
            if slot is not None:
                lease.append(slot)

    def _failed_with(self, key: bytes, tier: SecondaryTier, exc: Exception) -> None:
        reason = reason_of_failure(exc)
        bump(self.failures, reason)
        self.failed.remember(tier, key, reason)
        self.callbacks("record_miss", tier.record_miss, key, reason)
        self.burst_log.warning(
            "promote:" + reason.value,
            "promotion from %s failed (%s): %r",
            tier.name,
            reason.value,
            exc,
        )

    def _landed(self, key: bytes, tier: SecondaryTier, slot: int) -> None:
        self.pool.commit(slot)
        self.succeeded += 1
        task_group = self._task_group
        if self.write_up and task_group is not None and not self._shutting_down:
            if self.pool.table.on_leave is None:
                self.writer.write_up(task_group, key, tier)
            elif self.writer.writes_up(tier):
                self.up_when_evicted[key] = tier  # copied up when evicted

    def leaving(self, key: bytes, slot: int, evicted: bool) -> None:
        """``key`` leaves the pool. Evicted (the pool is about to reuse ``slot``), a promoted
        block not yet copied to the faster tiers is copied now (its bytes taken at once, a
        memcpy inside the ``lookup`` or ``store`` that evicts it; written in the background).
        Discarded (its bytes may be bad), it is only forgotten."""
        tier = self.up_when_evicted.pop(key, None)
        task_group = self._task_group
        if tier is None or not evicted or task_group is None or self._shutting_down:
            return
        copy = functools.partial(self.pool.copy_slot, slot)
        self.writer.write_up(task_group, key, tier, copy=copy)

    def _never_ran(self, batch: _Batch) -> None:
        """Give back the slots ``lookup`` reserved for a batch cancelled unstarted."""
        if self._open.get(batch.tier) is batch:
            del self._open[batch.tier]
        for key, slot in zip(batch.keys, batch.slots, strict=True):
            self.cost.promotion_finished(batch.tier.name)
            self.pool.abort(slot)
            self.cancelled += 1
            self.landing.pop(key, None)
            self.watchers.notify(key)

    def counts(self, hits: TierHits) -> PromotionCounts:
        """The ``promotions`` group of the manager's statistics: these counters, with what
        the lookup decision did with the tier hits it saw (``hits``)."""
        return PromotionCounts(
            started=hits.started,
            succeeded=self.succeeded,
            failed=sum(self.failures.values()),
            failed_by_reason=dict(self.failures),
            cancelled=self.cancelled,
            deferred=hits.deferred,
            declined=hits.declined,
            written_up=self.writer.written_up,
            write_ups_waiting=len(self.up_when_evicted),
        )
