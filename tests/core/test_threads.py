"""kvtier's worker threads: anyio's contract, and no thread ever started on the event loop."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import anyio
import pytest

from kvtier.common import _threads
from kvtier.common._threads import WorkerThreads, run_sync

pytestmark = pytest.mark.asyncio

_request = contextvars.ContextVar("_request", default="none")


@pytest.fixture
def thread_starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread idents from which a ``Thread.start`` was called during the test."""
    starts: list[int] = []
    original = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        starts.append(threading.get_ident())
        original(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    monkeypatch.setattr(_threads, "_workers", WorkerThreads("test worker", idle_exit_s=0.5))
    return starts


async def test_a_call_runs_in_a_worker_with_its_arguments_and_context() -> None:
    _request.set("r1")
    where, seen = await run_sync(
        lambda a, b: (threading.get_ident(), _request.get() + a + b), "x", "y"
    )
    assert where != threading.get_ident()
    assert seen == "r1xy"


async def test_an_error_in_the_call_reaches_the_caller() -> None:
    def fail() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        await run_sync(fail)


async def test_calls_run_at_once_without_a_thread_started_on_the_loop(
    thread_starts: list[int],
) -> None:
    """Eight calls that each wait for all eight can only finish if eight workers run at once;
    each was started by the spawner, none by the loop's thread."""
    together = threading.Barrier(8, timeout=30)
    limiter = anyio.CapacityLimiter(8)
    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(lambda: run_sync(together.wait, limiter=limiter))
    assert len(thread_starts) == 8
    assert threading.get_ident() not in thread_starts
    assert _threads._workers.threads == 8


async def test_idle_workers_are_reused(thread_starts: list[int]) -> None:
    for _ in range(20):
        await run_sync(int)
    assert len(thread_starts) == 1


async def test_the_limiter_bounds_calls_in_flight(thread_starts: list[int]) -> None:
    limiter = anyio.CapacityLimiter(2)
    running = 0
    most = 0
    changed = threading.Condition()
    release = threading.Event()

    def call() -> None:
        nonlocal running, most
        with changed:
            running += 1
            most = max(most, running)
            changed.notify_all()
        release.wait(30)
        with changed:
            running -= 1

    def two_running() -> bool:
        with changed:
            return changed.wait_for(lambda: running == 2, 30)

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(lambda: run_sync(call, limiter=limiter))
        assert await anyio.to_thread.run_sync(two_running)
        assert limiter.statistics().tasks_waiting == 3
        release.set()
    assert most == 2


class HeldCall:
    """A call that runs until the test lets it finish, and says where it is."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.finish = threading.Event()
        self.finished = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        self.finish.wait(30)
        self.finished.set()


async def test_a_cancelled_caller_that_abandons_returns_while_the_call_runs_on() -> None:
    call = HeldCall()
    started, finish, finished = call.started, call.finish, call.finished
    with anyio.move_on_after(30) as scope:
        async with anyio.create_task_group() as tg:

            async def caller() -> None:
                await run_sync(call, abandon_on_cancel=True)

            tg.start_soon(caller)
            await anyio.to_thread.run_sync(started.wait, 30)
            tg.cancel_scope.cancel()
    assert not scope.cancelled_caught
    assert not finished.is_set()  # the caller left while the call still ran
    finish.set()
    assert await anyio.to_thread.run_sync(finished.wait, 30)


async def test_a_cancelled_caller_that_does_not_abandon_waits_for_the_call() -> None:
    call = HeldCall()
    started, finish, finished = call.started, call.finish, call.finished
    went_on = False

    async def caller() -> None:
        nonlocal went_on
        await run_sync(call)
        went_on = True  # never: the deferred cancellation is raised as the call returns

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.to_thread.run_sync(started.wait, 30)
        tg.cancel_scope.cancel()
        assert not finished.is_set()
        finish.set()
    assert finished.is_set()  # the task group ended only once the call had returned
    assert not went_on


async def test_spare_workers_exit_once_idle() -> None:
    workers = WorkerThreads("idle test", idle_exit_s=0.01)
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(3)]
    together = threading.Barrier(3, timeout=30)
    for future in futures:
        workers.submit(_threads._Call(together.wait, (), contextvars.copy_context(), loop, future))
    await asyncio.gather(*futures)
    assert workers.started == 3
    for _ in range(3000):  # each exits after its own idle wait
        if workers.threads == 0:
            break
        await asyncio.sleep(0.01)
    assert workers.threads == 0
