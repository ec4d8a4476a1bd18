"""The TieringManager: one primary pool over ordered secondary tiers (docs/design.md, "The lookup
contract").

This is the async shell. Its ``lookup`` answers a primary hit itself (one dict lookup) and
hands every other key to the synchronous ``LookupDecision``; everything slow (promotions,
write-through) runs as tasks in the manager's own task group, each under a deadline, so
nothing stays pending forever and leaving ``async with`` joins them all. The jobs behind it:

- ``_decision``: the lookup past a primary hit (pool state, failures, cost and budget);
- ``_promotions``: promotion tasks and the copy up of promoted blocks;
- ``_transfers``: ``store`` and ``load``, the copies into the pool and out of it;
- ``_joining``: opening the tiers, and those that could not open joining later;
- ``kvtier.writes._writethrough``: write-through, write-back and deferred writes after a store;
- ``kvtier.manager._watch``: who waits for which key (``watch``, ``wait_settled``);
- ``_statistics``: the nested snapshot ``statistics()`` returns;
- ``_config``: ``ManagerConfig``, every setting defined once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Self, Unpack

import anyio
import anyio.abc
from anyio.abc import AsyncResource

from kvtier.common._arguments import check_type
from kvtier.common._background import (
    Background,
    Callbacks,
    cancel_task_group,
    enter_task_group,
)
from kvtier.common._buffers import dtype_name
from kvtier.common._errors import InvalidArgumentError, LifecycleError
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import HIT, HIT_PENDING, RETRY, LookupResult
from kvtier.manager._config import ManagerConfig, ManagerOverrides
from kvtier.manager._cost import CostModel, ScanBudget
from kvtier.manager._decision import LookupDecision, not_open
from kvtier.manager._failures import RecentFailures
from kvtier.manager._joining import TierKeepers, open_every_tier
from kvtier.manager._promotions import PromotionObserver, Promotions
from kvtier.manager._statistics import BackgroundCounts, ManagerStatistics
from kvtier.manager._transfers import Transfers
from kvtier.manager._watch import KeyWatch, Watchers
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier
from kvtier.writes._admission import AdmissionPolicy
from kvtier.writes._writethrough import WriteThrough

__all__ = ["TieringManager"]

logger = logging.getLogger("kvtier.manager")


def _check_tiers(pool: PrimaryPool, tiers: Sequence[SecondaryTier]) -> tuple[SecondaryTier, ...]:
    check_type(pool, PrimaryPool, "pool must be a kvtier pool (HostPool or CudaPool)")
    if isinstance(tiers, SecondaryTier):
        raise InvalidArgumentError("tiers must be a list of tiers; wrap the tier in [...]")
    checked = tuple(tiers)
    for i, tier in enumerate(checked):
        check_type(tier, SecondaryTier, f"tiers[{i}] must be a kvtier.SecondaryTier")
    if len({id(t) for t in checked}) != len(checked):
        raise InvalidArgumentError("the same tier object is listed twice in tiers")
    return checked


class TieringManager(AsyncResource):
    """The primary pool plus secondary tiers, used from one event loop.

    ``async with TieringManager(pool, tiers) as manager`` opens the tiers (the manager owns
    them) and a task group for background work; leaving the block lets in-flight write-through
    finish for up to ``close_timeout`` seconds, cancels the rest (counted in
    ``writes.cancelled``) and closes the tiers.

    Settings come from ``config`` (a ``kvtier.ManagerConfig``; the defaults without one) and
    keyword overrides of its fields (``promotion_timeout=5.0``, ...), each checked by it:

    A promotion that fails is remembered for ``failure_ttl`` seconds: meanwhile that tier's
    HIT for the key counts as a miss with the failure's reason, so a tier that cannot serve a
    block it still reports (for example one that keeps the default ``record_miss``) is not
    asked to promote it again at every lookup.

    ``cost`` (a ``kvtier.CostModel``, made from the settings if not given) learns each tier's
    promotion latency; give it the engine's recompute cost and the scheduler never waits
    longer than recomputing would take. ``admission`` (a ``kvtier.AdmissionPolicy``, made from
    the settings if not given) decides which tiers take each stored block: a tier that falls
    behind is skipped (counted) until it recovers, and tiers it names as write-back get a
    block only when it must leave the pool; up to ``write_back_limit`` blocks wait in the
    pool, pinned, for that. Tiers it names as deferred get the blocks their back-pressure
    dropped later, copied from a faster tier, when they have room again (counted in
    ``writes.deferred`` and ``writes.deferred_written``); closing gives the ones still waiting
    ``close_timeout``, whatever the tier's latency.

    Entering opens every tier at once and waits for them: up to ``tier_answer_wait`` seconds
    for an S3 tier's endpoint to answer, up to ``tier_open_wait`` in all for a tier that
    answered, or does not say (an FS tier), to open; a tier not open by then (its endpoint
    refuses or never answers, its credentials are refused) is unavailable: lookups skip it
    (``unavailable`` misses), writes to it are dropped, and it is opened again in the
    background, with backoff, until it joins (``statistics().opens`` says which). Each
    attempt is bounded by ``open_timeout`` (None: no bound; keep it above the
    ``index_list_timeout`` of an S3 tier that loads its index inside ``open()``). A
    configuration error (``InvalidArgumentError``) still fails the entry. With
    ``require_all_tiers`` the tiers open in turn and the first that fails or passes
    ``open_timeout`` fails the entry (``TierTimeoutError`` naming it), the tiers opened
    before it closed again.

    With ``promote_write_up`` (the default), a block promoted from a tier is also written to
    the write-through tiers listed before it, under the same admission and in-flight limits
    as a store's write-through (counted in ``promotions.written_up``): a node that reads a
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
        config: ManagerConfig | None = None,
        dtype: Any = None,
        latency: PromotionObserver | None = None,
        cost: CostModel | None = None,
        admission: AdmissionPolicy | None = None,
        **overrides: Unpack[ManagerOverrides],
    ) -> None:
        self.tiers = _check_tiers(pool, tiers)
        self.config = settings = ManagerConfig.from_keywords(config, **overrides)
        self.pool = pool
        self._ready = pool.table.ready  # the hit path: one dict lookup, no pool call
        self._touch = pool.table.policy.touch
        self._hits = 0  # primary hits; the decision counts every other answer
        self.cost = settings.cost_model(cost)
        self.admission = settings.admission_policy(admission, self.tiers, pool.block_bytes)
        self._stack: AsyncExitStack | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._watchers = Watchers()
        self._background = Background()  # promotions and write-through
        self._tasks = self._background.tasks
        self._log = BurstLogger(logger)
        self._callback = Callbacks(self._log)
        # what the manager remembers itself, whatever each tier's record_miss does
        self._failed = RecentFailures(settings.failure_ttl)
        self._writer = self._write_through(settings)
        self._promotions = self._promoter(settings, latency)
        self._decision = LookupDecision(
            pool,
            self.tiers,
            failed=self._failed,
            cost=self.cost,
            admission=self.admission,
            watchers=self._watchers,
            landing=self._promotions.landing,
            start=self._promotions.start,
        )
        self._decide = self._decision.decide
        self._keepers = TierKeepers(  # one keeper per tier, opening it until it joins
            self.tiers,
            settings,
            listener=self._watchers.notify,
            changed=self._tiers_changed,
            log=self._log,
        )
        self._transfers = Transfers(
            pool,
            self._watchers,
            timeout=settings.store_timeout,
            dtype=None if dtype is None else dtype_name(dtype),
        )

    def _promoter(self, settings: ManagerConfig, latency: PromotionObserver | None) -> Promotions:
        """Promotions from the tiers, and the copy up of promoted blocks."""
        return Promotions(
            self.pool,
            timeout=settings.promotion_timeout,
            cost=self.cost,
            failed=self._failed,
            writer=self._writer,
            watchers=self._watchers,
            background=self._background,
            callbacks=self._callback,
            burst_log=self._log,
            latency=latency,
            write_up=settings.promote_write_up,
        )

    def _write_through(self, settings: ManagerConfig) -> WriteThrough:
        """Write-through, write-back and deferred writes after each store."""
        limit = settings.write_back_limit
        return WriteThrough(
            self.pool,
            self.tiers,
            self.admission,
            max_in_flight_bytes=settings.max_in_flight_bytes,
            store_timeout=settings.store_timeout,
            write_back_limit=max(self.pool.num_blocks // 4, 1) if limit is None else limit,
            background=self._background,
            callback=self._callback,
            log=self._log,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise LifecycleError("this TieringManager is already entered")
        settings = self.config
        if settings.require_all_tiers:
            stack = await open_every_tier(
                self.tiers,
                open_timeout=settings.open_timeout,
                close_timeout=settings.close_timeout,
                listener=self._watchers.notify,
            )
        else:
            stack = AsyncExitStack()
            # Each joins as it opens.
            await self._keepers.open(settings.tier_answer_wait, settings.tier_open_wait)
            stack.push_async_callback(self._keepers.aclose)  # left after the task group
        self._tiers_changed()
        try:
            self._opened(await enter_task_group())
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    def _tiers_changed(self) -> None:
        """A tier joined (or the manager opens): lookups ask the open tiers only, writes go
        to them only, and the writes waiting for a tier that joined may start."""
        every = self.config.require_all_tiers
        available = self.tiers if every else self._keepers.available()
        self._decision.available(available)
        names = {tier.name for tier in available}
        for tier in self.tiers:
            self.admission.set_available(tier.name, tier.name in names)
        self._writer.room_again()

    def _opened(self, task_group: anyio.abc.TaskGroup) -> None:
        """Hand each part the task group its background work runs in."""
        self._task_group = task_group
        self._writer.opened(task_group)
        self._promotions.opened(task_group)
        self._decision.opened()

    async def aclose(self) -> None:
        """Finish write-through for up to ``close_timeout``, cancel the rest, close the tiers."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        writer, promotions = self._writer, self._promotions
        # Each part in steps: ``closing`` (no new work of its own), ``stopped`` (the task
        # group is cancelled next), ``closed`` (what is left is given up).
        promotions.closing()
        writer.closing()
        # Only the writes get close_timeout: promotions are only reads, cancelled at once.
        await writer.finish(self.config.close_timeout)
        task_group, self._task_group = self._task_group, None
        self._decision.stopped()
        writer.stopped()
        promotions.stopped()
        assert task_group is not None
        await cancel_task_group(task_group)  # children are cancelled: returns promptly
        self._background.undo_unstarted()
        writer.closed()
        # Not shielded here: each tier shields and bounds its own awaiting cleanup, and a
        # shield around a task group's exit is not allowed.
        await stack.aclose()
        promotions.closed()
        self._watchers.fire_all()  # wake schedulers: nothing will change any more

    async def wait_idle(self) -> None:
        """Return once no promotion or write-through is in flight (for a flush, or tests)."""
        await self._tasks.wait_zero()

    def _check_open(self) -> anyio.abc.TaskGroup:
        if self._task_group is None:
            raise not_open()
        return self._task_group

    # -- lookup (docs/design.md, "The lookup contract") --------------------------------------------

    def lookup(self, key: bytes, ctx: ScanBudget | None = None) -> LookupResult:
        """MISS, HIT, HIT_PENDING or RETRY for ``key``, without waiting (docs/design.md, "The lookup
        contract").
        ``ctx`` is the scheduler's budget for the scan that asks (lazy promotion, and no
        promotion from a tier expected later than recompute)."""
        if key in self._ready:
            self._touch(key)
            self._hits += 1
            return HIT
        return self._decide(key, ctx)

    def primary_hit_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are primary hits; the scheduler's fast path. Counts and
        touches them exactly as ``lookup`` would."""
        n = self.pool.ready_prefix(keys)
        self._hits += n
        return n

    def pin_ready(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the READY blocks among ``keys`` and return their slots: the lease a scheduler
        holds on a request's hits while it waits for the rest, so that promotions for other
        requests (or for this one) cannot evict them and thrash a small pool."""
        pin = self.pool.pin
        return [slot for slot in map(pin, keys) if slot is not None]

    def unpin_slots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.pool.unpin(slot)

    @property
    def last_miss_reason(self) -> str:
        """Why the latest ``lookup`` that answered MISS for a key past the pool did (a
        ``kvtier.MissReason`` value; empty before the first): a prefetch, which asks through
        ``lookup``, reports with it where the prefix it fetched ended."""
        return self._decision.last_reason

    def run_soon(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``work`` in the manager's task group: it is cancelled when the manager closes.
        A scheduler's prefetches run here, so that they end with the manager; they are not
        background work that ``wait_idle`` waits for."""
        self._check_open().start_soon(work)

    def default_tier_in_flight_bytes(self) -> int:
        """Each tier's default limit on bytes being written: its share of
        ``max_in_flight_bytes``, so one tier that falls behind cannot hold it all."""
        share = self.config.max_in_flight_bytes // max(len(self.tiers), 1)
        return max(share, self.pool.block_bytes)

    # -- store and load ------------------------------------------------------------------------

    async def store(self, keys: Sequence[bytes], blocks: Any) -> int:
        """Copy ``blocks`` into the pool under ``keys`` and write them through to every tier
        in the background. Returns how many blocks were newly placed in the pool; keys already
        present are skipped, and so are keys for which no slot is free or evictable. ``keys``
        are one request's chain, head first (as a lookup takes them): the pool orders the
        chain, with the prefix the request's scan served, so its tail is evicted first. It
        yields to the loop once before it places anything (cancelled there, nothing is stored)
        and once after (cancelled there, the blocks stay stored)."""
        task_group = self._check_open()
        # A host pool's store never suspends otherwise, and an engine that stores a request's
        # blocks and looks up the next request in the same step would hold the loop for the
        # step before, the store and the lookup in one go.
        await asyncio.sleep(0)
        task_group = self._check_open()
        placed = await self._transfers.store(keys, blocks, lambda: self._task_group is task_group)
        if placed:
            self.pool.table.place_chain(keys)  # the chain's tail leaves the pool first
        closing = self._stack is None
        self._writer.after_store(task_group, placed, closing=closing)
        # And after: whatever the caller does next (the next request's lookup, say) runs in
        # a step of its own, after the write-through just started has had its first turn.
        await asyncio.sleep(0)
        return len(placed)

    async def load(self, keys: Sequence[bytes], out: Any) -> int:
        """Copy the blocks of ``keys`` from the pool into ``out`` (one array with a leading
        block axis, or a list of per-block arrays). Stops at the first key that is not a
        primary hit (it may have been evicted since the lookup) and returns how many leading
        blocks were copied; the engine recomputes the rest."""
        self._check_open()
        return await self._transfers.load(keys, out)

    # -- change notification -----------------------------------------------------------------

    def watch(self, keys: Iterable[bytes], watch: KeyWatch | None = None) -> KeyWatch:
        """Fire ``watch`` (a new one if not given) with each of ``keys`` once, when that
        key's lookup answer may have changed; returns it (``await watch.wait()``, then
        ``watch.take()`` says which keys fired). Closed, the manager answers every key at
        once except blocks a store is still copying, so those are registered (they fire
        when the store ends) and the others fire now."""
        watch = KeyWatch() if watch is None else watch
        if self._task_group is not None:
            self._watchers.add(keys, watch)
            return watch
        for key in keys:
            if self.pool.lookup(key) is HIT_PENDING:
                self._watchers.add((key,), watch)
            else:
                watch.fire(key)
        return watch

    def unwatch(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        """Drop the registrations of ``watch`` on ``keys`` that have not fired."""
        self._watchers.remove(keys, watch)

    async def wait_settled(
        self,
        key: bytes,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a bound on this wait alone
    ) -> LookupResult:
        """Ask ``key`` again at each change until it is neither HIT_PENDING nor RETRY, and
        return that answer (each ask is a ``lookup``: it may start a promotion). Raises
        ``TimeoutError`` after ``timeout`` seconds (None: every check, promotion and store
        has its own deadline, so the answer comes)."""
        with anyio.fail_after(timeout):
            while True:
                watch = self.watch((key,))
                try:
                    result = self.lookup(key)
                    if result is not HIT_PENDING and result is not RETRY:
                        return result
                    await watch.wait()
                finally:
                    self.unwatch((key,), watch)

    # -- observation -------------------------------------------------------------------------

    def statistics(self) -> ManagerStatistics:
        """One snapshot of every counter: each part of the manager gives its own group."""
        decision = self._decision
        return ManagerStatistics(
            lookups=decision.counts(self._hits),
            promotions=self._promotions.counts(decision.tier_hits()),
            stores=self._transfers.counts(),
            writes=self._writer.counts(),
            background=BackgroundCounts(
                tasks=self._tasks.count, callback_failures=self._callback.failures
            ),
            opens=self._keepers.counts(),
            pool=self.pool.statistics(),
            tiers=tuple(t.statistics() for t in self.tiers),
            cost=self.cost.statistics(),
            admission=self.admission.statistics([t.name for t in self.tiers]),
        )

    def __repr__(self) -> str:
        state = "open" if self._task_group is not None else "closed"
        return (
            f"<TieringManager {state} pool={self.pool!r} tiers={[t.name for t in self.tiers]} "
            f"background={self._tasks.count} in_flight_bytes={self._writer.in_flight_bytes}>"
        )
