"""The OffloadScheduler: prefix and sliding-window scans over any manager, and an async layer
that waits for state changes instead of polling (docs/design.md, "The lookup contract")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from kvtier.common._arguments import check_type, positive_int, positive_number
from kvtier.common._buffers import check_keys
from kvtier.common._describe import describe
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._freeze import snapshot
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import HIT, HIT_PENDING, RETRY
from kvtier.manager._cost import CostModel, ScanBudget
from kvtier.manager._watch import KeyWatch
from kvtier.scheduler._bringback import BringBacks, Session, SessionStatistics
from kvtier.scheduler._prefetch import Prefetches, PrefetchHandle, PrefetchStatistics
from kvtier.scheduler._progress import PrefixProgress, WindowProgress
from kvtier.scheduler._protocols import SupportsLookup, SupportsPrefetch, SupportsScheduling
from kvtier.scheduler._session_settings import SessionSettings

__all__ = ["OffloadScheduler", "SchedulerStatistics"]


_log = BurstLogger(logging.getLogger(__name__))


class LookupObserver(Protocol):
    """Receives each async lookup's duration (``kvtier.LatencyHistograms`` is one)."""

    def observe_lookup(self, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """What the scheduler has done since it opened: prefix scans, async lookups and their
    waits, and its prefetches; a snapshot, taken by ``OffloadScheduler.statistics()``."""

    scans: int
    deferred_scans: int
    async_lookups: int
    waits: int
    timeouts: int
    callback_failures: int
    waits_cut: int
    """Async lookups that stopped waiting early: recomputing was expected to be cheaper."""
    prefetch: PrefetchStatistics | None = None
    """What ``prefetch`` did (None when the manager cannot prefetch)."""
    sessions: SessionStatistics | None = None
    """What session hints did (None when the manager cannot prefetch)."""


def _check_window(size: object) -> int:
    return positive_int(size, "sliding_window_size")


class OffloadScheduler:
    """Decides how many prefix blocks of a request kvtier can serve.

    Works with any object that has ``lookup(key, ctx=None)`` (``SupportsLookup``). When the
    manager offers the rest of ``SupportsScheduling`` (TieringManager does), the prefix scan
    counts the leading primary hits in one call and only walks the rest key by key, scans
    pin the hits they count, and the async ``lookup`` sleeps until a key it waits on changes
    state; it needs such a manager.

    ``prefetch`` (with a manager that offers ``SupportsPrefetch``, as TieringManager does)
    fetches a queued request's prefix before its lookup; all prefetches together hold at most
    ``prefetch_share`` of the pool, and what one holds unclaimed is let go after
    ``prefetch_ttl`` seconds.

    ``session(id)`` (with the same manager) takes an agent session's hints: when a turn is
    done, and when the session ends; kvtier brings the session's prefix back into the pool
    before its predicted return, within a share of the pool of its own (``sessions``, a
    ``kvtier.SessionSettings``).
    """

    def __init__(
        self,
        manager: SupportsLookup,
        *,
        max_wait: float = 30.0,
        latency: LookupObserver | None = None,
        prefetch_share: float = 0.25,
        prefetch_ttl: float = 60.0,
        sessions: SessionSettings | None = None,
    ) -> None:
        check_type(manager, SupportsLookup, "manager must have a lookup(key, ctx=None) method")
        positive_number(max_wait, "max_wait")
        positive_number(prefetch_ttl, "prefetch_ttl")
        if (
            isinstance(prefetch_share, bool)
            or not isinstance(prefetch_share, int | float)
            or not 0 <= prefetch_share <= 1
        ):
            raise InvalidArgumentError(
                f"prefetch_share must be a share of the pool from 0 to 1, got {prefetch_share!r}"
            )
        self.manager = manager
        self._latency = latency
        self._max_wait = float(max_wait)
        self._full: SupportsScheduling | None = (
            manager if isinstance(manager, SupportsScheduling) else None
        )
        full = self._full
        self._fast_prefix: Callable[[Sequence[bytes]], int] | None = (
            None if full is None else full.primary_hit_prefix
        )
        self._pin: Callable[[Sequence[bytes]], list[int]] | None = (
            None if full is None else full.pin_ready
        )
        self._unpin: Callable[[Sequence[int]], None] | None = (
            None if full is None else full.unpin_slots
        )
        self._prefetches: Prefetches | None = None
        self._bring_backs: BringBacks | None = None
        # what a request's lookup claims: queued requests' prefetches, sessions' bring-backs
        self._claimers: tuple[Prefetches | BringBacks, ...] = ()
        if isinstance(manager, SupportsPrefetch):
            self._prefetches = Prefetches(
                manager, share=float(prefetch_share), ttl=float(prefetch_ttl)
            )
            self._bring_backs = BringBacks(manager, sessions or SessionSettings())
            self._claimers = (self._prefetches, self._bring_backs)
        self._scans = self._deferred_scans = self._async_lookups = 0
        self._waits = self._timeouts = self._callback_failures = self._waits_cut = 0

    # -- synchronous scans (docs/design.md, "The lookup contract") ---------------------------------

    def maximal_prefix_lookup(
        self, keys: Sequence[bytes], ctx: ScanBudget | None = None
    ) -> int | None:
        """Leading blocks that are hits, or None to defer (something is pending or unknown).
        An answer claims the request's prefetches."""
        lease: list[int] = []
        try:
            answer = self._prefix(keys, ctx, lease)
            if answer is not None:
                self._give_back(self._claim(keys))
            return answer
        finally:
            self._release(lease)

    def sliding_window_lookup(
        self, keys: Sequence[bytes], sliding_window_size: int, ctx: ScanBudget | None = None
    ) -> int | None:
        """End of the rightmost full window of hits, the hit prefix if none, or None to defer."""
        size = _check_window(sliding_window_size)
        lease: list[int] = []
        try:
            answer = self._window(keys, size, ctx, lease)
            if answer is not None:
                self._give_back(self._claim(keys))
            return answer
        finally:
            self._release(lease)

    def _claim(
        self, keys: Sequence[bytes]
    ) -> list[tuple[Prefetches | BringBacks, list[PrefetchHandle]]]:
        """The prefetches and bring-backs of a prefix of ``keys``, stopped (pins kept)."""
        return [(claimer, claimer.claim(keys)) for claimer in self._claimers]

    @staticmethod
    def _give_back(claims: list[tuple[Prefetches | BringBacks, list[PrefetchHandle]]]) -> None:
        for claimer, handles in claims:
            if handles:
                claimer.release(handles)

    def _release(self, lease: list[int]) -> None:
        if lease and self._unpin is not None:
            self._unpin(lease)

    def _prefix(
        self, keys: Sequence[bytes], ctx: ScanBudget | None, lease: list[int]
    ) -> int | None:
        """The prefix scan; pins each hit it counts into ``lease`` (the caller releases)."""
        self._scans += 1
        start = 0
        if self._fast_prefix is not None:
            start = self._fast_prefix(keys)
            if start == len(keys):
                return start  # nothing else runs before the caller returns: no pins needed
        pin = self._pin
        if pin is not None and start:
            lease += pin(keys[:start])
        lookup = self.manager.lookup
        count = start
        defer = False
        for key in islice(keys, start, None):
            result = lookup(key, ctx)
            if result is HIT:
                count += 1
                if pin is not None:
                    lease += pin((key,))
            elif result is HIT_PENDING:
                count += 1
                defer = True
            elif result is RETRY:
                defer = True
            else:
                break
        if defer:
            self._deferred_scans += 1
            return None
        return count

    def _window(
        self,
        keys: Sequence[bytes],
        size: int,
        ctx: ScanBudget | None,
        lease: list[int],
    ) -> int | None:
        """The window scan; pins each hit it sees into ``lease`` (the caller releases)."""
        self._scans += 1
        lookup = self.manager.lookup
        pin = self._pin
        streak = 0
        defer = False
        for i in range(len(keys) - 1, -1, -1):
            result = lookup(keys[i], ctx)
            if result is HIT:
                streak += 1
                if pin is not None:
                    lease += pin((keys[i],))
            elif result is HIT_PENDING:
                streak += 1
                defer = True
            elif result is RETRY:
                streak = 0
                defer = True
            else:
                streak = 0
            if streak == size:
                if defer:
                    self._deferred_scans += 1
                    return None
                return i + size
        if defer:
            self._deferred_scans += 1
            return None
        return streak

    # -- async layer (docs/design.md, "The lookup contract") ---------------------------------------

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        sliding_window_size: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - pinned API (docs/design.md)
    ) -> int:
        """Scan; while the scan defers, sleep until a key it waits on changes state.

        At the deadline (``timeout``, or the scheduler's ``max_wait`` when None) return the
        blocks that are HIT now and leave the background work running. The lookup claims
        the request's prefetches (``prefetch`` of a prefix of ``keys``): they stop, and what
        they hold is given back once the answer is counted.
        """
        keys = check_keys(keys)
        window = None if sliding_window_size is None else _check_window(sliding_window_size)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
        ):
            raise InvalidArgumentError(f"timeout must be a non-negative number, got {timeout!r}")
        manager = self._full
        if manager is None:
            raise InvalidArgumentError(
                "the async lookup needs a manager with all TieringManager offers a scan: "
                "watch()/unwatch(), primary_hit_prefix(), pin_ready()/unpin_slots() and a "
                "cost model; use the synchronous scans with other managers"
            )
        self._async_lookups += 1
        limit = self._max_wait if timeout is None else float(timeout)
        started = time.perf_counter()
        claims = self._claim(keys)
        try:
            return await self._wait_for_answer(manager, keys, window, limit)
        finally:
            self._give_back(claims)
            if self._latency is not None:
                try:
                    self._latency.observe_lookup(time.perf_counter() - started)
                except Exception as exc:  # an observer's fault must not fail the request
                    self._callback_failures += 1
                    _log.warning("observer", "latency observer raised: %r", exc)

    async def _wait_for_answer(
        self,
        manager: SupportsScheduling,
        keys: list[bytes],
        window: int | None,
        limit: float,
    ) -> int:
        # The scan resumes after each wake: it asks again only the keys that changed, and the
        # hits it has counted stay pinned (its lease) until the answer is returned. With a
        # cost model, every ask goes through the request's ScanBudget (lazy promotion, and
        # no promotion from a tier slower than recompute).
        changes = KeyWatch()
        cost = manager.cost
        budget = ScanBudget(
            manager.lookup,
            keys,
            cost.clock(),
            cost.recompute_seconds_per_block,
            lazy=window is None,
        )
        lookup = budget.ask
        scan: PrefixProgress | WindowProgress
        if window is None:
            scan = PrefixProgress(keys, lookup, self._pin, self._fast_prefix)
        else:
            scan = WindowProgress(keys, lookup, self._pin, window)
        changes.lease = scan.lease  # blocks promoted for it are pinned as they land
        try:
            self._scans += 1
            result = scan.start()
            if result is not None:  # answered without waiting: no timer to set
                return result
            deadline = time.monotonic() + limit
            while result is None:
                self._deferred_scans += 1
                patience = self._patience(budget, cost)
                if patience is not None and patience <= 0:
                    self._waits_cut += 1  # recomputing is expected to be cheaper: stop here
                    return self._hits_now(keys, window, scan.lease, budget)
                manager.watch(scan.take_watches(), changes)
                self._waits += 1
                left = deadline - time.monotonic()
                if left <= 0 or not (
                    await changes.wait(left if patience is None else min(patience, left))
                    or time.monotonic() < deadline
                ):
                    self._timeouts += 1
                    # as ever (docs/design.md, "The lookup contract")
                    return self._hits_now(keys, window, scan.lease)
                self._scans += 1
                result = scan.resume(changes.take())
            return result
        finally:
            manager.unwatch(scan.watched, changes)
            self._release(scan.lease)

    def prefetch(
        self,
        keys: Sequence[bytes],
        *,
        deadline: float | None = None,
        ttl: float | None = None,
    ) -> PrefetchHandle:
        """Start fetching the prefix of a queued request's ``keys`` in the background, as
        its ``lookup`` will once the request is scheduled, and return its handle (``cancel()``
        it if the request is aborted). Existence checks and promotions run up to the first
        miss, under the cost model and within the share of the pool prefetches may hold
        (``prefetch_share``); the prefetch stops after ``deadline`` seconds (default
        ``max_wait``); what it holds that no lookup claimed is let go after ``ttl`` seconds
        (default ``prefetch_ttl``) and stays in the pool as ordinary cache entries. The
        request's lookup (of the same keys, or keys they are a prefix of) claims it."""
        keys = check_keys(keys)
        prefetches = self._prefetches
        if prefetches is None:
            raise InvalidArgumentError(
                "prefetch needs a manager that offers SupportsPrefetch (TieringManager does)"
            )
        for name, value in (("deadline", deadline), ("ttl", ttl)):
            if value is not None:
                positive_number(value, name)
        return prefetches.start(
            keys,
            self._max_wait if deadline is None else float(deadline),
            prefetches.ttl if ttl is None else float(ttl),
        )

    def session(self, session_id: Hashable) -> Session:
        """The hints handle of the agent session ``session_id`` (any hashable id; two
        handles of one id are the same session): call ``turn_done(keys)`` when a turn
        ends and ``end()`` when the session does."""
        if self._bring_backs is None:
            raise InvalidArgumentError(
                "session hints need a manager that offers SupportsPrefetch (TieringManager does)"
            )
        return Session(self._bring_backs, session_id)

    def _patience(self, budget: ScanBudget, cost: CostModel) -> float | None:
        """How much longer waiting can pay off (<= 0: stop now), or None without a recompute
        estimate (wait up to the caller's deadline, as always). A request never waits longer
        in all than recomputing its blocks would take, and stops at once when the blocks it
        waits for are expected later than that."""
        if budget.deadline is None:
            return None
        now = cost.clock()
        if not cost.keep_waiting(
            budget.started, now, budget.expected_ready, budget.deadline - budget.started
        ):
            return 0.0
        return max(budget.deadline - now, 0.0)

    def _hits_now(
        self,
        keys: Sequence[bytes],
        window: int | None,
        lease: list[int],
        budget: ScanBudget | None = None,
    ) -> int:
        """The answer counting only blocks that are HIT at this moment (pinned into
        ``lease`` as they are counted, like a scan's). With a budget, it starts no new
        promotion: the request has stopped waiting."""
        lookup = self.manager.lookup
        if budget is not None:
            budget.promote = False  # the manager defers every tier hit
            lookup = budget.ask
        pin = self._pin
        count = streak = 0
        indexes = range(len(keys)) if window is None else range(len(keys) - 1, -1, -1)
        for i in indexes:
            hit = lookup(keys[i], budget) is HIT
            if hit and pin is not None:
                lease += pin((keys[i],))
            if window is None:
                if not hit:
                    return count
                count += 1
                continue
            streak = streak + 1 if hit else 0
            if streak == window:
                return i + window
        return count if window is None else streak

    def statistics(self) -> SchedulerStatistics:
        prefetches, bring_backs = self._prefetches, self._bring_backs
        return snapshot(
            SchedulerStatistics,
            self,
            "_",
            prefetch=None if prefetches is None else prefetches.statistics(),
            sessions=None if bring_backs is None else bring_backs.statistics(),
        )

    def __repr__(self) -> str:
        shown = "scans deferred_scans waits timeouts"
        return describe("OffloadScheduler", stats=self.statistics(), shown=shown)
