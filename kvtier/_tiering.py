"""The TieringManager: one primary pool over ordered secondary tiers (design §2.1, §3).

Its ``lookup`` is synchronous and runs the pinned algorithm of design §2.1; everything slow
(promotions, write-through to the tiers) runs as tasks in the manager's own task group, each
under a deadline, so nothing stays pending forever and leaving ``async with`` joins them all.
The manager holds lookup, promotion, load and change notification; write-through and
write-back live in ``kvtier._writethrough``, which the manager calls after each store.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import types
from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol, Self

import anyio
import anyio.abc

from kvtier._admission import AdmissionPolicy, AdmissionStatistics
from kvtier._background import Background
from kvtier._buffers import check_keys, dtype_name, split_blocks
from kvtier._cost import CostModel, CostStatistics, ScanBudget
from kvtier._errors import InvalidArgumentError, LifecycleError, TierTimeoutError
from kvtier._failures import RecentFailures
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier._validate import positive_int, positive_number
from kvtier._watch import KeyWatch
from kvtier._writethrough import WriteThrough, bump, reason_of
from kvtier.pools._base import PrimaryPool
from kvtier.pools._slots import PoolStatistics, SlotState
from kvtier.tiers._base import SecondaryTier, TierStatistics

__all__ = ["ManagerStatistics", "TieringManager"]

logger = logging.getLogger(__name__)

HIT = LookupResult.HIT
HIT_PENDING = LookupResult.HIT_PENDING
RETRY = LookupResult.RETRY
MISS = LookupResult.MISS


class PromotionObserver(Protocol):
    """Receives each promotion's latency (``kvtier.LatencyHistograms`` is one)."""

    def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    lookups_hit: int
    lookups_hit_pending: int
    lookups_retry: int
    lookups_miss: int
    misses_by_reason: dict[str, int]
    promotions_started: int
    promotions_succeeded: int
    promotions_failed_by_reason: dict[str, int]
    promotions_cancelled: int
    blocks_stored: int
    stores_skipped_present: int
    stores_skipped_full: int
    blocks_loaded: int
    cascades_started: int
    cascades_succeeded: int
    cascade_failures_by_reason: dict[str, int]
    cascades_skipped: int
    cascades_cancelled: int
    in_flight_bytes: int
    background_tasks: int
    callback_failures: int
    pool: PoolStatistics
    tiers: tuple[TierStatistics, ...]
    promotions_deferred: int
    """Tier hits not promoted yet because an earlier key of the scan was still unknown."""
    promotions_declined: int
    """Tier hits not promoted because the tier was expected later than recompute."""
    cascades_dropped: int
    """Writes to a tier that its admission refused (back-pressure), all tiers together."""
    written_back: int
    dirty_blocks: int
    cost: CostStatistics
    admission: tuple[AdmissionStatistics, ...]
    promotions_written_up: int
    """Promoted blocks whose write to the faster tiers above their source was started."""
    writes_deferred: int
    """Writes to a ``deferred`` tier that back-pressure dropped and that were queued."""
    deferred_written: int
    """Deferred writes since copied to their tier from a faster one."""
    deferred_lost: int
    """Deferred writes given up: the queue overflowed, no faster tier held the block any
    more, the write failed, or the manager closed first."""
    deferred_pending: int
    write_ups_waiting: int = 0
    """Promoted blocks in the pool to be copied to the faster tiers when they are evicted."""


