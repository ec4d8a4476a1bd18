"""A kvtier tier driven from an engine's synchronous scheduler thread (engine-neutral).

Engines such as vLLM and SGLang call their storage tiers from a plain thread, under a lock,
once per scheduler step, and require every call to return at once. kvtier's tiers are async.
``TierBridge`` joins the two:

- **A private event loop thread.** The bridge starts one thread that runs an asyncio loop
  (``anyio.run``); the tier is opened, used and closed only there, and every job runs in a
  task group that thread owns. The engine thread never awaits anything.
- **Engine to loop: ``loop.call_soon_threadsafe`` only.** It appends a callback and wakes the
  loop; it never waits for the loop (anyio's ``BlockingPortal.start_task_soon`` would: it
  blocks until the loop has taken the task, a wait behind whatever the loop is doing).
- **Loop to engine: a snapshot under a lock.** The loop publishes verdicts (key present or
  not, with the reason) and finished jobs into plain containers guarded by one
  ``threading.Lock``, held only for dict and list operations. ``lookup`` reads the snapshot:
  a verdict gives ``HIT`` or ``MISS``; an unknown key is queued for the loop, which asks the
  tier's own ``lookup_with_reason()`` (where the tier's batched, coalesced existence checks
  live; a miss comes with its reason) and answers ``RETRY`` until the verdict lands. So the tier's state machine is only ever touched
  from its own loop thread, as kvtier's tiers expect.
- **Staleness.** A miss verdict expires after ``miss_ttl`` (another node may write the key to
  a shared tier); a hit stays until the tier says the key changed (its change notification
  drops the verdict), a load of it fails, or the snapshot's bound pushes it out.
- **A job is one batch call.** ``load_many``/``store_many`` with ``pinned=True`` (the slots
  stay the engine's until the outcome is out, and nothing here walks away from a job), so
  FSTier reads into and writes from the engine's memory directly, a few thread hops per
  job rather than one per block. Small jobs submitted together share a call (up to
  ``COALESCE_BLOCKS`` blocks), each still reported on its own.
- **Jobs never leave a copy half done.** ``drain`` waits for jobs, it never cancels them;
  ``close`` drains first, then closes the tier and joins the thread. A job's deadline
  (``op_timeout``) fails the blocks not done by then (``timeout``) and the batch returns only
  when nothing of it touches the engine's memory any more (a pinned batch waits for I/O in
  flight), so a finished job leaves nothing writing into the engine's memory; a block that
  failed may be partly written, and is reported failed.
- **Deadlines run from submission, opening included.** The tier opens in the background (an
  FS tier on a hung mount may never finish): a job waits for it only until its own deadline,
  and a lookup's existence check is a ``timeout`` miss ``check_timeout`` after it was asked,
  so ``drain`` returns and lookups stop answering ``RETRY`` whether or not the tier opens.
  ``close`` fails the jobs still waiting for the open (they never touched the engine's
  memory) and cuts the open short.
- **A tier's mistakes stay in its batch.** A batch call that raises, or returns a result that
  does not match its keys (a third-party tier), fails that batch's blocks as ``tier_error``;
  the loop thread and every later job go on.

Everything here is free of engine imports; the engine modules translate keys, slots and
results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

import anyio
import anyio.abc

from kvtier._errors import InvalidArgumentError
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier._validate import positive_int, positive_number
from kvtier._verdicts import MAX_CODE, PRESENT, VerdictStore
from kvtier.tiers._base import BatchResults, SecondaryTier, TierStatistics

__all__ = ["BridgeStatistics", "JobOutcome", "TierBridge"]

logger = logging.getLogger(__name__)

Operation = Literal["load", "store"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)
T = TypeVar("T")

# Reasons a lookup can be a miss besides the tier's own (``MissReason``).
CLOSED = "closed"  # the bridge was shut down, or its tier failed to open
OVERLOAD = "overload"  # too many existence checks waiting
TIER_ERROR = "tier_error"  # the tier's lookup() raised: a tier bug, counted and contained
# Bound once: an enum member read through its class costs more than a snapshot's answer.
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
# Jobs submitted together run as one batch call, up to this many blocks (a job is never split;
# a bigger batch would make the first job wait for the others).
COALESCE_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """What became of one submitted job; ``done`` holds the indices of the keys that made it."""

    job_id: int
    operation: Operation
    done: tuple[int, ...]
    total: int
    nbytes: int
    seconds: float
    failures_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return len(self.done) == self.total


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


@dataclass(slots=True)
class _Job:
    job_id: int
    operation: Operation
    keys: list[bytes]
    views: list[memoryview]
    deadline: float  # time.monotonic() at submission plus op_timeout


def _reasons(errors: BatchResults, count: int) -> list[str | None]:
    """Per key, None or the reason it failed, from a batch call's result; a result that does
    not match its ``count`` keys (a third-party tier's bug) raises: no key's fate is known."""
    if len(errors) != count:
        raise TypeError(f"the tier returned {len(errors)} results for {count} keys")
    return [None if error is None else error.reason.value for error in errors]


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
    ) -> None:
        if not isinstance(tier, SecondaryTier):
            raise InvalidArgumentError(
                f"tier must be a kvtier SecondaryTier, got {type(tier).__name__}"
            )
        positive_number(miss_ttl, "miss_ttl", " of seconds")
        positive_number(op_timeout, "op_timeout", " of seconds")
        positive_number(check_timeout, "check_timeout", " of seconds")
        positive_number(close_timeout, "close_timeout", " of seconds")
        positive_int(max_verdicts, "max_verdicts")
        positive_int(max_checks, "max_checks")
        self.tier = tier
        self.name = name
        self._miss_ttl = float(miss_ttl)
        self._op_timeout = float(op_timeout)
        self._check_timeout = float(check_timeout)
        self._close_timeout = float(close_timeout)
        self._max_verdicts = int(max_verdicts)
        self._max_checks = int(max_checks)
        self._log = BurstLogger(logger)

        # -- shared between the engine thread and the loop thread (under _lock) --------------
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0  # bumped whenever a verdict or a job lands
        self._state = "opening"  # opening -> open -> closing -> closed; or failed
        self._verdicts = VerdictStore(self._max_verdicts)  # under _lock; codes: _reason_names
        self._asking: dict[bytes, float] = {}  # unknown keys the loop has yet to ask about,
        # with the time.monotonic() they were first asked (their check's deadline runs from it)
        self._checking: set[bytes] = set()  # keys the loop has asked the tier about
        self._flush_scheduled = False
        self._finished: list[JobOutcome] = []
        self._incoming: list[_Job] = []  # submitted jobs the loop has yet to start
        self._jobs_scheduled = False  # a _start_incoming is on its way to the loop
        self._active = 0
        self._draining = 0  # threads blocked in drain()
        self._counts = {"hits": 0, "misses": 0, "retries": 0, "jobs_finished": 0}
        self._failed = {"load": 0, "store": 0}
        self._miss_reasons: dict[str, int] = {}
        # A miss verdict's code names its reason: MissReason's codes first (as ``code_of``
        # numbers them), then the bridge's own, then any other a tier counts, numbered when
        # first seen (see _code).
        self._reason_names: list[str] = ["", *(reason.value for reason in MissReason)]
        self._reason_codes = {name: code for code, name in enumerate(self._reason_names) if code}
        for name in (CLOSED, OVERLOAD, TIER_ERROR):
            self._code(name)

        # -- loop thread only -------------------------------------------------------------
        # Keys checked but without a verdict yet (the tier answered RETRY, or it is still
        # opening), each with the timer that ends its wait at its check deadline.
        self._waiting: dict[bytes, asyncio.TimerHandle] = {}
        self._opening = True  # tier.open() has not returned yet: close() cuts it short
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: contextvars.Context | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._ready: anyio.Event | None = None
        self._stop: anyio.Event | None = None

        started = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name=f"kvtier-bridge-{name}"
        )
        self._thread.start()
        if not started.wait(start_timeout):  # the loop starts in milliseconds
            raise RuntimeError(f"{name}: the kvtier loop thread did not start")
        _LIVE.add(self)

    # -- engine-facing, non-blocking ------------------------------------------------------------

    @property
    def generation(self) -> int:
        """A counter that moves whenever a verdict or a job lands (see ``wait_for_change``)."""
        return self._generation

    def lookup(self, key: bytes) -> LookupResult:
        """``HIT``, ``MISS`` or ``RETRY`` from the snapshot, without waiting."""
        schedule = False
        with self._lock:
            if self._state not in ("opening", "open"):
                return self._count_miss(CLOSED)  # a closed tier can no longer load a hit
            code = self._verdicts.get(key)
            if code is not None:
                if code == PRESENT:
                    self._counts["hits"] += 1
                    return HIT
                return self._count_miss(self._reason_names[code])
            if key not in self._asking and key not in self._checking:
                if len(self._asking) + len(self._checking) >= self._max_checks:
                    self._log.warning("overload", "%s: too many existence checks", self.name)
                    return self._count_miss(OVERLOAD)
                self._asking[key] = time.monotonic()
                if not self._flush_scheduled:
                    self._flush_scheduled = schedule = True
            self._counts["retries"] += 1
        if schedule and not self._call_soon(self._flush):
            with self._lock:
                self._asking.pop(key, None)
                return self._count_miss(CLOSED)
        return RETRY

    def submit(
        self, job_id: int, operation: Operation, keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> None:
        """Start loading ``keys`` into ``views`` (or storing ``views`` under ``keys``).

        The views must stay valid until the job's outcome is taken; the bridge drops its
        references to them before it publishes the outcome.
        """
        if operation not in OPERATIONS:  # anything else would run as a store
            raise InvalidArgumentError(
                f"operation must be one of {', '.join(map(repr, OPERATIONS))}, got {operation!r}"
            )
        if len(keys) != len(views):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} buffers")
        job = _Job(job_id, operation, list(keys), list(views), time.monotonic() + self._op_timeout)
        with self._lock:
            accepted = self._state in ("opening", "open")
            schedule = False
            if accepted:
                self._active += 1
                self._incoming.append(job)
                schedule, self._jobs_scheduled = not self._jobs_scheduled, True
        if not accepted:
            self._publish_outcome(job, (), {CLOSED: len(job.keys)}, 0.0, counted=False)
        elif schedule and not self._call_soon(self._start_incoming):
            self._start_incoming()  # the loop is gone: every queued job fails as closed

    def take_finished(self) -> list[JobOutcome]:
        """The outcomes of jobs that finished since the last call."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        """Jobs running or existence checks in flight: the engine should keep stepping."""
        with self._lock:
            return bool(self._active or self._asking or self._checking)

    def statistics(self) -> BridgeStatistics:
        tier_stats: TierStatistics | None
        try:
            tier_stats = self.tier.statistics()
        except Exception:  # a tier's statistics must never take the engine down
            tier_stats = None
        with self._lock:
            return BridgeStatistics(
                state=self._state,
                hits=self._counts["hits"],
                misses=self._counts["misses"],
                retries=self._counts["retries"],
                misses_by_reason=dict(self._miss_reasons),
                checks_in_flight=len(self._asking) + len(self._checking),
                jobs_active=self._active,
                draining=self._draining,
                jobs_finished=self._counts["jobs_finished"],
                loads_failed=self._failed["load"],
                stores_failed=self._failed["store"],
                tier=tier_stats,
            )

    # -- engine-facing, blocking ------------------------------------------------------------

    def wait_for_change(self, since: int, timeout: float) -> bool:
        """Block until ``generation`` differs from ``since`` or ``timeout`` passes.

        For engines that idle between steps (and for tests): read ``generation``, do the
        non-blocking calls, then wait here instead of polling.
        """
        with self._changed:
            return self._changed.wait_for(lambda: self._generation != since, timeout)

    def run(self, func: Callable[..., Awaitable[T]], *args: object, timeout: float = 30.0) -> T:
        """Run ``await func(*args)`` on the loop thread and return its result (blocks).

        For tools and tests that must reach the tier in its own loop (a test tier's stall
        switch, say); never from an engine's scheduler step.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def runner() -> None:
            try:
                future.set_result(await func(*args))
            except BaseException as exc:
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

        def start() -> None:
            if self._tg is None:
                future.set_exception(RuntimeError(f"{self.name}: the bridge is closed"))
            else:
                self._tg.start_soon(runner)

        if not self._call_soon(start):
            raise RuntimeError(f"{self.name}: the bridge is closed")
        return future.result(timeout)

    def drain(self, *, warn_after: float = 5.0) -> None:
        """Block until no job is running; jobs are waited for, never cancelled."""
        started = time.monotonic()
        with self._changed:
            if self._active:  # say so to whoever waits for changes (a watchdog, a test)
                self._draining += 1
                self._generation += 1
                self._changed.notify_all()
            else:
                return
            while self._active:
                if not self._changed.wait(warn_after):
                    logger.warning(
                        "%s: drain waits for %d job(s) after %.0f s",
                        self.name,
                        self._active,
                        time.monotonic() - started,
                    )
            self._draining -= 1

    def close(self) -> None:
        """Refuse new work, wait for running jobs, close the tier and join the thread."""
        with self._lock:
            if self._state in ("closing", "closed"):
                closing_elsewhere = self._state == "closing"
            else:
                closing_elsewhere = False
                self._state = "closing"
                self._asking.clear()
        if not closing_elsewhere:
            self._call_soon(self._release_jobs)  # jobs still waiting for the open fail now
            self.drain()
            self._call_soon(self._request_stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(self._close_timeout + 5.0)
        with self._lock:
            self._state = "closed"
        _LIVE.discard(self)

    # -- the loop thread --------------------------------------------------------------------

    def _thread_main(self, started: threading.Event) -> None:
        try:
            anyio.run(self._main, started, backend="asyncio")
        except BaseException:
            logger.exception("%s: the kvtier loop thread failed", self.name)
        finally:
            with self._changed:
                if self._state != "closed":
                    self._state = "closed"
                self._generation += 1
                self._changed.notify_all()
            started.set()  # never leave the constructor waiting

    async def _main(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        # Callbacks from the engine thread run in the loop's context, where anyio knows
        # which backend is running (a callback otherwise carries the engine thread's).
        self._context = contextvars.copy_context()
        self._ready = anyio.Event()
        self._stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            started.set()
            # The tier is opened and closed by this task at the same depth of cancel scopes:
            # a tier's own task group (entered by open, left by aclose) must not be wrapped
            # in another scope, so aclose is bounded by close()'s join, not by move_on_after.
            opened = False
            try:
                await self._open()  # cancelled (tg's scope) if close() comes first
                opened = True
                remove_listener = self.tier.add_listener(self._on_tier_change)
                try:
                    await self._stop.wait()
                finally:
                    remove_listener()
            finally:
                self._tg = None
                if opened:
                    await self.tier.aclose()
                else:
                    # close() cut the open short: nothing of the tier's was entered at this
                    # depth, so its clean-up may run shielded, and bounded (a hung mount).
                    with anyio.move_on_after(self._close_timeout, shield=True):
                        await self.tier.aclose()
            tg.cancel_scope.cancel()  # only timers are left: close() drained the jobs

    async def _open(self) -> None:
        assert self._ready is not None
        try:
            await self.tier.open()
        except Exception:
            logger.exception("%s: the tier did not open; it answers misses", self.name)
            state = "failed"
        else:
            state = "open"
        finally:
            self._opening = False
        with self._changed:
            if self._state == "opening":
                self._state = state
            self._generation += 1
            self._changed.notify_all()
            state = self._state
        self._ready.set()
        for key in list(self._waiting):  # keys asked while the tier opened, deadlines kept
            if state == "open":
                self._ask(key)
            else:
                self._verdict(key, False, CLOSED)
        self._flush()

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._opening and self._tg is not None:  # the tier may never open (a hung mount)
            self._tg.cancel_scope.cancel()

    def _release_jobs(self) -> None:
        """The bridge is closing: jobs still waiting for the tier to open fail as closed
        (they have not touched the engine's memory), so ``drain`` need not wait for them."""
        if self._ready is not None:
            self._ready.set()

    def _call_soon(self, callback: Callable[..., object], *args: object) -> bool:
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(callback, *args, context=self._context)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _flush(self) -> None:
        """Ask the tier about every queued key (runs on the loop thread); while it opens,
        start each key's check deadline and ask once it has opened (see ``_open``)."""
        with self._lock:
            asked = list(self._asking.items())
            self._asking.clear()
            self._flush_scheduled = False
            self._checking.update(key for key, _ in asked)
            state = self._state
        for key, since in asked:
            if state == "open":
                self._ask(key, since)
            elif state == "opening":
                self._wait(key, since)
            else:
                self._verdict(key, False, CLOSED)

    def _wait(self, key: bytes, since: float) -> None:
        """Wait for a verdict on ``key`` until ``check_timeout`` after ``since``; a tier that
        forgets to notify is asked once more then, and after that the key is a miss."""
        if key not in self._waiting:
            assert self._loop is not None
            delay = max(0.0, since + self._check_timeout - time.monotonic())
            self._waiting[key] = self._loop.call_later(delay, self._check_expired, key)

    def _ask(self, key: bytes, since: float | None = None, *, final: bool = False) -> None:
        try:
            result, reason = self.tier.lookup_with_reason(key)
        except Exception as exc:  # a malformed answer too: a tier bug, contained
            self._log.warning("lookup", "%s: tier lookup raised: %r", self.name, exc)
            self._verdict(key, False, TIER_ERROR)
            return
        if result is LookupResult.RETRY and final:
            self._verdict(key, False, MissReason.TIMEOUT.value)
        elif result is LookupResult.RETRY:
            # The tier notifies when its check lands (see _on_tier_change).
            self._wait(key, time.monotonic() if since is None else since)
        elif result is LookupResult.HIT:
            self._verdict(key, True, "")
        else:
            self._verdict(key, False, str(reason or MissReason.NOT_FOUND))

    def _check_expired(self, key: bytes) -> None:
        if self._waiting.pop(key, None) is None:
            return
        if self._state == "opening":  # the tier has not opened within the check's deadline
            self._verdict(key, False, MissReason.TIMEOUT.value)
        else:
            self._ask(key, final=True)

    def _on_tier_change(self, key: bytes) -> None:
        """The tier says ``key``'s answer may have changed (runs on the loop thread)."""
        if key in self._waiting:
            self._ask(key)  # still RETRY: the wait goes on to its first deadline
            return
        with self._changed:
            if self._verdicts.forget(key):
                self._generation += 1
                self._changed.notify_all()

    def _verdict(self, key: bytes, present: bool, reason: str) -> None:
        timer = self._waiting.pop(key, None)
        if timer is not None:
            timer.cancel()
        with self._changed:
            self._checking.discard(key)
            if present:
                self._verdicts.set(key, PRESENT, math.inf)
            else:
                self._verdicts.set(key, self._code(reason), self._miss_ttl)
            self._generation += 1
            self._changed.notify_all()

    def _start_incoming(self) -> None:
        """Start the jobs submitted since the last call (on the loop thread; on the engine's
        only when the loop is gone). Jobs queue while the loop is busy and wake it once, so a
        burst of one-block jobs costs a few batch calls and wake-ups, not one per block."""
        with self._lock:
            queued, self._incoming = self._incoming, []
            self._jobs_scheduled = False
        if self._tg is None or threading.current_thread() is not self._thread:
            for job in queued:  # the loop is stopping: nothing can run the jobs
                self._publish_outcome(job, (), {CLOSED: len(job.keys)}, 0.0, counted=True)
            return
        group: list[_Job] = []
        for job in queued:
            if group and (
                job.operation != group[0].operation
                or sum(len(j.keys) for j in group) + len(job.keys) > COALESCE_BLOCKS
            ):
                self._tg.start_soon(self._run_jobs, group)
                group = []
            group.append(job)
        if group:
            self._tg.start_soon(self._run_jobs, group)

    async def _run_jobs(self, jobs: list[_Job]) -> None:
        """Run ``jobs`` (one operation) as one batch call and publish each job's outcome."""
        assert self._ready is not None
        started = time.perf_counter()
        keys = [k for job in jobs for k in job.keys]
        errors: list[str | None] = [CLOSED] * len(keys)
        deadline = min(job.deadline for job in jobs)  # jobs that share a call, share the first
        try:
            if not self._ready.is_set():  # the tier is still opening (it may never open)
                with anyio.move_on_after(deadline - time.monotonic()):
                    await self._ready.wait()
            if not self._ready.is_set():
                errors = [MissReason.TIMEOUT.value] * len(keys)
            elif self._state == "open":
                errors = await self._run_batch(jobs[0].operation, keys, jobs, deadline)
        finally:
            seconds = time.perf_counter() - started
            first = 0
            for job in jobs:
                mine = errors[first : first + len(job.keys)]
                first += len(job.keys)
                reasons: dict[str, int] = {}
                for reason in mine:
                    if reason is not None:
                        reasons[reason] = reasons.get(reason, 0) + 1
                done = tuple(i for i, reason in enumerate(mine) if reason is None)
                self._publish_outcome(job, done, reasons, seconds, counted=True)

    async def _run_batch(
        self, operation: Operation, keys: list[bytes], jobs: list[_Job], deadline: float
    ) -> list[str | None]:
        """One batch call, bounded by what is left of ``deadline``; per key, None or the
        reason it failed. ``pinned``: the engine keeps the slots until the job's outcome is
        out and this bridge waits for every job (``drain``), so the tier may read into and
        write from them directly."""
        left = deadline - time.monotonic()
        if left <= 0:
            return [MissReason.TIMEOUT.value] * len(keys)
        views = [v for job in jobs for v in job.views]
        call = self.tier.load_many if operation == "load" else self.tier.store_many
        try:
            reasons = _reasons(await call(keys, views, timeout=left, pinned=True), len(keys))
        except Exception as exc:  # a tier bug must not take the engine down
            self._log.warning(operation, "%s: %s failed: %r", self.name, operation, exc)
            if operation == "load":
                for key in keys:
                    self._verdict(key, False, TIER_ERROR)
            return [TIER_ERROR] * len(keys)
        for key, reason in zip(keys, reasons, strict=True):
            if operation == "load" and reason is not None:
                self._verdict(key, False, reason)
            elif operation == "store" and reason is None:
                self._verdict(key, True, "")
        return reasons

    def _publish_outcome(
        self,
        job: _Job,
        done: tuple[int, ...],
        reasons: dict[str, int],
        seconds: float,
        *,
        counted: bool,
    ) -> None:
        nbytes = sum(job.views[i].nbytes for i in done)
        for view in job.views:  # the engine may free its buffer once the outcome is out
            with contextlib.suppress(BufferError):
                view.release()
        job.views.clear()
        outcome = JobOutcome(
            job.job_id, job.operation, done, len(job.keys), nbytes, seconds, dict(reasons)
        )
        with self._changed:
            if counted:
                self._active -= 1
            if not outcome.success:
                self._failed[job.operation] += 1
            self._counts["jobs_finished"] += 1
            self._finished.append(outcome)
            self._generation += 1
            self._changed.notify_all()

    # -- helpers ------------------------------------------------------------------------------

    def _code(self, reason: str) -> int:
        """The verdict code of a miss for ``reason`` (under the lock); a new name gets the next
        code while there is one, then counts as ``not_found`` (codes are a few bits of an int)."""
        code = self._reason_codes.get(reason)
        if code is None:
            if len(self._reason_names) > MAX_CODE:
                self._log.warning("reasons", "%s: too many miss reasons: %r", self.name, reason)
                return self._reason_codes[MissReason.NOT_FOUND.value]
            code = self._reason_codes[reason] = len(self._reason_names)
            self._reason_names.append(reason)
        return code

    def _count_miss(self, reason: str) -> LookupResult:
        self._counts["misses"] += 1
        self._miss_reasons[reason] = self._miss_reasons.get(reason, 0) + 1
        return MISS

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"<TierBridge {self.name!r} state={self._state} tier={self.tier.name!r} "
                f"verdicts={len(self._verdicts)} checks={len(self._asking) + len(self._checking)} "
                f"jobs={self._active}>"
            )
