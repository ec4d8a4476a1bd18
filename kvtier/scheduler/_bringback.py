"""Bringing a session's prefix back before its next turn: the async driver of the session
table, and the handle an engine holds per session.

The engine says when a session's turn is done and which keys its next prompt starts with
(``Session.turn_done``), and when the session is over (``Session.end``). The session table
(``kvtier.scheduler._sessions``, synchronous) predicts the return and says when each
bring-back is due; this module acts on it. A due bring-back is a prefetch of the session's
keys (``kvtier.scheduler._prefetch``) run by a prefetcher of its own, so it gets everything a
prefetch promises: the cost model's "never slower than recompute", promotions head first up
to the first miss (the tail last), pins within a share of the pool (``SessionSettings.share``,
apart from the queued requests' ``prefetch_share``), and a TTL. Pinned blocks are never
evicted, so a guess never takes a block a running request holds, and it holds at most its
share. What a bring-back promoted and nobody claimed is demoted when it is let go (stale, or
its session ended): those slots are the next to be reused.

A predicted return is a guess, and a wide one (gaps run from seconds to minutes), so a
bring-back without ``expect_back_in`` runs as a guess (see ``_prefetch``): it holds no block
still in the pool, promotes only into spare slots, and scans again when spare slots appear.
One with ``expect_back_in`` is the engine's word: it pins the prefix and may evict for it,
within its share.

Retention by session: the private blocks of a session that ended, was forgotten or went
quiet (the table's ``take_retired``) are demoted at once, so the blocks of sessions expected
back outrank them; the spare slots that makes are what guesses fill.

The driver is one task in the manager's task group, started by the first hint and ended as
soon as no plan is live (and when the manager closes); it sleeps until the table's next
start or stale time, or until a hint, a claim or a bring-back's end wakes it. At most
``max_running`` bring-backs scan and promote at once.

The returning turn's lookup (``OffloadScheduler.lookup`` or a synchronous scan's answer)
claims its session's plan: the table records the gap, and the bring-back's pins go back once
the lookup has pinned what it counted.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

import anyio

from kvtier.common._arguments import positive_number
from kvtier.common._buffers import check_keys
from kvtier.common._describe import describe
from kvtier.common._errors import LifecycleError
from kvtier.scheduler._prefetch import Prefetches, PrefetchHandle, PrefetchState
from kvtier.scheduler._protocols import SupportsPrefetch
from kvtier.scheduler._session_settings import SessionSettings
from kvtier.scheduler._sessions import Plan, SessionTable, promotion_lead

__all__ = ["BringBacks", "Session", "SessionStatistics"]

_LEARN_WEIGHT = 0.3
"""Weight of a new bring-back's duration in ``seconds_per_block``."""


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """What a scheduler's session hints did, and hold now."""

    sessions: int
    """Sessions tracked now."""
    turns: int
    """``turn_done`` calls."""
    hinted: int
    """Turns that said when the session comes back (``expect_back_in``)."""
    gaps_seen: int
    """Returns observed (the gaps the predictions learn from)."""
    bring_backs: int
    """Bring-backs started."""
    claimed: int
    """Plans whose turn arrived (a lookup of the session's keys) before they went stale."""
    stale: int
    """Plans given up: the turn did not come back before the stale time."""
    ended: int
    """Sessions ended by ``end()``."""
    forgotten: int
    """Sessions forgotten: idle too long, or past the table's bound."""
    blocks_promoted: int
    """Promotions bring-backs started."""
    blocks_claimed: int
    """Blocks bring-backs promoted that were in the pool when their turn claimed them."""
    blocks_demoted: int
    """Unclaimed blocks made the next to be evicted (stale plans, ended sessions)."""
    blocks_retired: int
    """Private blocks of sessions ended, forgotten or gone quiet made the next to go."""
    tier_blocks_retired: int
    """The same in the tiers that evict (a bounded FS tier), summed over them."""
    quiet: int
    """Times a session went quiet (still away far past its predicted return)."""
    bytes_promoted: int
    held: int
    """Slots bring-backs hold now: pins and promotions in flight."""
    running: int
    """Bring-backs live now (promoting, or holding for their turn)."""