class TieringManager:
    """The primary pool plus secondary tiers, used from one event loop.

    ``async with TieringManager(pool, tiers) as manager`` opens the tiers (the manager owns
    them) and a task group for background work; leaving the block lets in-flight write-through
    finish for up to ``close_timeout`` seconds, cancels the rest (counted in
    ``cascades_cancelled``) and closes the tiers.

    A promotion that fails is remembered for ``failure_ttl`` seconds: meanwhile that tier's
    HIT for the key counts as a miss with the failure's reason, so a tier that cannot serve a
    block it still reports (for example one that keeps the default ``record_miss``) is not
    asked to promote it again at every lookup.

    ``cost`` (a ``kvtier.CostModel``, one is made if not given) learns each tier's promotion
    latency; give it the engine's recompute cost and the scheduler never waits longer than
    recomputing would take. ``admission`` (a ``kvtier.AdmissionPolicy``) decides which tiers
    take each stored block: a tier that falls behind is skipped (counted) until it recovers,
    and tiers it names as write-back get a block only when it must leave the pool; up to
    ``write_back_limit`` blocks wait in the pool, pinned, for that. Tiers it names as
    deferred get the blocks their back-pressure dropped later, copied from a faster tier,
    when they have room again (counted in ``writes_deferred`` and ``deferred_written``);
    closing gives the ones still waiting ``close_timeout``, whatever the tier's latency.

    Entering opens each tier within ``open_timeout`` seconds (None: no bound); a tier that
    takes longer fails it with ``TierTimeoutError`` naming that tier, and every tier opened
    before it is closed again. Keep it above an S3 tier's ``index_list_timeout``.

    With ``promote_write_up`` (the default), a block promoted from a tier is also written to
    the write-through tiers listed before it, under the same admission and in-flight limits
    as a store's write-through (counted in ``promotions_written_up``): a node that reads a
    block from a shared S3 tier keeps it on its own FS tier, and the next time the block
    leaves the pool it comes back from there, not from S3. With a pool in host memory the copy
    is made when the block is evicted, not when it arrives: the requests that wait for
    promoted blocks do not share the machine with their copies, and a block that stays in the
    pool is never copied. Promoted blocks still in the pool when the manager closes are not
    copied (they are still in the tier they came from). A GPU pool copies them at once.
    """

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[SecondaryTier] = (),
        *,
        promotion_timeout: float = 10.0,
        store_timeout: float = 30.0,
        max_in_flight_bytes: int = 256 << 20,
        close_timeout: float = 5.0,
        failure_ttl: float = 2.0,
        dtype: Any = None,
        latency: PromotionObserver | None = None,
        cost: CostModel | None = None,
        admission: AdmissionPolicy | None = None,
        write_back_limit: int | None = None,
        open_timeout: float | None = 120.0,
        promote_write_up: bool = True,
    ) -> None:
        if not isinstance(pool, PrimaryPool):
            raise InvalidArgumentError(
                f"pool must be a kvtier pool (HostPool or CudaPool), got {type(pool).__name__}"
            )
        if isinstance(tiers, SecondaryTier):
            raise InvalidArgumentError("tiers must be a list of tiers; wrap the tier in [...]")
        self.tiers = tuple(tiers)
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, SecondaryTier):
                raise InvalidArgumentError(
                    f"tiers[{i}] must be a kvtier.SecondaryTier, got {type(tier).__name__}"
                )
        if len({id(t) for t in self.tiers}) != len(self.tiers):
            raise InvalidArgumentError("the same tier object is listed twice in tiers")
        self.pool = pool
        self._ready = pool.table.ready  # the hit path: one dict lookup, no pool call
        self._touch = pool.table.policy.touch
        self._promotion_timeout = positive_number(promotion_timeout, "promotion_timeout")
        self._store_timeout = positive_number(store_timeout, "store_timeout")
        self._max_in_flight_bytes = positive_int(max_in_flight_bytes, "max_in_flight_bytes")
        self._close_timeout = positive_number(close_timeout, "close_timeout")
        self._open_timeout = (
            None if open_timeout is None else positive_number(open_timeout, "open_timeout")
        )
        # what the manager remembers itself, whatever each tier's record_miss does
        self._failed = RecentFailures(positive_number(failure_ttl, "failure_ttl"))
        if not isinstance(promote_write_up, bool):
            raise InvalidArgumentError(
                f"promote_write_up must be True or False, got {promote_write_up!r}"
            )
        self._promote_write_up = promote_write_up
        self._dtype = None if dtype is None else dtype_name(dtype)
        self._latency = latency
        self.cost = cost if cost is not None else CostModel()
        if admission is None:
            admission = AdmissionPolicy(max_in_flight_bytes=self.default_tier_in_flight_bytes())
        self.admission = admission
        self._promoting: dict[bytes, float] = {}  # key -> when its promotion should land
        # Promoted blocks to copy up to the faster tiers when the pool evicts them.
        self._up_when_evicted: dict[bytes, SecondaryTier] = {}
        self._after: dict[bytes, list[bytes]] = {}  # key -> keys deferred until it changes
        self._stack: AsyncExitStack | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._was_open = False  # closed after use: lookups answer MISS; never opened: misuse
        self._waiters: dict[bytes, list[anyio.Event | KeyWatch]] = {}
        self._background = Background()  # promotions and write-through
        self._tasks = self._background.tasks
        self._log = BurstLogger(logger)
        self._writer = WriteThrough(
            pool,
            self.tiers,
            admission,
            max_in_flight_bytes=self._max_in_flight_bytes,
            store_timeout=self._store_timeout,
            write_back_limit=(
                max(pool.num_blocks // 4, 1) if write_back_limit is None else write_back_limit
            ),
            background=self._background,
            callback=self._callback,
            log=self._log,
        )
        # counters
        self._hits = self._pending = self._retries = self._misses = 0
        self._miss_reasons: dict[str, int] = {}
        self._promotions_started = self._promotions_ok = self._promotions_cancelled = 0
        self._promotion_failures: dict[str, int] = {}
        self._stored = self._skipped_present = self._skipped_full = self._loaded = 0
        self._callback_failures = 0
        self._deferred = self._declined = 0

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise LifecycleError("this TieringManager is already entered")
        opening: SecondaryTier | None = None
        async with AsyncExitStack() as stack:
            # Entered first, so left last: it bounds each tier's open, then stays entered
            # (with no deadline) until aclose, because task groups a tier enters while
            # opening must be left before the scope they were entered in.
            bound = stack.enter_context(anyio.CancelScope())
            for tier in self.tiers:
                opening = tier
                if self._open_timeout is not None:
                    bound.deadline = anyio.current_time() + self._open_timeout
                await stack.enter_async_context(tier)
                stack.callback(tier.add_listener(self._notify))
            opening = None
            bound.deadline = math.inf
            task_group = anyio.create_task_group()
            await task_group.__aenter__()
            self._task_group = self._writer.task_group = task_group
            if self._promote_write_up and type(self.pool).copy_slot is not PrimaryPool.copy_slot:
                self.pool.table.on_leave = self._leaving
            self._was_open = True
            self._stack = stack.pop_all()
        if opening is not None:  # its open ran past open_timeout (the scope caught that)
            with anyio.move_on_after(self._close_timeout, shield=True):
                await opening.aclose()  # whatever its open had set up before it was cut
            raise TierTimeoutError(
                f"did not open within open_timeout={self._open_timeout:g} s; check that the "
                "tier is reachable (a hung mount, an endpoint that does not answer) or raise "
                "open_timeout",
                tier=opening.name,
                operation="open",
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Finish write-through for up to ``close_timeout``, cancel the rest, close the tiers."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        writer = self._writer
        writer.closing = True
        if self._task_group is not None:
            writer.flush(self._task_group, everything=True)
            writer.drain_deferred(self._task_group)
        with anyio.move_on_after(self._close_timeout, shield=True):
            await writer.cascades.wait_zero()  # promotions are only reads: cancel them at once
        writer.cancelled += writer.cascades.count
        task_group, self._task_group = self._task_group, None
        writer.task_group = None
        self.pool.table.on_leave = None
        self._up_when_evicted.clear()  # still in the pool: still in the tier they came from
        assert task_group is not None
        task_group.cancel_scope.cancel()
        await task_group.__aexit__(None, None, None)  # children are cancelled: returns promptly
        self._background.undo_unstarted()
        writer.deferred.clear()  # what the deferred tiers had not taken in time: given up
        writer.closing = False
        # Not shielded here: each tier shields and bounds its own awaiting cleanup, and a
        # shield around a task group's exit is not allowed.
        await stack.aclose()
        self._after.clear()
        self._promoting.clear()
        waiters, self._waiters = self._waiters, {}
        for key, events in waiters.items():  # wake schedulers: nothing will change any more
            for event in events:
                if isinstance(event, KeyWatch):
                    event.fire(key)
                else:
                    event.set()

    async def wait_idle(self) -> None:
        """Return once no promotion or write-through is in flight (for a flush, or tests)."""
        await self._tasks.wait_zero()

    def _check_open(self) -> anyio.abc.TaskGroup:
        if self._task_group is None:
            raise LifecycleError(
                "TieringManager is not open; use it inside `async with TieringManager(...)`"
            )
        return self._task_group

    # -- lookup (design §2.1) ------------------------------------------------------------------

    def lookup(self, key: bytes, ctx: object = None) -> LookupResult:
        """MISS, HIT, HIT_PENDING or RETRY for ``key``, without waiting (design §2.1)."""
        if key in self._ready:
            self._touch(key)
            self._hits += 1
            return HIT
        if self.pool.lookup(key) is HIT_PENDING:
            self._pending += 1
            if isinstance(ctx, ScanBudget):
                ctx.expect(self._promoting.get(key, -math.inf))
            return HIT_PENDING
        task_group = self._task_group
        if task_group is None:
            if not self._was_open:
                self._check_open()  # never opened: a usage error, say so
            # Closed (or closing) while the engine still asks: nothing can promote now.
            self._misses += 1
            bump(self._miss_reasons, MissReason.UNAVAILABLE)
            return MISS
        budget = ctx if isinstance(ctx, ScanBudget) else None
        any_retry = False
        reason = MissReason.NOT_FOUND
        soonest = math.inf  # of the tiers still checking: when the block could land
        for tier in self.tiers:
            result = tier.lookup(key)
            if result is HIT:
                if self._failed:
                    failure = self._failed.get(tier, key)
                    if failure is not None:  # promoting it again would fail again
                        reason = failure
                        continue
                if budget is not None:
                    refused = self._refuse_promotion(budget, tier, key)
                    if refused is not None:
                        return refused
                slot = self.pool.try_reserve(key)
                if slot is None:
                    self._misses += 1
                    bump(self._miss_reasons, MissReason.PRIMARY_FULL)
                    return MISS
                self._promotions_started += 1
                self._promoting[key] = ready_at = self._landing(tier)
                if budget is not None:
                    budget.expect(ready_at)
                # Counted in flight from now, so the next key of this scan expects its
                # promotion behind this one (and a start that raises gives it all back).
                queued = self.cost.promotion_started(tier.name)
                undo = functools.partial(self._promotion_never_ran, key, slot, tier)
                try:
                    self._background.start_soon(
                        task_group, undo, self._promote, key, tier, slot, queued
                    )
                except BaseException:
                    undo()
                    raise
                self._retries += 1
                return RETRY
            if result is RETRY:
                any_retry = True
                soonest = min(soonest, self._landing(tier))
        if any_retry:
            if budget is not None:
                if budget.deadline is not None and soonest > budget.deadline:
                    return self._too_slow()  # only tiers slower than recompute may hold it
                budget.unknown = True
                budget.expect(soonest)
            self._retries += 1
            return RETRY
        self._misses += 1
        bump(self._miss_reasons, reason)
        return MISS

    def default_tier_in_flight_bytes(self) -> int:
        """Each tier's default limit on bytes being written: its share of
        ``max_in_flight_bytes``, so one tier that falls behind cannot hold it all."""
        share = self._max_in_flight_bytes // max(len(self.tiers), 1)
        return max(share, self.pool.block_bytes)

    def _landing(self, tier: SecondaryTier) -> float:
        """When a promotion from ``tier`` started now is expected to have landed. Before
        its first promotion, the tier's write latency stands in: a tier that takes half a
        second to write is unlikely to answer a check and a read much sooner."""
        latency = self.cost.expected_latency(tier.name)
        if latency is None:
            latency = self.admission.write_latency(tier.name) or 0.0
        return self.cost.clock() + latency

    def _refuse_promotion(
        self, budget: ScanBudget, tier: SecondaryTier, key: bytes
    ) -> LookupResult | None:
        """For a scheduler's budgeted scan, the answer when a tier hit is not promoted now:
        RETRY when an earlier key of the scan is still unknown (lazy promotion: the scan may
        stop before this key; its rescan promotes it once that key resolves), MISS when the
        tier is expected later than recompute would finish. None: promote it. (A key that
        only such slow tiers are still checking is a MISS for the scan too.)"""
        blocker = budget.blocker
        if blocker is not None:
            self._deferred += 1
            self._retries += 1
            if blocker != key:  # wake this key's waiters when the blocker's answer changes
                self._after.setdefault(blocker, []).append(key)
            return RETRY
        if not self.cost.promote_before(tier.name, budget.deadline, self.cost.clock()):
            return self._too_slow()
        return None

    def _too_slow(self) -> LookupResult:
        """A budgeted scan's MISS for a block no tier can deliver before recompute would
        finish: the prefix ends there, and the request does not wait for it."""
        self._declined += 1
        self._misses += 1
        self._miss_reasons["too_slow"] = self._miss_reasons.get("too_slow", 0) + 1
        return MISS

    def pin_ready(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the READY blocks among ``keys`` and return their slots: the lease a scheduler
        holds on a request's hits while it waits for the rest, so that promotions for other
        requests (or for this one) cannot evict them and thrash a small pool."""
        pin = self.pool.pin
        return [slot for slot in map(pin, keys) if slot is not None]

    def unpin_slots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.pool.unpin(slot)

    def primary_hit_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are primary hits; the scheduler's fast path. Counts and
        touches them exactly as ``lookup`` would."""
        n = self.pool.ready_prefix(keys)
        self._hits += n
        return n

    async def _promote(self, key: bytes, tier: SecondaryTier, slot: int, queued: int) -> None:
        started = time.perf_counter()
        ok = failed = False
        try:
            with anyio.fail_after(self._promotion_timeout):
                await self.pool.fill(slot, functools.partial(tier.load, key))
            ok = True
        except Exception as exc:
            failed = True
            reason = reason_of(exc)
            bump(self._promotion_failures, reason)
            self._failed.remember(tier, key, reason)
            self._callback("record_miss", tier.record_miss, key, reason)
            self._log.warning(
                "promote:" + reason.value,
                "promotion from %s failed (%s): %r",
                tier.name,
                reason.value,
                exc,
            )
        finally:
            if ok:
                self.pool.commit(slot)
                self._promotions_ok += 1
                task_group = self._task_group
                if self._promote_write_up and task_group is not None and self._stack is not None:
                    if self.pool.table.on_leave is None:
                        self._writer.write_up(task_group, key, tier)
                    elif self._writer.writes_up(tier):
                        self._up_when_evicted[key] = tier  # copied up when evicted
            else:
                self.pool.abort(slot)
                self._promotions_cancelled += not failed
            seconds = time.perf_counter() - started
            self.cost.promotion_finished(tier.name)
            if ok or failed:  # a cancelled promotion says nothing about the tier
                self.cost.observe_promotion(
                    tier.name, seconds, self.pool.block_bytes, ok, queued=queued
                )
            if self._latency is not None:
                self._callback(
                    "latency observer", self._latency.observe_promotion, tier.name, seconds, ok
                )
            self._promoting.pop(key, None)
            self._notify(key)

    def _leaving(self, key: bytes, slot: int, evicted: bool) -> None:
        """``key`` leaves the pool. Evicted (the pool is about to reuse ``slot``), a promoted
        block not yet copied to the faster tiers is copied now (its bytes taken at once, a
        memcpy inside the ``lookup`` or ``store`` that evicts it; written in the background).
        Discarded (its bytes may be bad), it is only forgotten."""
        tier = self._up_when_evicted.pop(key, None)
        task_group = self._task_group
        if tier is None or not evicted or task_group is None or self._stack is None:
            return
        copy = functools.partial(self.pool.copy_slot, slot)
        self._writer.write_up(task_group, key, tier, copy=copy)

    def _promotion_never_ran(self, key: bytes, slot: int, tier: SecondaryTier) -> None:
        """Give back the slot ``lookup`` reserved for a promotion cancelled unstarted."""
        self.cost.promotion_finished(tier.name)
        self.pool.abort(slot)
        self._promotions_cancelled += 1
        self._promoting.pop(key, None)
        self._notify(key)

    def _callback(self, what: str, function: Callable[..., object], *args: object) -> None:
        """Call a tier's or an observer's hook from background work. The manager's task group
        lives in the engine's task, so an exception here would stop the engine: it is logged
        once per burst and counted in ``callback_failures`` instead."""
        try:
            function(*args)
        except Exception as exc:
            self._callback_failures += 1
            self._log.warning(
                "callback:" + what, "%s raised in kvtier background work: %r", what, exc
            )

    # -- store and load ------------------------------------------------------------------------

    async def store(self, keys: Sequence[bytes], blocks: Any) -> int:
        """Copy ``blocks`` into the pool under ``keys`` and write them through to every tier
        in the background. Returns how many blocks were newly placed in the pool; keys already
        present are skipped, and so are keys for which no slot is free or evictable."""
        task_group = self._check_open()
        keys = check_keys(keys)
        buffers = split_blocks(
            blocks,
            len(keys),
            self.pool.block_bytes,
            name="blocks",
            writable=False,
            dtype=self._dtype,
        )
        slots: list[int] = []
        chosen_keys: list[bytes] = []
        chosen = []
        for key, buffer in zip(keys, buffers, strict=True):
            if self.pool.state_of(key) is not SlotState.FREE:
                self._skipped_present += 1
                continue
            slot = self.pool.try_reserve(key)
            if slot is None:
                self._skipped_full += 1
                continue
            slots.append(slot)
            chosen_keys.append(key)
            chosen.append(buffer)
        if not slots:
            return 0
        committed = False
        try:
            with anyio.fail_after(self._store_timeout):
                await self.pool.copy_in(slots, chosen)
            if self._task_group is not task_group:  # closed while we copied
                raise LifecycleError(
                    "TieringManager is not open any more: it was closed while this store "
                    "copied its blocks, and nothing was stored"
                )
            for slot in slots:
                self.pool.commit(slot)
            committed = True
        finally:
            if not committed:
                for slot in slots:
                    self.pool.abort(slot)
            for key in chosen_keys:
                self._notify(key)
        self._stored += len(slots)
        closing = self._stack is None
        for key in chosen_keys:
            self._writer.after_store(task_group, key, closing=closing)
        return len(slots)

    async def load(self, keys: Sequence[bytes], out: Any) -> int:
        """Copy the blocks of ``keys`` from the pool into ``out`` (one array with a leading
        block axis, or a list of per-block arrays). Stops at the first key that is not a
        primary hit (it may have been evicted since the lookup) and returns how many leading
        blocks were copied; the engine recomputes the rest."""
        self._check_open()
        keys = check_keys(keys)
        buffers = split_blocks(
            out, len(keys), self.pool.block_bytes, name="out", writable=True, dtype=self._dtype
        )
        pinned: list[int] = []
        try:
            for key in keys:
                slot = self.pool.pin(key)
                if slot is None:
                    break
                pinned.append(slot)
            if pinned:
                await self.pool.copy_out(pinned, buffers[: len(pinned)])
        finally:
            for slot in pinned:
                self.pool.unpin(slot)
        self._loaded += len(pinned)
        return len(pinned)

    # -- change notification -----------------------------------------------------------------

    def watch(self, keys: Sequence[bytes]) -> anyio.Event:
        """An event set when the lookup answer of any of ``keys`` may have changed."""
        event = anyio.Event()
        if self._task_group is None:
            event.set()
            return event
        for key in keys:
            self._waiters.setdefault(key, []).append(event)
        return event

    def unwatch(self, keys: Sequence[bytes], event: anyio.Event) -> None:
        self._unregister(keys, event)

    def watch_each(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        """Fire ``watch`` with each of ``keys`` once, when that key's answer may have changed
        (the scheduler's resumable scans: they learn which keys to ask again). Closed, the
        manager answers every key at once except blocks a store is still copying, and those
        fire when the store ends, so registering stays right."""
        waiters = self._waiters
        for key in keys:
            waiters.setdefault(key, []).append(watch)

    def unwatch_each(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        """Drop the registrations of ``watch`` that have not fired."""
        self._unregister(keys, watch)

    def _unregister(self, keys: Iterable[bytes], waiter: anyio.Event | KeyWatch) -> None:
        for key in keys:
            events = self._waiters.get(key)
            if events is not None:
                if waiter in events:
                    events.remove(waiter)
                if not events:
                    del self._waiters[key]

    def _notify(self, key: bytes) -> None:
        deferred = self._after.pop(key, None)
        if deferred:
            for other in deferred:
                self._notify(other)
        events = self._waiters.pop(key, None)
        if events:
            for event in events:
                if isinstance(event, KeyWatch):
                    event.fire(key)
                else:
                    event.set()

    # -- observation -------------------------------------------------------------------------

    def statistics(self) -> ManagerStatistics:
        writer = self._writer
        return ManagerStatistics(
            lookups_hit=self._hits,
            lookups_hit_pending=self._pending,
            lookups_retry=self._retries,
            lookups_miss=self._misses,
            misses_by_reason=dict(self._miss_reasons),
            promotions_started=self._promotions_started,
            promotions_succeeded=self._promotions_ok,
            promotions_failed_by_reason=dict(self._promotion_failures),
            promotions_cancelled=self._promotions_cancelled,
            blocks_stored=self._stored,
            stores_skipped_present=self._skipped_present,
            stores_skipped_full=self._skipped_full,
            blocks_loaded=self._loaded,
            cascades_started=writer.started,
            cascades_succeeded=writer.succeeded,
            cascade_failures_by_reason=dict(writer.failures),
            cascades_skipped=writer.skipped,
            cascades_cancelled=writer.cancelled,
            in_flight_bytes=writer.in_flight_bytes,
            background_tasks=self._tasks.count,
            callback_failures=self._callback_failures,
            pool=self.pool.statistics(),
            tiers=tuple(t.statistics() for t in self.tiers),
            promotions_deferred=self._deferred,
            promotions_declined=self._declined,
            cascades_dropped=self.admission.dropped(),
            written_back=writer.write_back.written_back,
            dirty_blocks=len(writer.write_back),
            cost=self.cost.statistics(),
            admission=self.admission.statistics([t.name for t in self.tiers]),
            promotions_written_up=writer.written_up,
            writes_deferred=writer.deferred.deferred,
            deferred_written=writer.deferred.written,
            deferred_lost=writer.deferred.lost,
            deferred_pending=len(writer.deferred),
            write_ups_waiting=len(self._up_when_evicted),
        )

    def __repr__(self) -> str:
        state = "open" if self._task_group is not None else "closed"
        return (
            f"<TieringManager {state} pool={self.pool!r} tiers={[t.name for t in self.tiers]} "
            f"background={self._tasks.count} in_flight_bytes={self._writer.in_flight_bytes}>"
        )
