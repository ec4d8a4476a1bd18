"""A private asyncio loop on its own thread, reached from other threads without waiting.

The thread runs ``anyio.run`` around one task group and one body (the bridge's: open the tier,
serve, close it); every other piece of work runs in that task group. Other threads reach the
loop with ``loop.call_soon_threadsafe`` only: it appends a callback and wakes the loop, and
never waits for it (anyio's ``BlockingPortal.start_task_soon`` would: it blocks until the loop
has taken the task, a wait behind whatever the loop is doing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc

__all__ = ["LoopThread"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """One thread, one asyncio loop, one task group, for as long as ``body`` runs.

    ``on_exit`` is called on the thread when the loop has ended, however it ended.
    """

    def __init__(
        self, name: str, body: Callable[[], Awaitable[None]], on_exit: Callable[[], None]
    ) -> None:
        self.name = name
        self._body = body
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: contextvars.Context | None = None
        self.task_group: anyio.abc.TaskGroup | None = None  # None: takes no new tasks
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run_thread, name=f"kvtier-bridge-{name}")

    def start(self, timeout: float) -> None:
        """Start the thread; return once its loop runs (the body has begun)."""
        self._thread.start()
        if not self._started.wait(timeout):  # the loop starts in milliseconds
            raise RuntimeError(f"{self.name}: the kvtier loop thread did not start")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def on_thread(self) -> bool:
        """Whether the caller runs on the loop thread."""
        return threading.current_thread() is self._thread

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (at once when called from the thread itself)."""
        if not self.on_thread():
            self._thread.join(timeout)

    def call_soon(self, callback: Callable[..., object], *args: object) -> bool:
        """Have the loop call ``callback(*args)`` soon, without waiting; False if the loop
        is gone (or not yet there)."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(callback, *args, context=self._context)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: object
    ) -> asyncio.TimerHandle:
        """A timer on the loop (call on the loop thread only)."""
        assert self._loop is not None
        return self._loop.call_later(delay, callback, *args)

    def detach(self) -> None:
        """Take no new tasks from here on (the body is closing down)."""
        self.task_group = None

    def cancel(self) -> None:
        """Cancel everything in the task group, the body included (loop thread only)."""
        if self.task_group is not None:
            self.task_group.cancel_scope.cancel()

    def run(self, func: Callable[..., Awaitable[T]], *args: object, timeout: float = 30.0) -> T:
        """Run ``await func(*args)`` in the task group and return its result (blocks)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def runner() -> None:
            try:
                future.set_result(await func(*args))
            except BaseException as exc:
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise

        def start() -> None:
            if self.task_group is None:
                future.set_exception(RuntimeError(f"{self.name}: the bridge is closed"))
            else:
                self.task_group.start_soon(runner)

        if not self.call_soon(start):
            raise RuntimeError(f"{self.name}: the bridge is closed")
        return future.result(timeout)

    def _run_thread(self) -> None:
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException:
            logger.exception("%s: the kvtier loop thread failed", self.name)
        finally:
            self._on_exit()
            self._started.set()  # never leave start() waiting

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Callbacks from other threads run in the loop's context, where anyio knows which
        # backend is running (a callback otherwise carries the calling thread's).
        self._context = contextvars.copy_context()
        async with anyio.create_task_group() as tg:
            self.task_group = tg
            self._started.set()
            await self._body()
            tg.cancel_scope.cancel()  # only timers are left: the body has finished its work

    def __repr__(self) -> str:
        return f"<LoopThread {self.name!r} alive={self.is_alive()}>"
