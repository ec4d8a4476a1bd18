"""CUDA plumbing for CudaPool: bounded pinned staging buffers, copy lanes, and completions the
event loop can await without blocking.

Two ways to learn that a copy finished (``completion=`` on CudaPool):

- ``"callback"``: record a CUDA event after the copies, make a *notifier* stream wait for it and
  enqueue a host function there (``cudaLaunchHostFunc``) that resolves the completion through
  ``loop.call_soon_threadsafe``. The notifier stream exists because a host function stalls the
  stream it sits on until it has run; on the copy stream that would put a callback's latency
  between every two copies. No thread is held while a copy runs, and completions asked for in
  the same loop iteration share one event and one callback (see ``Lane``).
- ``"thread"``: record a blocking-sync CUDA event and wait for it in an anyio worker thread
  (``cudaEventSynchronize``). Works on any anyio backend; holds one worker thread per waiting
  operation.

``callback`` needs asyncio (it uses the running loop); on another backend CudaPool falls back to
``thread`` for that operation. benchmarks/gpu_check.py measures both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

__all__ = ["COMPLETIONS", "Completion", "Lane", "StagingBuffer", "StagingPool"]

COMPLETIONS = ("callback", "thread")


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

    def __init__(self, cupy: Any, count: int, nbytes: int) -> None:
        self.count = count
        self.nbytes = nbytes
        self._memory: Any = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(count * nbytes), 0)
        whole = np.frombuffer(self._memory, np.uint8, count * nbytes)
        base = int(self._memory.ptr)
        self._buffers = [
            StagingBuffer(i, base + i * nbytes, whole.data[i * nbytes : (i + 1) * nbytes])
            for i in range(count)
        ]
        self._free = list(reversed(self._buffers))
        self._semaphore = anyio.Semaphore(count)
        self.waits = 0
        self.closed = False

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
        got = [self._free.pop()]
        got += self.try_acquire(most - 1)
        return got

    def try_acquire(self, most: int) -> list[StagingBuffer]:
        got: list[StagingBuffer] = []
        while len(got) < most:
            try:
                self._semaphore.acquire_nowait()
            except anyio.WouldBlock:
                break
            got.append(self._free.pop())
        return got

    def release(self, buffers: list[StagingBuffer]) -> None:
        """Give buffers back; only once no DMA into or out of them can still be running."""
        for buffer in buffers:
            self._free.append(buffer)
            self._semaphore.release()

    def close(self) -> None:
        """Drop the pinned memory (freed when the last view of it goes)."""
        self.closed = True
        self._buffers.clear()
        self._memory = None


class Completion:
    """The point in a stream after the copies issued so far (and maybe a few more)."""

    __slots__ = (
        "_callbacks",
        "_cuda_event",
        "_error",
        "_event",
        "_synced",
        "_threaded",
        "_waiting",
    )

    def __init__(self, cuda_event: Any, *, threaded: bool) -> None:
        self._cuda_event = cuda_event
        self._threaded = threaded
        self._event = anyio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._waiting = False
        self._synced = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread once the copies are done (now if they are)."""
        if self._event.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def set(self) -> None:
        """Mark done; runs on the loop thread."""
        if self._event.is_set():
            return
        self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def fail(self, error: BaseException) -> None:
        """The completion could not be armed (a CUDA error): waiters get ``error``."""
        self._error = error
        self.set()

    def _synchronize(self) -> None:  # worker thread
        self._cuda_event.synchronize()
        self._synced = True

    async def wait(self) -> None:
        if not self._event.is_set():
            if not self._threaded or self._waiting:
                await self._event.wait()
            else:
                self._waiting = True
                try:
                    # Not abandoned on cancel: a cancelled waiter still learns when the DMA
                    # ended, so its staging buffer is never reused while the copy may run.
                    await anyio.to_thread.run_sync(self._synchronize)
                finally:
                    self._waiting = False
                    if self._synced:
                        self.set()
        if self._error is not None:
            raise self._error


def _fire(arg: tuple[asyncio.AbstractEventLoop, Completion]) -> None:
    """The host function: runs on a CUDA driver thread, so it only hands over to the loop."""
    loop, completion = arg
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
        loop.call_soon_threadsafe(completion.set)


class Lane:
    """One copy direction: a non-blocking stream for the copies and, in callback mode, a
    notifier stream that carries only the host functions.

    In callback mode the completions asked for in one event-loop iteration are coalesced:
    the first ``mark`` opens a completion and schedules ``_arm`` with ``call_soon``; every
    ``mark`` until then shares it. ``_arm`` records one event after all those copies and
    enqueues one host function, so a burst of promotions costs one event, one callback and
    one loop wake-up instead of one each. The copies themselves were enqueued at once.
    """

    def __init__(self, cupy: Any, completion: str, device: int) -> None:
        self._cupy = cupy
        self._device = device
        self.stream: Any = cupy.cuda.Stream(non_blocking=True)
        self._notifier: Any = (
            cupy.cuda.Stream(non_blocking=True) if completion == "callback" else None
        )
        self._open: Completion | None = None

    def mark(self) -> Completion:
        """A completion for everything issued on the lane's stream so far. Call it on the loop
        thread with the pool's device current."""
        cuda = self._cupy.cuda
        if self._notifier is not None:
            if self._open is not None:
                return self._open
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on asyncio: wait in a worker thread instead
                pass
            else:
                done = self._open = Completion(None, threaded=False)
                loop.call_soon(self._arm, loop)
                return done
        event = cuda.Event(block=True, disable_timing=True)
        event.record(self.stream)
        return Completion(event, threaded=True)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        done, self._open = self._open, None
        assert done is not None
        try:
            with self._cupy.cuda.Device(self._device):
                event = self._cupy.cuda.Event(disable_timing=True)
                event.record(self.stream)
                self._notifier.wait_event(event)
                self._notifier.launch_host_func(_fire, (loop, done))
        except Exception as exc:  # CUDA refused: fail the waiters instead of leaving them
            done.fail(exc)

    def synchronize(self) -> None:
        """Block until everything on the lane ran (a worker thread calls this on close)."""
        self.stream.synchronize()
        if self._notifier is not None:
            self._notifier.synchronize()
