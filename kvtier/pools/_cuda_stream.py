"""CUDA plumbing for CudaPool: bounded pinned staging buffers, copy lanes, and completions the
event loop awaits without blocking and without Python running on a CUDA driver thread.

How the loop learns that copies finished: ``Lane.mark`` (on the pool's CUDA thread) records a
blocking-sync event after them on the lane's stream and queues it for the lane's *waiter*, one
ordinary Python thread per lane that takes the events in order (a stream completes them in
order), ``cudaEventSynchronize``-s each and hands the result to the loop with
``call_soon_threadsafe``. No host function is ever enqueued on a stream: a Python host function
runs on a driver thread and needs the GIL while the loop thread may hold it inside a CUDA call,
which deadlocks, and it never runs at all after a context error. The waiter also holds no token
of anyio's default thread limiter, which the tiers share.

Graph captures: while an engine captures a CUDA graph in global mode (torch's default), the
synchronising calls of every other thread in global mode are refused and invalidate the
capture. A waiter therefore puts its thread in relaxed capture mode first, so it neither
breaks the engine's capture nor gets refused.

Errors: not every error of a wait means the copies will never run. A refusal (a capture, an
injected or transient error) leaves them queued, and they land later. So a failed wait is
checked with ``cudaEventQuery``: done means done; not ready, or a refusal, means the copies
are still queued and the waiter waits again (backing off while it is refused). Only an error
that persists (a sticky context error makes every later call fail too) resolves the
completion as failed: then no copy can still run, and the caller may return its buffers. The
event of a failed completion is destroyed, not dropped. When recording the event fails, the
completion waits for the whole stream instead (``cudaStreamSynchronize``) and then reports
the recording's error: whatever was enqueued before is known to have finished either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from kvtier.pools._cuda_thread import QueueThread
from kvtier.pools._cupy import CudaRuntime

__all__ = ["Completion", "Lane", "StagingBuffer", "StagingPool", "loop_scheduler", "until_done"]

logger = logging.getLogger(__name__)

_Schedule = Callable[..., object]

_NOT_READY = 600  # cudaErrorNotReady
# cudaErrorStreamCapture*: refusals and capture faults, not sticky (the context lives on)
_CAPTURE_ERRORS = frozenset(range(900, 909))
_RETRY_FIRST, _RETRY_MOST = 0.001, 0.05  # seconds between waits while a wait is refused


class StagingBuffer:
    """One block of pinned host memory: ``ptr`` for the DMA, ``view`` for the tiers."""

    __slots__ = ("index", "ptr", "view")

    def __init__(self, index: int, ptr: int, view: memoryview) -> None:
        self.index = index
        self.ptr = ptr
        self.view = view


class StagingPool:
    """``count`` pinned buffers of ``nbytes`` in one pinned allocation.

    Bounded on purpose: when every buffer is busy, callers queue (FIFO) instead of pinning more
    host memory. A caller that already holds buffers must not block here (use
    ``try_acquire`` and retire its own work first); that rule keeps the pool deadlock-free.
    """

    def __init__(self, runtime: CudaRuntime, count: int, nbytes: int) -> None:
        self.count = count
        self.nbytes = nbytes
        self._runtime = runtime
        self.ptr: int | None = runtime.hostAlloc(count * nbytes, 0)
        pinned = (ctypes.c_ubyte * (count * nbytes)).from_address(self.ptr)
        whole = np.frombuffer(memoryview(pinned), np.uint8)
        self._buffers = [
            StagingBuffer(i, self.ptr + i * nbytes, whole.data[i * nbytes : (i + 1) * nbytes])
            for i in range(count)
        ]
        # FIFO: buffers go back in the order they were taken and come out in that order, so
        # a batch gets adjacent buffers and its copies merge (a stack would reverse them).
        self._free = deque(self._buffers)
        self._semaphore = anyio.Semaphore(count)
        self.waits = 0

    @property
    def available(self) -> int:
        return self._semaphore.value

    async def acquire(self, most: int = 1) -> list[StagingBuffer]:
        """Wait for at least one buffer (in turn), then take up to ``most`` without waiting.

        When buffers are free this returns without a loop round trip: its callers always
        await a copy right after, so they stay cancellation points."""
        got = self.try_acquire(most)
        if got:
            return got
        self.waits += 1
        await self._semaphore.acquire()
        got = [self._free.popleft()]
        got += self.try_acquire(most - 1)
        return got

    def try_acquire(self, most: int) -> list[StagingBuffer]:
        got: list[StagingBuffer] = []
        while len(got) < most:
            try:
                self._semaphore.acquire_nowait()
            except anyio.WouldBlock:
                break
            got.append(self._free.popleft())
        return got

    def release(self, buffers: list[StagingBuffer]) -> None:
        """Give buffers back; only once no DMA into or out of them can still be running."""
        for buffer in buffers:
            self._free.append(buffer)
            self._semaphore.release()

    def free(self) -> None:
        """Free the pinned memory (blocks until the device is idle: call it in a worker
        thread, only once no copy and no tier can touch a buffer)."""
        ptr, self.ptr = self.ptr, None
        self._buffers.clear()
        self._free.clear()
        if ptr is not None:
            self._runtime.freeHost(ptr)


class Completion:
    """The point in a lane's stream after some copies: set on the loop thread once they ran,
    failed once CUDA reported an error instead (nothing runs on that context any more)."""

    __slots__ = ("_callbacks", "_error", "_event", "event")

    def __init__(self) -> None:
        self.event: int | None = None  # the event recorded after the copies; None: stream-wide
        self._event = anyio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread once the copies are done (now if they are)."""
        if self._event.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def resolve(self, error: BaseException | None) -> None:
        """The copies ran (``error`` None) or never will; on the loop thread."""
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a CUDA completion callback failed")

    async def wait(self) -> None:
        """Until the copies ran; raises the CUDA error that ended them instead."""
        await self._event.wait()
        if self._error is not None:
            raise self._error

    async def settled(self) -> None:
        """Until the copies ran or never will; never raises their error."""
        await self._event.wait()


