"""A kvtier tier driven from an engine's synchronous scheduler thread (engine-neutral).

Engines such as vLLM and SGLang call their storage tiers from a plain thread, under a lock,
once per scheduler step, and require every call to return at once. kvtier's tiers are async.
``TierBridge`` joins the two, in four parts:

- **A private event loop thread** (``_loop.LoopThread``). The tier is opened, used and closed
  only there, and every job runs in a task group that thread owns. The engine thread never
  awaits anything: it reaches the loop with ``loop.call_soon_threadsafe`` only.
- **Loop to engine: a snapshot under a lock** (``_shared.Shared``). The loop publishes
  verdicts and finished jobs into plain containers guarded by one ``threading.Lock``, held
  only for dict and list operations.
- **Lookups** (``_snapshot.LookupSnapshot``): a verdict gives ``HIT`` or ``MISS``, an unknown
  key is asked of the tier's ``lookup_with_reason()`` on the loop and answers ``RETRY`` until
  its verdict lands; misses expire after ``miss_ttl``.
- **Jobs** (``_jobs.Jobs``): each is one pinned batch call (``load_many``/``store_many``),
  small jobs submitted together share one; ``drain`` waits for jobs, never cancels them; a
  job's deadline (``op_timeout``) fails the blocks not done by then; a tier's mistakes fail
  only their batch.

**Events, in order** (``take_events``, off unless ``events`` is given a capacity): a store job
that landed whole is one stored event, recorded on the loop thread just before its outcome,
after whatever the tier reported before it (its removals, its REMOTE blocks); the tier's own
stored events for the bridge's jobs are not repeated. Bounded: past ``events`` keys, events are
dropped and counted.

**Deadlines run from submission, opening included.** The tier opens in the background (an FS
tier on a hung mount may never finish): a job waits for it only until its own deadline, and a
lookup's existence check is a ``timeout`` miss ``check_timeout`` after it was asked, so
``drain`` returns and lookups stop answering ``RETRY`` whether or not the tier opens.
``close`` drains, fails the jobs still waiting for the open (they never touched the engine's
memory), cuts the open short, closes the tier and joins the thread.

Everything here is free of engine imports; the engine modules translate keys, slots and
results.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio

from kvtier.common._arguments import check_type, positive_int, positive_number
from kvtier.common._events import EventBuffer, EventKind, TierEvent
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import LookupResult
from kvtier.integrations.bridge._answers import LookupSnapshot
from kvtier.integrations.bridge._jobs import JobOutcome, Jobs, Operation
from kvtier.integrations.bridge._loop import LoopThread
from kvtier.integrations.bridge._shared import Shared
from kvtier.tiers._base import SecondaryTier, TierStatistics

__all__ = ["BridgeStatistics", "JobOutcome", "TierBridge"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BridgeStatistics:
    """The engine-facing answers and the jobs, beside the tier's own statistics."""

    state: str
    hits: int
    misses: int
    retries: int
    misses_by_reason: dict[str, int]
    checks_in_flight: int
    jobs_active: int
    draining: int
    jobs_finished: int
    loads_failed: int
    stores_failed: int
    tier: TierStatistics | None


# Bridges still open when the interpreter exits are closed before threads are joined, so an
# engine that never called shutdown() does not hang its own exit on our loop thread.
_LIVE: weakref.WeakSet[TierBridge] = weakref.WeakSet()


def _close_live_bridges() -> None:
    for bridge in list(_LIVE):
        with contextlib.suppress(Exception):
            bridge.close()


# threading._register_atexit runs before non-daemon threads are joined (atexit runs after).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_live_bridges)


