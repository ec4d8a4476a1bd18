"""Blocking file-system calls that a deadline can walk away from.

A hung mount (NFS with a dead server, a failing disk) can block a syscall for minutes. If the
caller awaited such a call in a thread it cannot abandon, every deadline above it (the lookup,
promotion, store and close timeouts) would wait for the syscall. So each ``FSTier`` operation
runs in an *abandonable* worker thread: a cancelled caller returns at once and the thread
finishes (or hangs) on its own.

Two things make that safe:

- **The caller's memory is touched only inside ``Handoff.touching()``**, a short critical
  section (one memcpy, no syscall) guarded by a per-call lock. A caller that gives up takes
  the same lock to mark the call abandoned, so it waits at most for a memcpy in flight, never
  for a syscall, and once it has returned the thread never touches its memory again: a read
  lands in a private buffer and is copied into the pool slot in ``touching()``; a write copies
  the slot into a private buffer in ``touching()`` first and writes from that copy. (One
  thread hop per operation, not two: the copy cannot hang, so it needs no thread of its own.)
  Two kinds of caller opt out, so the bytes move with no copy: a pinned batch waits for its
  thread whatever happens (``abandon=False``), and a lent one (``kvtier.common._lending``) keeps
  each buffer its abandoned thread may still write out of use until that thread returns.
- **Abandoned threads are bounded.** Each one still holds an OS thread. Past
  ``max_abandoned`` still running, new calls fail at once (``Stuck``) instead of starting more
  threads into a hung mount; as the stuck calls return, the tier recovers by itself.

An abandoned call that later finishes can hand its outcome to ``on_late``; those callbacks are
queued and run on the event loop by ``drain_late()``, so the tier's bookkeeping (capacity,
index) stays single-threaded.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import anyio
import numpy as np

from kvtier.common._threads import run_sync

__all__ = ["Abandoned", "BufferPool", "Handoff", "OnLate", "Stuck", "WorkerCalls", "copy_bytes"]

T = TypeVar("T")
OnLate = Callable[[T | None, BaseException | None], None]


class Stuck(Exception):
    """Too many abandoned calls are still running: the file system looks hung."""


class Abandoned(Exception):
    """Raised in a worker thread that tries to touch the memory of a caller that has gone."""


class Handoff:
    """What one worker thread shares with the caller awaiting it."""

    __slots__ = ("_abandoned", "_done", "_lock", "_started", "result")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = self._done = self._abandoned = False
        # What the call returned, kept even when the caller was cancelled just as it finished
        # (its outcome is real and must still be accounted for).
        self.result: object = None

    @property
    def started(self) -> bool:
        """The thread began the call (it may have touched the file system)."""
        return self._started

    @property
    def abandoned(self) -> bool:
        """The caller gave up (read it under ``holding()`` to act on it)."""
        return self._abandoned

    @property
    def left_running(self) -> bool:
        """The caller gave up while the thread was still running it."""
        return self._abandoned and self._started

    def holding(self) -> threading.Lock:
        """The call's lock (``with call.holding():``), for sharing state with the thread
        without racing it; the lock itself, since a batch takes it twice per block."""
        return self._lock

    @contextlib.contextmanager
    def touching(self) -> Iterator[None]:
        """Hold while reading or writing the caller's memory; raises ``Abandoned`` when the
        caller has gone (then its memory may already be reused)."""
        with self._lock:
            if self._abandoned:
                raise Abandoned
            yield


class WorkerCalls(Generic[T]):
    """Runs ``fn(handoff)`` in abandonable worker threads; see the module docstring."""

    def __init__(self, max_abandoned: int) -> None:
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._unstuck = threading.Condition(self._lock)
        self._running_abandoned = 0
        self.abandoned_total = 0
        self._late: deque[Callable[[], None]] = deque()
        self._when_unstuck: list[Callable[[], None]] = []  # run once none is running

    @property
    def stuck(self) -> int:
        """Abandoned calls whose thread is still running."""
        return self._running_abandoned

    async def run(
        self,
        fn: Callable[[Handoff], T],
        *,
        limiter: anyio.CapacityLimiter,
        on_late: OnLate[T] | None = None,
        handoff: Handoff | None = None,
        abandon: bool = True,
    ) -> T:
        """``fn(handoff)`` in a worker thread. With ``abandon=False`` a cancelled caller waits
        for the thread to finish (for callers whose memory the thread uses directly)."""
        if self._running_abandoned >= self.max_abandoned:
            raise Stuck(
                f"{self._running_abandoned} file-system calls abandoned at their deadline "
                "are still running"
            )
        call = Handoff() if handoff is None else handoff

        def work() -> T | None:
            with call._lock:
                if call._abandoned:  # the caller left before the thread started
                    return None
                call._started = True
            result: T | None = None
            error: BaseException | None = None
            try:
                result = call.result = fn(call)
            except BaseException as exc:
                error = exc
                raise
            finally:
                with call._lock:
                    call._done = True
                    if call._abandoned:
                        if on_late is not None:
                            self._late.append(lambda: on_late(result, error))
                        with self._lock:
                            self._running_abandoned -= 1
                            if self._running_abandoned == 0:
                                unstuck, self._when_unstuck = self._when_unstuck, []
                                for callback in unstuck:  # before a waiter sees none stuck
                                    callback()
                            self._unstuck.notify_all()
            return result

        try:
            result = await run_sync(work, limiter=limiter, abandon_on_cancel=abandon)
        except BaseException:
            with call._lock:  # waits at most for a memcpy inside ``touching()``
                if not call._done:
                    call._abandoned = True
                    if call._started:
                        with self._lock:
                            self._running_abandoned += 1
                            self.abandoned_total += 1
            raise
        return result  # type: ignore[return-value]  # None only when abandoned

    def when_unstuck(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once no abandoned call is running: now, or in the thread of the last
        one, when it returns, before ``wait_unstuck`` returns (``fn`` must not block)."""
        with self._lock:
            if self._running_abandoned:
                self._when_unstuck.append(fn)
                return
        fn()

    def wait_unstuck(self, timeout: float) -> bool:
        """Block (in a thread, never on the loop) until no abandoned call is running; for
        tests and orderly shutdown. Returns False if ``timeout`` passed first."""
        with self._unstuck:
            return self._unstuck.wait_for(lambda: self._running_abandoned == 0, timeout)

    def drain_late(self) -> None:
        """Run, on the event loop, the ``on_late`` callbacks of calls that finished late."""
        while self._late:
            self._late.popleft()()


class BufferPool:
    """Reusable private buffers for reads and write copies (allocating and faulting in a
    fresh multi-MiB buffer per block costs more than the copy). Page-aligned (anonymous
    mmap), as O_DIRECT needs. Thread-safe; a buffer kept by an abandoned thread is simply
    never returned (and freed with its last reference)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep  # per size: read pieces and whole-block write copies
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return mmap.mmap(-1, nbytes)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            free = self._free.setdefault(len(buf), [])
            if len(free) < self._keep and len(self._free) <= 4:
                free.append(buf)


def copy_bytes(dst: memoryview, src: memoryview | bytearray) -> None:
    """memcpy without holding the GIL (numpy releases it), so copying threads run in parallel:
    the one copy ``Handoff.touching()`` guards, between a private buffer and the caller's."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