class Session:
    """An engine's hints about one session (``OffloadScheduler.session(id)``): when a turn is
    done and what the next prompt starts with, and when the session is over. Hints are only
    hints: a wrong one costs at most the share of the pool bring-backs may hold, and a hint
    to a closed manager does nothing."""

    __slots__ = ("_id", "_owner")

    def __init__(self, owner: BringBacks, session_id: Hashable) -> None:
        self._owner = owner
        self._id = session_id

    @property
    def id(self) -> Hashable:
        return self._id

    @property
    def bring_back(self) -> PrefetchHandle | None:
        """The bring-back running for the next turn now (``await .wait()`` for the prefix it
        reached), or None when none runs: not due yet, claimed, stale or ended."""
        plan = self._owner.table.plan_of(self._id)
        return None if plan is None else self._owner.handle_of(plan)

    def turn_done(self, keys: Sequence[bytes], *, expect_back_in: float | None = None) -> None:
        """The session's turn is done; its next prompt starts with ``keys`` (the prompt so
        far and the answer, their full blocks). With ``expect_back_in`` (seconds), the
        engine knows when the next turn comes (a tool call's timeout, say); without it,
        kvtier predicts the return from the gaps it has seen. Replaces the previous turn's
        plan."""
        self._owner.turn_done(self._id, keys, expect_back_in)

    def end(self) -> None:
        """The session is over: its bring-back stops, its private blocks (those no other
        live session's prefix holds; a shared system prompt stays by use) and what was
        fetched for it and not used become the next to leave the pool, and kvtier forgets
        the session. Idempotent."""
        self._owner.end(self._id)

    def __repr__(self) -> str:
        return f"<Session {self._id!r}>"


