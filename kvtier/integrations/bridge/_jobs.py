"""The bridge's jobs: from submission to outcome, each a batch call on the tier.

A job is one ``load_many``/``store_many`` with ``pinned=True`` (the slots stay the engine's
until the outcome is out, and nothing here walks away from a job), so FSTier reads into and
writes from the engine's memory directly, a few thread hops per job rather than one per block.
Jobs queue while the loop thread is busy and wake it once; small jobs submitted together share
a call (up to ``COALESCE_BLOCKS`` blocks), each still reported on its own.

- **Never a copy half done.** ``drain`` waits for jobs, it never cancels them. A job's
  deadline (``op_timeout``, from submission, a tier still opening included) fails the blocks
  not done by then (``timeout``), and the batch returns only when nothing of it touches the
  engine's memory any more (a pinned batch waits for I/O in flight); a block that failed may
  be partly written, and is reported failed.
- **A tier's mistakes stay in its batch.** A batch call that raises, or returns a result that
  does not match its keys (a third-party tier), fails that batch's blocks as ``tier_error``;
  the loop thread and every later job go on.
- **Outcomes feed the snapshot.** A load that failed makes its key a miss with that reason,
  so the engine does not promote it again at once; a store that landed makes it a hit.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import anyio

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._lookup import MissReason
from kvtier.integrations.bridge._answers import LookupSnapshot
from kvtier.integrations.bridge._shared import ACCEPTING, CLOSED, TIER_ERROR, Shared
from kvtier.tiers._base import BatchResults

__all__ = ["OPERATIONS", "JobOutcome", "Jobs", "Operation"]

logger = logging.getLogger(__name__)

Operation = Literal["load", "store"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)
TIMEOUT = MissReason.TIMEOUT.value
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
    runnable: bool = True  # False: rejected at submission, it never ran

    @property
    def success(self) -> bool:
        return self.runnable and len(self.done) == self.total


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


class Jobs:
    """Submitted jobs, run as batch calls on the loop thread, and their outcomes.

    ``submit``, ``take_finished`` and ``drain`` are for engine threads; the rest runs on the
    loop thread. ``start`` makes the event that jobs wait on while the tier opens, ``release``
    sets it (the open ended, or the bridge is closing).
    """

    def __init__(self, shared: Shared, snapshot: LookupSnapshot, *, op_timeout: float) -> None:
        self._shared = shared
        self._snapshot = snapshot
        self._op_timeout = op_timeout
        # -- under shared.lock ----------------------------------------------------------------
        self._incoming: list[_Job] = []  # submitted jobs the loop has yet to start
        self._scheduled = False  # a _start_incoming is on its way to the loop
        self._finished: list[JobOutcome] = []
        self.active = 0
        self.draining = 0  # threads blocked in drain()
        self.finished = 0
        self.failed = {"load": 0, "store": 0}
        # -- loop thread only -----------------------------------------------------------------
        self._ready: anyio.Event | None = None
        # Told the keys of each store job that landed whole, just before its outcome is out.
        self.on_stored: Callable[[list[bytes]], None] | None = None

    # -- engine threads ---------------------------------------------------------------------

    def submit(
        self, job_id: int, operation: Operation, keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> None:
        """Queue a job for the loop thread; the views must stay valid until its outcome is
        taken (the outcome is published after the last reference to them is dropped)."""
        if operation not in OPERATIONS:  # anything else would run as a store
            raise InvalidArgumentError(
                f"operation must be one of {', '.join(map(repr, OPERATIONS))}, got {operation!r}"
            )
        if len(keys) != len(views):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} buffers")
        job = _Job(job_id, operation, list(keys), list(views), time.monotonic() + self._op_timeout)
        with self._shared.lock:
            accepted = self._shared.state in ACCEPTING
            schedule = False
            if accepted:
                self.active += 1
                self._incoming.append(job)
                schedule, self._scheduled = not self._scheduled, True
        if not accepted:
            self._publish(job, (), {CLOSED: len(job.keys)}, 0.0, counted=False)
        elif schedule and not self._shared.thread.call_soon(self._start_incoming):
            self._start_incoming()  # the loop is gone: every queued job fails as closed

    def reject(self, job_id: int, operation: Operation, count: int, reason: str) -> None:
        """Report a job that cannot run (it names memory outside the engine's buffer, say)
        as failed, in its turn with the others, without touching the tier."""
        job = _Job(job_id, operation, [b""] * count, [], 0.0)
        self._publish(job, (), {reason: count} if count else {}, 0.0, counted=False, ok=False)

    def take_finished(self) -> list[JobOutcome]:
        """The outcomes of jobs that finished since the last call."""
        with self._shared.lock:
            done, self._finished = self._finished, []
        return done

    def drain(self, *, warn_after: float) -> None:
        """Block until no job is running; jobs are waited for, never cancelled."""
        started = time.monotonic()
        shared = self._shared
        with shared.changed:
            if not self.active:
                return
            self.draining += 1  # say so to whoever waits for changes (a watchdog, a test)
            shared.landed()
            while self.active:
                if not shared.changed.wait(warn_after):
                    logger.warning(
                        "%s: drain waits for %d job(s) after %.0f s",
                        self._shared.name,
                        self.active,
                        time.monotonic() - started,
                    )
            self.draining -= 1

    # -- the loop thread --------------------------------------------------------------------

    def start(self) -> None:
        """The loop runs: jobs from now on wait for the tier's open (until ``release``)."""
        self._ready = anyio.Event()

    def release(self) -> None:
        """The tier's open ended, or the bridge is closing: jobs waiting for the open go on
        (to their batch, or to fail as closed, never having touched the engine's memory)."""
        if self._ready is not None:
            self._ready.set()

    def _start_incoming(self) -> None:
        """Start the jobs submitted since the last call (on the loop thread; on the engine's
        only when the loop is gone). Jobs queue while the loop is busy and wake it once, so a
        burst of one-block jobs costs a few batch calls and wake-ups, not one per block."""
        with self._shared.lock:
            queued, self._incoming = self._incoming, []
            self._scheduled = False
        tg = self._shared.thread.task_group
        if tg is None or not self._shared.thread.on_thread():
            for job in queued:  # the loop is stopping: nothing can run the jobs
                self._publish(job, (), {CLOSED: len(job.keys)}, 0.0, counted=True)
            return
        group: list[_Job] = []
        for job in queued:
            if group and (
                job.operation != group[0].operation
                or sum(len(j.keys) for j in group) + len(job.keys) > COALESCE_BLOCKS
            ):
                tg.start_soon(self._run, group)
                group = []
            group.append(job)
        if group:
            tg.start_soon(self._run, group)

    async def _run(self, jobs: list[_Job]) -> None:
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
                errors = [TIMEOUT] * len(keys)
            elif self._shared.state == "open":
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
                self._publish(job, done, reasons, seconds, counted=True)

    async def _run_batch(
        self, operation: Operation, keys: list[bytes], jobs: list[_Job], deadline: float
    ) -> list[str | None]:
        """One batch call, bounded by what is left of ``deadline``; per key, None or the
        reason it failed. ``pinned``: the engine keeps the slots until the job's outcome is
        out and the bridge waits for every job (``drain``), so the tier may read into and
        write from them directly."""
        left = deadline - time.monotonic()
        if left <= 0:
            return [TIMEOUT] * len(keys)
        views = [v for job in jobs for v in job.views]
        call = self._shared.tier.load_many if operation == "load" else self._shared.tier.store_many
        try:
            reasons = _reasons(await call(keys, views, timeout=left, pinned=True), len(keys))
        except Exception as exc:  # a tier bug must not take the engine down
            self._shared.log.warning(
                operation, "%s: %s failed: %r", self._shared.name, operation, exc
            )
            if operation == "load":
                for key in keys:
                    self._snapshot.verdict(key, False, TIER_ERROR)
            return [TIER_ERROR] * len(keys)
        for key, reason in zip(keys, reasons, strict=True):
            if operation == "load" and reason is not None:
                self._snapshot.verdict(key, False, reason)
            elif operation == "store" and reason is None:
                self._snapshot.verdict(key, True, "")
        return reasons

    def _publish(
        self,
        job: _Job,
        done: tuple[int, ...],
        reasons: dict[str, int],
        seconds: float,
        *,
        counted: bool,
        ok: bool = True,
    ) -> None:
        nbytes = sum(job.views[i].nbytes for i in done)
        for view in job.views:  # the engine may free its buffer once the outcome is out
            with contextlib.suppress(BufferError):
                view.release()
        job.views.clear()
        outcome = JobOutcome(
            job.job_id, job.operation, done, len(job.keys), nbytes, seconds, dict(reasons), ok
        )
        if counted and outcome.success and job.operation == "store" and self.on_stored:
            self.on_stored(job.keys)
        with self._shared.changed:
            if counted:
                self.active -= 1
            if not outcome.success:
                self.failed[job.operation] += 1
            self.finished += 1
            self._finished.append(outcome)
            self._shared.landed()