class TierBridge:
    """One kvtier ``SecondaryTier`` behind synchronous calls that never wait (see module doc).

    ``lookup``, ``submit``, ``take_finished`` and ``statistics`` return at once; ``drain``
    and ``close`` block, as engines allow for those. The tier is opened in the background:
    until it is, lookups answer ``RETRY`` and jobs wait in the loop, each only until its
    deadline (``check_timeout``, ``op_timeout``), counted from when it was asked.
    """

    def __init__(
        self,
        tier: SecondaryTier,
        *,
        name: str = "kvtier",
        miss_ttl: float = 2.0,
        op_timeout: float = 60.0,
        check_timeout: float = 10.0,
        close_timeout: float = 10.0,
        max_verdicts: int = 1_000_000,
        max_checks: int = 100_000,
        start_timeout: float = 30.0,
        events: int = 0,
    ) -> None:
        check_type(tier, SecondaryTier, "tier must be a kvtier SecondaryTier")
        for seconds, label in (
            (miss_ttl, "miss_ttl"),
            (op_timeout, "op_timeout"),
            (check_timeout, "check_timeout"),
            (close_timeout, "close_timeout"),
        ):
            positive_number(seconds, label, " of seconds")
        self.tier = tier
        self.name = name
        self._close_timeout = float(close_timeout)
        self._thread = LoopThread(name, self._serve, self._thread_ended)
        self._shared = Shared(tier, self._thread, BurstLogger(logger))
        self._snapshot = LookupSnapshot(
            self._shared,
            miss_ttl=float(miss_ttl),
            check_timeout=float(check_timeout),
            max_verdicts=positive_int(max_verdicts, "max_verdicts"),
            max_checks=positive_int(max_checks, "max_checks"),
        )
        self._jobs = Jobs(self._shared, self._snapshot, op_timeout=float(op_timeout))
        # Events, in the order they happened (``take_events``); off when ``events`` is 0.
        self.events = EventBuffer(name, events)
        self._events_lock = threading.Lock()  # one mover of the tier's events at a time
        if events:
            self._jobs.on_stored = self._stored
        self.open_error: BaseException | None = None  # why the tier did not open
        # -- loop thread only -------------------------------------------------------------
        self._opening = True  # tier.open() has not returned yet: close() cuts it short
        self._stop: anyio.Event | None = None
        self._thread.start(start_timeout)
        _LIVE.add(self)

    # -- engine-facing, non-blocking ------------------------------------------------------------

    @property
    def generation(self) -> int:
        """A counter that moves whenever a verdict or a job lands (see ``wait_for_change``)."""
        return self._shared.generation

    def lookup(self, key: bytes) -> LookupResult:
        """``HIT``, ``MISS`` or ``RETRY`` from the snapshot, without waiting."""
        return self._snapshot.lookup(key)

    def submit(
        self, job_id: int, operation: Operation, keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> None:
        """Start loading ``keys`` into ``views`` (or storing ``views`` under ``keys``).

        The views must stay valid until the job's outcome is taken; the bridge drops its
        references to them before it publishes the outcome.
        """
        self._jobs.submit(job_id, operation, keys, views)

    def reject(self, job_id: int, operation: Operation, count: int, reason: str) -> None:
        """Report job ``job_id`` of ``count`` keys failed for ``reason`` without running it
        (its outcome comes out of ``take_finished`` like any other)."""
        self._jobs.reject(job_id, operation, count, reason)

    def take_finished(self) -> list[JobOutcome]:
        """The outcomes of jobs that finished since the last call."""
        return self._jobs.take_finished()

    def take_events(self) -> list[TierEvent]:
        """What the tier stored and removed since the last call, oldest first (empty while
        events are off). A store job that landed whole is one stored event with its keys,
        told just before its outcome; the tier's own stored events for those blocks are not
        repeated; its removals (evicted, corrupt, found gone) and its REMOTE blocks are."""
        if not self.events.enabled:
            return []
        self._pull_tier_events()
        return self.events.drain()

    def _stored(self, keys: list[bytes]) -> None:
        """A store job landed whole (loop thread): what the tier said before it comes first."""
        self._pull_tier_events()
        self.events.emit(EventKind.STORED, keys)

    def _pull_tier_events(self) -> None:
        tier_events = getattr(self.tier, "events", None)
        if not isinstance(tier_events, EventBuffer):
            return
        with self._events_lock:
            for event in tier_events.drain():
                if event.kind is EventKind.STORED and event.locality == "LOCAL":
                    continue  # this bridge's own store jobs: told per job
                self.events.emit(
                    event.kind,
                    event.keys,
                    locality=event.locality,
                    reason=event.reason,
                    medium=event.medium,
                )

    def wait_open(self, timeout: float) -> BaseException | None:
        """Block until the tier's open ended or ``timeout`` passed; the exception the open
        raised, if it did (None while it is still opening: a hung mount never blocks)."""
        shared = self._shared
        with shared.changed:
            shared.changed.wait_for(lambda: shared.state != "opening", timeout)
        return self.open_error

    def has_pending_work(self) -> bool:
        """Jobs running or existence checks in flight: the engine should keep stepping."""
        with self._shared.lock:
            return bool(self._jobs.active or self._snapshot.checks)

    def statistics(self) -> BridgeStatistics:
        tier_stats: TierStatistics | None
        try:
            tier_stats = self.tier.statistics()
        except Exception:  # a tier's statistics must never take the engine down
            tier_stats = None
        snapshot, jobs = self._snapshot, self._jobs
        with self._shared.lock:
            return BridgeStatistics(
                state=self._shared.state,
                hits=snapshot.hits,
                misses=snapshot.misses,
                retries=snapshot.retries,
                misses_by_reason=dict(snapshot.miss_reasons),
                checks_in_flight=snapshot.checks,
                jobs_active=jobs.active,
                draining=jobs.draining,
                jobs_finished=jobs.finished,
                loads_failed=jobs.failed["load"],
                stores_failed=jobs.failed["store"],
                tier=tier_stats,
            )

    # -- engine-facing, blocking ------------------------------------------------------------

    def wait_for_change(self, since: int, timeout: float) -> bool:
        """Block until ``generation`` differs from ``since`` or ``timeout`` passes.

        For engines that idle between steps (and for tests): read ``generation``, do the
        non-blocking calls, then wait here instead of polling.
        """
        shared = self._shared
        with shared.changed:
            return shared.changed.wait_for(lambda: shared.generation != since, timeout)

    def run(self, func: Callable[..., Awaitable[T]], *args: object, timeout: float = 30.0) -> T:
        """Run ``await func(*args)`` on the loop thread and return its result (blocks).

        For tools and tests that must reach the tier in its own loop (a test tier's stall
        switch, say); never from an engine's scheduler step.
        """
        return self._thread.run(func, *args, timeout=timeout)

    def drain(self, *, warn_after: float = 5.0) -> None:
        """Block until no job is running; jobs are waited for, never cancelled."""
        self._jobs.drain(warn_after=warn_after)

    def close(self) -> None:
        """Refuse new work, wait for running jobs, close the tier and join the thread."""
        shared = self._shared
        with shared.lock:
            if shared.state in ("closing", "closed"):
                closing_elsewhere = shared.state == "closing"
            else:
                closing_elsewhere = False
                shared.state = "closing"
                self._snapshot.stop_asking()
        if not closing_elsewhere:
            self._thread.call_soon(self._jobs.release)  # jobs waiting for the open fail now
            self.drain()
            self._thread.call_soon(self._request_stop)
        self._thread.join(self._close_timeout + 5.0)
        with shared.lock:
            shared.state = "closed"
        _LIVE.discard(self)

    # -- the loop thread --------------------------------------------------------------------

    async def _serve(self) -> None:
        """The loop thread's body: open the tier, serve until ``close``, close the tier.

        The tier is opened and closed by this task at the same depth of cancel scopes: a
        tier's own task group (entered by open, left by aclose) must not be wrapped in
        another scope, so aclose is bounded by close()'s join, not by move_on_after.
        """
        self._stop = anyio.Event()
        self._jobs.start()
        opened = False
        try:
            await self._open()  # cancelled (the task group's scope) if close() comes first
            opened = True
            remove_listener = self.tier.add_listener(self._snapshot.on_tier_change)
            try:
                await self._stop.wait()
            finally:
                remove_listener()
        finally:
            self._thread.detach()
            if opened:
                await self.tier.aclose()
            else:
                # close() cut the open short: nothing of the tier's was entered at this
                # depth, so its clean-up may run shielded, and bounded (a hung mount).
                with anyio.move_on_after(self._close_timeout, shield=True):
                    await self.tier.aclose()

    async def _open(self) -> None:
        try:
            await self.tier.open()
        except Exception as exc:
            logger.exception("%s: the tier did not open; it answers misses", self.name)
            self.open_error = exc
            state = "failed"
        else:
            state = "open"
        finally:
            self._opening = False
        shared = self._shared
        with shared.changed:
            if shared.state == "opening":
                shared.state = state
            shared.landed()
            state = shared.state
        self._jobs.release()
        self._snapshot.opened(state)

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._opening:  # the tier may never open (a hung mount)
            self._thread.cancel()

    def _thread_ended(self) -> None:
        with self._shared.changed:
            self._shared.state = "closed"
            self._shared.landed()

    def __repr__(self) -> str:
        with self._shared.lock:
            return (
                f"<TierBridge {self.name!r} state={self._shared.state} tier={self.tier.name!r} "
                f"verdicts={len(self._snapshot)} checks={self._snapshot.checks} "
                f"jobs={self._jobs.active}>"
            )
