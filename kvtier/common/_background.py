"""The manager's background tasks: counted, and given back even if cancelled before they run.

A promotion or a write-through takes its resources (a reserved or pinned slot, bytes in
flight) synchronously, before its task starts, so that the lookup or store that started it
already sees them taken. The task gives them back in its ``finally``. But asyncio cancels a
task that has not run yet without running any of it (anyio never does this, asyncio's own
shutdown and anyone calling ``Task.cancel`` directly do), and then no ``finally`` runs. So
each task is started with an ``undo``; a task that starts drops its undo at once, and what
is left after the task group has ended is undone by ``undo_unstarted``.

The task group such tasks run in lives from a component's ``__aenter__`` to its ``aclose``,
so it is entered and left by hand; ``enter_task_group`` and ``cancel_task_group`` are the one
way every component does that.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from kvtier.common._logging import BurstLogger

__all__ = ["Background", "Callbacks", "InFlight", "cancel_task_group", "enter_task_group"]


class InFlight:
    """A count of running background tasks that can be awaited down to zero."""

    def __init__(self) -> None:
        self.count = 0
        self._zero = anyio.Event()
        self._zero.set()

    def started(self) -> None:
        if self.count == 0:
            self._zero = anyio.Event()
        self.count += 1

    def finished(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._zero.set()

    async def wait_zero(self) -> None:
        await self._zero.wait()


class Background:
    """Starts tasks in a task group, counting them in ``tasks``."""

    def __init__(self) -> None:
        self.tasks = InFlight()
        self._unstarted: dict[object, Callable[[], None]] = {}

    def start_soon(
        self,
        task_group: anyio.abc.TaskGroup,
        undo: Callable[[], None],
        function: Callable[..., Awaitable[None]],
        *args: object,
    ) -> None:
        """Run ``function(*args)`` in ``task_group``; call ``undo`` instead if the task is
        cancelled before it first runs."""
        token = object()
        self._unstarted[token] = undo
        self.tasks.started()
        try:
            task_group.start_soon(self._run, token, function, args)
        except BaseException:
            del self._unstarted[token]
            self.tasks.finished()
            raise

    async def _run(
        self, token: object, function: Callable[..., Awaitable[None]], args: tuple[object, ...]
    ) -> None:
        del self._unstarted[token]  # started: from here on the task gives back its own
        try:
            await function(*args)
        finally:
            self.tasks.finished()

    def undo_unstarted(self) -> int:
        """Undo the tasks that never ran (call once their task group has ended)."""
        unstarted, self._unstarted = self._unstarted, {}
        for undo in unstarted.values():
            undo()
            self.tasks.finished()
        return len(unstarted)


class Callbacks:
    """Calls a tier's or an observer's hook from background work. The manager's task group
    lives in the engine's task, so an exception there would stop the engine: it is logged
    once per burst and counted in ``failures`` instead."""

    __slots__ = ("_log", "failures")

    def __init__(self, log: BurstLogger) -> None:
        self._log = log
        self.failures = 0

    def __call__(self, what: str, function: Callable[..., object], *args: object) -> None:
        try:
            function(*args)
        except Exception as exc:
            self.failures += 1
            self._log.warning(
                "callback:" + what, "%s raised in kvtier background work: %r", what, exc
            )


async def enter_task_group() -> anyio.abc.TaskGroup:
    """A task group entered by hand, for a component whose background tasks live from its
    ``__aenter__`` to its ``aclose`` (no ``async with`` spans the two). Leave it with
    ``cancel_task_group``, in the task that entered it."""
    task_group = anyio.create_task_group()
    await task_group.__aenter__()
    return task_group


async def cancel_task_group(task_group: anyio.abc.TaskGroup) -> None:
    """Cancel every task in ``task_group`` and leave it: its tasks are cancelled, so this
    returns as soon as their own (shielded, bounded) cleanup ends; an exception one of them
    raised comes out of here, as it would out of ``async with``."""
    task_group.cancel_scope.cancel()
    await task_group.__aexit__(None, None, None)