class BringBacks:
    """A scheduler's session table and the bring-backs it plans (see the module)."""

    def __init__(self, manager: SupportsPrefetch, settings: SessionSettings) -> None:
        self.manager = manager
        self.settings = settings
        self.table = SessionTable(settings)
        self.prefetches = Prefetches(
            manager,
            share=settings.share,
            ttl=settings.forget_after,
            demote_unused=True,
            hold_found=True,
            on_freed=self._kick,
        )
        self._handles: dict[Plan, PrefetchHandle] = {}
        self._started_at: dict[Plan, float] = {}  # bring-backs whose duration is not known yet
        # Seconds a bring-back took per block it promoted, as measured (a moving estimate).
        self.seconds_per_block: float | None = None
        self._wake = anyio.Event()
        self._driving = False
        self.blocks_retired = 0
        self.tier_blocks_retired = 0

    def _now(self) -> float:
        return self.manager.cost.clock()

    # -- the engine's hints --------------------------------------------------------------------

    def turn_done(
        self, session: Hashable, keys: Sequence[bytes], expect_back_in: float | None
    ) -> None:
        keys = check_keys(keys)
        if expect_back_in is not None:
            expect_back_in = positive_number(expect_back_in, "expect_back_in")
        now = self._now()
        for plan in self.table.expire(now):
            self._stop(plan, demote=True)
        ended = self.table.turn_done(
            session, keys, now, lead=self.lead(len(keys)), expect_back_in=expect_back_in
        )
        for plan in ended:  # its own previous plan (the turn came), or a forgotten session's
            self._stop(plan, demote=plan.session != session)
        self._retire()
        self._drive_soon()

    def end(self, session: Hashable) -> None:
        plan = self.table.end(session)
        if plan is not None:
            self._stop(plan, demote=True)
            self._kick()
        self._retire()

    def _retire(self) -> None:
        """Demote the private blocks of the sessions the table let go, in the pool and in the
        tiers that evict (a bounded FS tier); the spare slots that makes wake the guesses
        waiting for some."""
        retired = self.table.take_retired()
        if retired:
            for tier in self.manager.tiers:
                self.tier_blocks_retired += tier.demote(retired)
            demoted = self.manager.pool.table.demote(retired)
            self.blocks_retired += demoted
            if demoted:
                self.prefetches.freed()

    def lead(self, blocks: int) -> float:
        """Seconds before the expected return a bring-back of ``blocks`` blocks should start:
        from the slowest tier the cost model has measured, or ``default_lead``; at least
        what bring-backs have taken per block (``seconds_per_block``); plus ``lead_slack``
        for the loop's own lateness. The cost model's per-block estimate comes from
        promotions that overlap, so it can say a block adds next to nothing, while a
        bring-back of tens of blocks behind the engine's own work takes tens of
        milliseconds: only what bring-backs took says how early to start."""
        margin = self.settings.lead_margin
        taken = self.seconds_per_block
        learnt = 0.0 if taken is None else margin * taken * blocks
        leads = [
            promotion_lead(
                blocks,
                tier.idle_latency_seconds,
                tier.queued_seconds
                if tier.queued_seconds is not None
                else tier.idle_latency_seconds,
                margin,
            )
            for tier in self.manager.cost.statistics().tiers
        ]
        model = max((lead for lead in leads if lead is not None), default=None)
        return max(model or self.settings.default_lead, learnt) + self.settings.lead_slack

    def _measure(self, now: float) -> None:
        """Learn from the bring-backs that have their answer now."""
        for plan in list(self._started_at):
            handle = self._handles.get(plan)
            if handle is not None and handle.prefix is not None:
                self._learn(plan, handle, now)

    def _learn(self, plan: Plan, handle: PrefetchHandle, now: float) -> None:
        """How long ``plan``'s bring-back took per block it promoted, into
        ``seconds_per_block``. Called also for one its turn claimed before it had its
        answer: it took at least that long, and leaving out the slow ones would teach a
        lead too short."""
        started = self._started_at.pop(plan, None)
        if started is None or not handle.prefetched:
            return
        sample = (now - started) / handle.prefetched
        taken = self.seconds_per_block
        self.seconds_per_block = (
            sample if taken is None else taken + _LEARN_WEIGHT * (sample - taken)
        )

    def handle_of(self, plan: Plan) -> PrefetchHandle | None:
        return self._handles.get(plan)

    # -- the returning turn --------------------------------------------------------------------

    def claim(self, keys: Sequence[bytes]) -> list[PrefetchHandle]:
        """A lookup of ``keys``: the sessions whose prefix it starts with have returned; their
        bring-backs stop and keep their pins until ``release``."""
        if not self._handles and not self.table.plans:
            return []
        now = self._now()
        for plan in self.table.arrived(keys, now):
            handle = self._handles.pop(plan, None)
            if handle is not None:
                self._learn(plan, handle, now)
        return self.prefetches.claim(keys)

    def release(self, claimed: list[PrefetchHandle]) -> None:
        self.prefetches.release(claimed)

    # -- the driver ----------------------------------------------------------------------------

    def _kick(self) -> None:
        self._wake.set()

    def _drive_soon(self) -> None:
        self._kick()
        if self._driving or self.table.next_wake() is None:
            return
        try:
            self.manager.run_soon(self._drive)
        except LifecycleError:  # a hint to a closed manager: nothing will act on the plans
            for plan in self.table.plans:
                self.table.end(plan.session)
            return
        self._driving = True

    def _stop(self, plan: Plan, *, demote: bool) -> None:
        self._started_at.pop(plan, None)
        handle = self._handles.pop(plan, None)
        if handle is None:
            return
        if demote:
            self.prefetches.let_go(handle)
        else:
            handle.cancel()

    def _start(self, plan: Plan, now: float) -> None:
        hold = max(plan.stale_at - now, 1e-3)
        self._handles[plan] = self.prefetches.start(
            list(plan.keys), hold, hold, guess=not plan.hinted
        )
        self._started_at[plan] = now

    async def _drive(self) -> None:
        try:
            while True:
                wake = self._wake = anyio.Event()  # a kick from now on is not lost
                now = self._now()
                self._measure(now)
                for plan in self.table.expire(now):
                    self._stop(plan, demote=True)
                self._retire()
                for plan in [p for p, h in self._handles.items() if h.done]:
                    del self._handles[plan]  # expired by its TTL, or cancelled by a close
                    self._started_at.pop(plan, None)
                scanning = [h for h in self._handles.values() if self._scanning(h)]
                for plan in self.table.due(now, self.settings.max_running - len(scanning)):
                    self._start(plan, now)
                wake_at = self.table.next_wake()
                if wake_at is None and not self._handles:
                    return
                scanning = [h for h in self._handles.values() if self._scanning(h)]
                if len(scanning) >= self.settings.max_running:
                    # due plans wait for a scan to finish, not for their (past) start time
                    later = [p.stale_at for p in self.table.plans]
                    wake_at = min(later, default=None)
                delay = math.inf if wake_at is None else max(wake_at - self._now(), 0.0)
                with anyio.move_on_after(delay):
                    await _first(wake.wait, *(h.wait for h in scanning))
        finally:
            self._driving = False

    @staticmethod
    def _scanning(handle: PrefetchHandle) -> bool:
        """Still checking and promoting (a scan waiting for the share has its answer)."""
        return handle.state is PrefetchState.RUNNING and handle.prefix is None

    # -- observation ---------------------------------------------------------------------------

    def statistics(self) -> SessionStatistics:
        table = self.table
        prefetch = self.prefetches.statistics()
        return SessionStatistics(
            sessions=len(table),
            turns=table.turns,
            hinted=table.hinted,
            gaps_seen=table.gaps_seen,
            bring_backs=table.plans_started,
            claimed=table.plans_claimed,
            stale=table.plans_stale,
            ended=table.ended,
            forgotten=table.forgotten,
            blocks_promoted=prefetch.blocks_prefetched,
            blocks_claimed=prefetch.blocks_claimed,
            blocks_demoted=self.prefetches.blocks_demoted,
            blocks_retired=self.blocks_retired,
            tier_blocks_retired=self.tier_blocks_retired,
            quiet=table.quiet,
            bytes_promoted=prefetch.bytes_prefetched,
            held=prefetch.held,
            running=len(self._handles),
        )

    def __repr__(self) -> str:
        return describe("BringBacks", stats=self.statistics(), shown="sessions running held")


async def _first(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return when the first of ``waits`` returns."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)