def loop_scheduler() -> _Schedule:
    """How a thread hands a call to the running event loop (asyncio or trio)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: anyio's portal (the waiter waits for the loop)
        return functools.partial(anyio.from_thread.run_sync, token=anyio.lowlevel.current_token())


def until_done(
    runtime: CudaRuntime, stream: int, event: int | None, pause: Callable[[float], object]
) -> None:
    """Wait until what ``event`` follows on ``stream`` ran (the whole stream when None);
    raises only an error that persists, after which nothing queued will run. A refused wait
    (a graph capture, a transient error) says nothing about the copies, which are still
    queued: ``pause`` (seconds) backs off between tries."""
    delay = _RETRY_FIRST
    while True:
        try:
            if event is None:
                runtime.streamSynchronize(stream)
            else:
                runtime.eventSynchronize(event)
            return
        except Exception as exc:
            status = getattr(exc, "status", None)
            if event is not None:
                status = runtime.eventQuery(event)
                if status == 0:  # it ran after all
                    return
            if status != _NOT_READY and status not in _CAPTURE_ERRORS:
                raise
            logger.debug("a CUDA wait was refused (%s); waiting again", exc)
        pause(delay)
        delay = min(2 * delay, _RETRY_MOST)


class Lane(QueueThread):
    """One copy direction: a non-blocking stream, a free list of events and the waiter
    thread that resolves the lane's completions in order."""

    def __init__(self, runtime: CudaRuntime, device: int, name: str) -> None:
        super().__init__()
        self._runtime = runtime
        self.device = device
        self.name = name
        self.stream = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
        self._event_flags = runtime.eventBlockingSync | runtime.eventDisableTiming
        self._events: list[int] = []  # recorded and completed: free to record again
        self._queue: deque[tuple[int | None, Completion, _Schedule, BaseException | None]]
        self._queue = deque()
        self.pending = 0

    def mark(
        self, done: Completion, schedule: _Schedule, error: BaseException | None = None
    ) -> None:
        """Make ``done`` (made on the loop thread, as ``schedule``, which hands calls to the
        loop) the completion of everything enqueued on the stream so far; call it on the
        pool's CUDA thread. Never raises a CUDA error: one is reported by the completion,
        after the stream drained. ``error``: enqueueing failed partway; the completion
        reports it once what did get enqueued has run."""
        event: int | None = None
        if error is None:
            try:
                with self._cv:
                    event = self._events.pop() if self._events else None
                if event is None:
                    event = self._new_event()
                try:
                    self._runtime.eventRecord(event, self.stream)
                except BaseException:
                    with self._cv:
                        self._events.append(event)
                    raise
            except Exception as exc:
                event, error = None, exc
        done.event = event
        self._start()
        with self._cv:
            self._queue.append((event, done, schedule, error))
            self.pending += 1
            self._cv.notify()

    def _new_event(self) -> int:
        return self._runtime.eventCreateWithFlags(self._event_flags)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._wait_in_order,
                name=f"kvtier-cuda{self.device}-{self.name}",
                daemon=True,
            )
            self._thread.start()

    def _wait_in_order(self) -> None:  # the waiter thread
        # Its own thread: the device is set once and never switched back.
        with contextlib.suppress(Exception):  # a dead context: the waits below say so
            self._runtime.setDevice(self.device)
        try:  # an engine's graph capture must neither refuse nor be broken by our waits
            self._runtime.threadExchangeStreamCaptureMode(self._runtime.streamCaptureModeRelaxed)
        except Exception:
            logger.warning("cannot relax the CUDA capture mode of the cuda:%d waiter", self.device)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._stopping)
                if not self._queue:
                    return
                event, done, schedule, error = self._queue.popleft()
            failure = error
            try:
                self._until_done(event)
            except Exception as exc:
                failure = exc
                if event is not None:  # the context is dead: the event goes, not to reuse
                    with contextlib.suppress(Exception):
                        self._runtime.eventDestroy(event)
            with contextlib.suppress(Exception):  # the loop has closed: nobody is waiting
                schedule(self._resolved, done, event, failure)

    def _until_done(self, event: int | None) -> None:
        until_done(self._runtime, self.stream, event, self._pause)

    def _pause(self, seconds: float) -> None:
        with self._cv:  # woken early by stop(): it waits for the queue anyway
            self._cv.wait(seconds)

    def _resolved(self, done: Completion, event: int | None, error: BaseException | None) -> None:
        """On the loop thread: resolve ``done``, then reuse its event (callbacks first: a
        fence on that event is dropped before the event is recorded again); the event of a
        failed completion was destroyed by the waiter."""
        with self._cv:
            self.pending -= 1
        done.resolve(error)
        if event is not None and error is None:
            with self._cv:
                self._events.append(event)

    def destroy(self) -> None:
        """Destroy the stream and the events (after ``stop`` returned True; on a thread
        with the lane's device current)."""
        for event in self._events:
            self._runtime.eventDestroy(event)
        self._events.clear()
        self._runtime.streamDestroy(self.stream)

    def __repr__(self) -> str:
        return f"<Lane {self.name} cuda:{self.device} pending={self.pending}>"
