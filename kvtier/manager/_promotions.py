"""Promotions: copying a tier's block into the slot ``lookup`` reserved, and copying it up.

Each promotion is a background task under ``promotion_timeout``: it fills the slot from the
tier, commits it (or frees it on failure, remembering the failure so the key is not promoted
again at every lookup), feeds the cost model and the latency observer, and wakes the key's
watchers. With ``write_up``, a promoted block is also written to the write-through tiers
listed before its source: at once with a GPU pool, or when the pool evicts it with a host
pool (``leaving`` is the pool's hook for that), so a block that stays in the pool is never
copied.
"""

from __future__ import annotations

import functools
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

import anyio
import anyio.abc

from kvtier._background import Background, Callbacks
from kvtier._cost import CostModel
from kvtier._failures import RecentFailures
from kvtier._logging import BurstLogger
from kvtier._watch import Watchers
from kvtier.manager._statistics import PromotionCounts
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier
from kvtier.writes._account import bump, reason_of
from kvtier.writes._writethrough import WriteThrough

__all__ = ["PromotionObserver", "Promotions"]


class PromotionObserver(Protocol):
    """Receives each promotion's latency (``kvtier.LatencyHistograms`` is one)."""

    def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None: ...


@dataclass(eq=False, repr=False)
class Promotions:
    """Runs the promotions ``lookup`` starts and the copies up they lead to.

    ``task_group`` is the manager's while it is open; ``closing`` is set once it begins to
    close (no new copy up starts then: a block still in the pool is still in its tier).
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
    task_group: anyio.abc.TaskGroup | None = field(default=None, init=False)
    closing: bool = field(default=False, init=False)
    # key -> when its promotion should land
    landing: dict[bytes, float] = field(default_factory=dict, init=False)
    # Promoted blocks to copy up to the faster tiers when the pool evicts them.
    up_when_evicted: dict[bytes, SecondaryTier] = field(default_factory=dict, init=False)
    succeeded: int = field(default=0, init=False)
    cancelled: int = field(default=0, init=False)
    failures: dict[str, int] = field(default_factory=dict, init=False)

    def copies_on_evict(self) -> bool:
        """Whether promoted blocks are copied up when evicted (a pool that can copy a slot
        out at once, such as the host pool) rather than as soon as they land."""
        return self.write_up and type(self.pool).copy_slot is not PrimaryPool.copy_slot

    def start(self, key: bytes, tier: SecondaryTier, slot: int, ready_at: float) -> None:
        """Promote ``key`` from ``tier`` into the reserved ``slot`` in the background."""
        task_group = self.task_group
        assert task_group is not None, "lookup promotes only while the manager is open"
        self.landing[key] = ready_at
        # Counted in flight from now, so the next key of this scan expects its promotion
        # behind this one (and a start that raises gives it all back).
        queued = self.cost.promotion_started(tier.name)
        undo = functools.partial(self._never_ran, key, slot, tier)
        try:
            self.background.start_soon(task_group, undo, self._promote, key, tier, slot, queued)
        except BaseException:
            undo()
            raise

    async def _promote(self, key: bytes, tier: SecondaryTier, slot: int, queued: int) -> None:
        started = time.perf_counter()
        ok = failed = False
        try:
            with anyio.fail_after(self.timeout):
                await self.pool.fill(slot, functools.partial(tier.load, key))
            ok = True
        except Exception as exc:
            failed = True
            self._failed_with(key, tier, exc)
        finally:
            if ok:
                self._landed(key, tier, slot)
            else:
                self.pool.abort(slot)
                self.cancelled += not failed
            seconds = time.perf_counter() - started
            self.cost.promotion_finished(tier.name)
            if ok or failed:  # a cancelled promotion says nothing about the tier
                self.cost.observe_promotion(
                    tier.name, seconds, self.pool.block_bytes, ok, queued=queued
                )
            if self.latency is not None:
                self.callbacks(
                    "latency observer", self.latency.observe_promotion, tier.name, seconds, ok
                )
            self.landing.pop(key, None)
            self.watchers.notify(key)

    def _failed_with(self, key: bytes, tier: SecondaryTier, exc: Exception) -> None:
        reason = reason_of(exc)
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
        task_group = self.task_group
        if self.write_up and task_group is not None and not self.closing:
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
        task_group = self.task_group
        if tier is None or not evicted or task_group is None or self.closing:
            return
        copy = functools.partial(self.pool.copy_slot, slot)
        self.writer.write_up(task_group, key, tier, copy=copy)

    def _never_ran(self, key: bytes, slot: int, tier: SecondaryTier) -> None:
        """Give back the slot ``lookup`` reserved for a promotion cancelled unstarted."""
        self.cost.promotion_finished(tier.name)
        self.pool.abort(slot)
        self.cancelled += 1
        self.landing.pop(key, None)
        self.watchers.notify(key)

    def counts(self, started: int, deferred: int, declined: int) -> PromotionCounts:
        """The promotion counters, with those the lookup decision keeps."""
        return PromotionCounts(
            started=started,
            succeeded=self.succeeded,
            failed=sum(self.failures.values()),
            failed_by_reason=dict(self.failures),
            cancelled=self.cancelled,
            deferred=deferred,
            declined=declined,
            written_up=self.writer.written_up,
            write_ups_waiting=len(self.up_when_evicted),
        )
