"""Worker threads for kvtier's blocking calls that are never started on the event loop.

``anyio.to_thread.run_sync`` (like ``ThreadPoolExecutor``) starts a new worker thread on the
loop when none is idle, and ``Thread.start`` waits until the new thread has run: on a machine
whose cores are busy (tokenizers, the engine's own threads, other processes) that wait is the
scheduler's, tens of milliseconds in which the loop serves nothing. It happens exactly when
load rises and more calls run at once than ever before, or after workers went idle and exited.

``run_sync`` here has anyio's contract (a capacity limiter, ``abandon_on_cancel``, the
caller's context variables) but asks a spawner thread to start a worker when every worker is
busy, and never waits for it: the call is queued and the first free worker takes it. Workers
wait for work ``IDLE_EXIT_S`` before they exit, so a long-lived engine keeps the threads its
busiest moments needed, and a burst after a quiet spell costs the calls a thread start but
never the loop. The spawner is started with ``_thread.start_new_thread``, which does not wait
for the new thread, so even the first call costs the loop no wait; a forked child starts
afresh.
"""

from __future__ import annotations

import _thread
import asyncio
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, TypeVarTuple

import anyio
import anyio.lowlevel
import anyio.to_thread

__all__ = ["IDLE_EXIT_S", "WorkerThreads", "run_sync"]

T = TypeVar("T")
Args = TypeVarTuple("Args")

IDLE_EXIT_S = 60.0  # how long a worker waits for work before it exits


@dataclass(slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    context: contextvars.Context
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the loop: hand the outcome to a caller that is still waiting."""
    if future.done():  # the caller gave up (abandon_on_cancel)
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future cannot carry StopIteration
        future.set_exception(RuntimeError(f"the worker's call raised {error!r}"))
    else:
        future.set_exception(error)


class WorkerThreads:
    """Threads that run queued calls; started by a spawner thread, never by the caller."""

    def __init__(self, name: str = "kvtier worker", *, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.name = name
        self.idle_exit_s = idle_exit_s
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._spawn: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting for a call, and those asked for and not yet started
        self._queued = 0  # calls no worker has taken yet
        self._spawner_started = False
        self.threads = 0  # workers alive (or being started)
        self.started = 0  # workers started in all

    def submit(self, call: _Call) -> None:
        """Queue ``call``; ask for one more worker when every worker is taken. Never waits."""
        with self._lock:
            self._queued += 1
            spawn = self._queued > self._idle
            if spawn:
                self._idle += 1  # counted now, so the next caller does not ask again
                self.threads += 1
            if spawn and not self._spawner_started:
                self._spawner_started = True
                _thread.start_new_thread(self._spawner, ())
        self._calls.put(call)
        if spawn:
            self._spawn.put(True)

    def _spawner(self) -> None:
        while self._spawn.get():
            self.started += 1
            name = f"{self.name} {self.started}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > self._queued:  # a spare worker: leave
                        self._idle -= 1
                        self.threads -= 1
                        return
                continue
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            result: Any = None
            error: BaseException | None = None
            if not call.future.done():
                try:
                    result = call.context.run(call.fn, *call.args)
                except BaseException as exc:
                    error = exc
            with self._lock:
                self._idle += 1
            try:
                call.loop.call_soon_threadsafe(_settle, call.future, result, error)
            except RuntimeError:  # the caller's loop has closed: nobody waits
                pass
            del call, result, error  # drop the caller's objects before waiting again


_workers = WorkerThreads()


def _after_fork() -> None:
    global _workers
    _workers = WorkerThreads()  # the parent's threads do not exist in a child


os.register_at_fork(after_in_child=_after_fork)


async def run_sync(
    fn: Callable[[*Args], T],
    *args: *Args,
    limiter: anyio.CapacityLimiter | None = None,
    abandon_on_cancel: bool = False,
) -> T:
    """``fn(*args)`` in a worker thread, as ``anyio.to_thread.run_sync`` runs it (the limiter, by
    default anyio's, holds a token for the call; with ``abandon_on_cancel`` a cancelled caller
    returns at once and the thread finishes on its own; otherwise the cancellation waits for
    the call), without ever starting a thread on the loop."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    async with limiter or anyio.to_thread.current_default_thread_limiter():
        with anyio.CancelScope(shield=not abandon_on_cancel):
            loop = asyncio.get_running_loop()
            future: asyncio.Future[T] = loop.create_future()
            _workers.submit(_Call(fn, args, contextvars.copy_context(), loop, future))
            result = await future
    # A cancellation deferred while the call ran is raised now, not at some later await.
    await anyio.lowlevel.checkpoint_if_cancelled()
    return result
