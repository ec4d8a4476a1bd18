"""The manager's lookup past a primary hit: a synchronous decision (docs/design.md, "The lookup
contract").

Given the pool's state, the failures the manager remembers, the tiers' answers and the scan's
budget, ``LookupDecision.decide`` returns the answer and, for a tier hit it promotes, reserves
the slot and hands the promotion to ``start`` (the manager starts its task). Nothing here
awaits or touches the event loop, so it is tested with a plain pool, tiers and a list for
``start``. The primary hit itself is answered by the manager before it gets here: that path
is one dict lookup, and a call into this object would double its cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from kvtier.common._errors import LifecycleError
from kvtier.common._lookup import HIT, HIT_PENDING, MISS, RETRY, LookupResult, MissReason
from kvtier.manager._cost import CostModel, ScanBudget
from kvtier.manager._failures import RecentFailures
from kvtier.manager._statistics import LookupCounts
from kvtier.manager._watch import Watchers
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier
from kvtier.writes._admission import AdmissionPolicy

__all__ = ["LookupDecision", "StartPromotion", "TierHits", "not_open"]


StartPromotion = Callable[[bytes, SecondaryTier, int, float], None]
"""Starts promoting ``key`` from ``tier`` into the reserved ``slot``, expected by ``ready_at``."""


class TierHits(NamedTuple):
    """What the decision did with the tier hits it saw: the promotions statistics count
    them next to what the promotions themselves count."""

    started: int
    """Promotions started."""
    deferred: int
    """Not promoted yet: an earlier key of the scan was still unknown."""
    declined: int
    """Not promoted: the tier was expected later than recompute."""


def not_open() -> LifecycleError:
    return LifecycleError(
        "TieringManager is not open; use it inside `async with TieringManager(...)`"
    )


class LookupDecision:
    """Answers ``lookup`` for keys that are not primary hits, and counts the answers.

    The manager says when it can promote (``opened`` to ``stopped``): closed after use, every
    tier hit is a MISS; never opened, asking is a misuse. ``landing`` maps each key being
    promoted to when it should land (kept by the promotions).

    The manager also says which tiers are open (``available``): a tier that could not open
    yet is not asked at all (its ``lookup`` would answer for a tier that is not there), and a
    key no open tier holds is then a miss for ``unavailable``, not ``not_found``: the block
    may well be in the tier that is missing.
    """

    __slots__ = (
        "_absent",
        "_admission",
        "_all",
        "_cost",
        "_failed",
        "_held",
        "_landing",
        "_open",
        "_pool",
        "_start",
        "_tiers",
        "_was_open",
        "_watchers",
        "declined",
        "deferred",
        "last_reason",
        "miss_reasons",
        "misses",
        "pending",
        "retries",
        "started",
    )

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[SecondaryTier],
        *,
        failed: RecentFailures,
        cost: CostModel,
        admission: AdmissionPolicy,
        watchers: Watchers,
        landing: dict[bytes, float],
        start: StartPromotion,
    ) -> None:
        self._pool = pool
        self._held = pool.table.held
        self._all = self._tiers = tuple(tiers)
        self._absent = MissReason.NOT_FOUND  # a miss's reason when no open tier has the key
        self._failed = failed
        self._cost = cost
        self._admission = admission
        self._watchers = watchers
        self._landing = landing
        self._start = start
        self._open = self._was_open = False
        self.pending = self.retries = self.misses = 0
        self.miss_reasons: dict[str, int] = {}
        self.last_reason = ""  # the reason of the latest MISS (a prefetch reports where it ended)
        self.started = self.deferred = self.declined = 0

    def opened(self) -> None:
        """The manager is open: a tier hit may be promoted."""
        self._open = self._was_open = True

    def available(self, tiers: Collection[SecondaryTier]) -> None:
        """Ask only ``tiers`` (those open), in the manager's order."""
        ids = {id(tier) for tier in tiers}
        self._tiers = tuple(tier for tier in self._all if id(tier) in ids)
        missing = len(self._tiers) < len(self._all)
        self._absent = MissReason.UNAVAILABLE if missing else MissReason.NOT_FOUND

    def stopped(self) -> None:
        """The manager is closing and nothing can promote any more: every tier hit is a MISS
        from now on (a scheduler still asking gets an answer, not an error)."""
        self._open = False

    def decide(self, key: bytes, budget: ScanBudget | None) -> LookupResult:
        """HIT_PENDING, RETRY or MISS for a key that is not READY in the pool (docs/design.md, "The
        lookup contract")."""
        if key in self._held:  # not READY (the caller asked first): being written
            self.pending += 1
            if budget is not None:
                budget.expect(self._landing.get(key, -math.inf))
            return HIT_PENDING
        if not self._open:
            if not self._was_open:
                raise not_open()  # never opened: a usage error, say so
            # Closed (or closing) while the engine still asks: nothing can promote now.
            return self._miss(MissReason.UNAVAILABLE)
        any_retry = False
        reason = self._absent
        soonest = math.inf  # of the tiers still checking: when the block could land
        for tier in self._tiers:
            result = tier.lookup(key)
            if result is HIT:
                if self._failed:
                    failure = self._failed.get(tier, key)
                    if failure is not None:  # promoting it again would fail again
                        reason = failure
                        continue
                return self._promote(key, tier, budget)
            if result is RETRY:
                any_retry = True
                soonest = min(soonest, self.landing(tier))
        if any_retry:
            if budget is not None:
                if budget.deadline is not None and soonest > budget.deadline:
                    return self._too_slow()  # only tiers slower than recompute may hold it
                budget.unknown = True
                budget.expect(soonest)
            self.retries += 1
            return RETRY
        return self._miss(reason)

    def _promote(self, key: bytes, tier: SecondaryTier, budget: ScanBudget | None) -> LookupResult:
        """``tier`` holds ``key``: reserve a slot and start its promotion (RETRY), unless the
        scan's budget refuses it or the pool is full (MISS)."""
        if budget is not None:
            refused = self._refuse(budget, tier, key)
            if refused is not None:
                return refused
        slot = self._pool.try_reserve(key)
        if slot is None:
            return self._miss(MissReason.PRIMARY_FULL)
        self.started += 1
        ready_at = self.landing(tier)
        if budget is not None:
            budget.expect(ready_at)
        self._start(key, tier, slot, ready_at)
        self.retries += 1
        return RETRY

    def _miss(self, reason: MissReason) -> LookupResult:
        name = str(reason)  # a MissReason's value: statistics keys are plain strings
        self.last_reason = name
        self.misses += 1
        self.miss_reasons[name] = self.miss_reasons.get(name, 0) + 1
        return MISS

    def landing(self, tier: SecondaryTier) -> float:
        """When a promotion from ``tier`` started now is expected to have landed. Before
        its first promotion, the tier's write latency stands in: a tier that takes half a
        second to write is unlikely to answer a check and a read much sooner."""
        latency = self._cost.expected_latency(tier.name)
        if latency is None:
            latency = self._admission.write_latency(tier.name) or 0.0
        return self._cost.clock() + latency

    def _refuse(self, budget: ScanBudget, tier: SecondaryTier, key: bytes) -> LookupResult | None:
        """For a scheduler's budgeted scan, the answer when a tier hit is not promoted now:
        RETRY when an earlier key of the scan is still unknown (lazy promotion: the scan may
        stop before this key; its rescan promotes it once that key resolves), MISS when the
        tier is expected later than recompute would finish. None: promote it. (A key that
        only such slow tiers are still checking is a MISS for the scan too.)"""
        blocker = budget.blocker
        if blocker is not None:
            self.deferred += 1
            self.retries += 1
            if blocker != key:  # wake this key's waiters when the blocker's answer changes
                self._watchers.after(blocker, key)
            return RETRY
        if not self._cost.promote_before(tier.name, budget.deadline, self._cost.clock()):
            return self._too_slow()
        return None

    def _too_slow(self) -> LookupResult:
        """A budgeted scan's MISS for a block no tier can deliver before recompute would
        finish: the prefix ends there, and the request does not wait for it."""
        self.declined += 1
        return self._miss(MissReason.TOO_SLOW)

    def tier_hits(self) -> TierHits:
        """What became of the tier hits so far (for the promotions statistics)."""
        return TierHits(self.started, self.deferred, self.declined)

    def counts(self, hits: int) -> LookupCounts:
        """The lookup counters, with the primary hits the manager counted itself."""
        return LookupCounts(
            hit=hits,
            hit_pending=self.pending,
            retry=self.retries,
            miss=self.misses,
            misses_by_reason=dict(self.miss_reasons),
        )
