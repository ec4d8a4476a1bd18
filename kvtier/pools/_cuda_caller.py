"""The thread a CudaPool makes its CUDA calls on, so none runs on the event loop thread.

CuPy's wrappers of the enqueue calls (``cudaEventRecord``, ``cudaMemcpyAsync``,
``cudaSetDevice``, ...) hold the GIL while the driver works; a driver call that blocks (on a
lock another thread holds while it allocates, frees or creates a context) would then freeze
the event loop and the pool's waiter threads together. Every CUDA call of the copy path is
therefore made here, in order (one thread: copies reach their streams in the order the loop
asked for them), and the loop awaits the answer. The thread sets the pool's device once and
never switches back (it is the pool's own thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from kvtier.pools._cuda_stream import loop_scheduler
from kvtier.pools._cuda_thread import QueueThread
from kvtier.pools._cupy import CudaRuntime

__all__ = ["CudaCaller"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CudaCaller(QueueThread):
    """One thread that runs the pool's CUDA calls in the order they were asked for."""

    def __init__(self, runtime: CudaRuntime, device: int) -> None:
        super().__init__()
        self._runtime = runtime
        self.device = device
        self._jobs: deque[Callable[[], None]] = deque()

    async def run(self, call: Callable[..., T], *args: Any, shielded: bool = True) -> T:
        """``call(*args)`` on the caller thread; its result or its error. Not abandoned on
        cancellation (what it enqueues must be known): the cancellation takes effect at the
        caller's next checkpoint. ``shielded=False``: a cancellation ends the wait (for
        calls whose outcome the caller can do without, such as close's marks)."""
        finished = anyio.Event()
        schedule = loop_scheduler()
        outcome: list[tuple[bool, Any]] = []

        def job() -> None:
            try:
                outcome.append((True, call(*args)))
            except BaseException as exc:  # handed to the loop, raised there
                outcome.append((False, exc))
            with contextlib.suppress(Exception):  # the loop has closed: nobody is waiting
                schedule(finished.set)

        self._put(job)
        with anyio.CancelScope(shield=shielded):
            await finished.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        result: T = value
        return result

    def post(self, call: Callable[..., object], *args: Any) -> None:
        """``call(*args)`` on the caller thread, not waited for; a failure is logged."""

        def job() -> None:
            try:
                call(*args)
            except Exception:
                logger.debug("a CUDA call on cuda:%d failed", self.device, exc_info=True)

        self._put(job)

    def _put(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name=f"kvtier-cuda{self.device}-calls", daemon=True
                )
                self._thread.start()

    def _work(self) -> None:
        with contextlib.suppress(Exception):  # a dead context: the calls below say so
            self._runtime.setDevice(self.device)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._jobs) or self._stopping)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            job()
