"""Opening the manager's tiers: all of them or none (``require_all_tiers``), or each tier as
soon as it can (the default; docs/operating.md, "Failure modes").

By default a tier that cannot open (an endpoint that refuses connections or never answers,
credentials refused) does not stop the manager. Each tier is opened by a keeper, a task of
its own, all at once: the manager waits until every tier has opened or failed its first
attempt, and opens with the tiers that are open. A tier whose backend has not answered
within ``tier_answer_wait`` seconds (an S3 endpoint that accepts connections and says
nothing) is not waited for longer; one that answered (``_answer``: its open has work of its
own left, a large listing), or does not say (``tells_answer`` False: an FS tier), is waited
for until ``tier_open_wait`` seconds have passed in all. The waits start once each tier
has prepared what its open needs from this process alone (``warm_up``, where a tier has
one: the S3 tier parses botocore's model, about a second in a fresh process on a busy
machine), so they bound how long an endpoint or a mount takes to answer, not how long the
process takes to start.
The others are unavailable: the manager does not ask them (lookups that no open tier
answers are ``unavailable`` misses; writes to them are dropped, counted by the admission),
and their keepers open them again in the background with backoff until they join.

A keeper is a task because a tier's open may enter task groups (the S3 tier's journal loop,
the FS tier's checks), and a task group must be left in the task that entered it and under
the same cancel scopes: the keeper that opened a tier is the one that closes it, at the
manager's close, inside the scope that bounded its open. Only a configuration error (an
``InvalidArgumentError``: another cache identity in the folder, a root that cannot be used)
fails the manager's open as before: trying again cannot fix it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack

import anyio
import anyio.abc

from kvtier.common._background import enter_task_group
from kvtier.common._errors import InvalidArgumentError, TierTimeoutError
from kvtier.common._logging import BurstLogger
from kvtier.manager._config import ManagerConfig
from kvtier.manager._statistics import TierOpenCounts
from kvtier.tiers._answer import hearing_answers
from kvtier.tiers._base import Listener, SecondaryTier

__all__ = ["RETRY_FIRST", "RETRY_MOST", "TierKeepers", "open_every_tier"]

logger = logging.getLogger("kvtier.manager")

RETRY_FIRST = 0.5
"""Seconds before a tier that failed to open is tried again; doubled after each failure."""
RETRY_MOST = 30.0
"""The longest wait between two attempts to open a tier."""


def _timed_out(tier: SecondaryTier, open_timeout: float | None) -> TierTimeoutError:
    return TierTimeoutError(
        f"did not open within open_timeout={open_timeout:g} s; check that the tier is "
        "reachable (a hung mount, an endpoint that does not answer) or raise open_timeout",
        tier=tier.name,
        operation="open",
    )


async def open_every_tier(
    tiers: Sequence[SecondaryTier],
    *,
    open_timeout: float | None,
    close_timeout: float,
    listener: Listener,
) -> AsyncExitStack:
    """``require_all_tiers``: open each tier in turn, each within ``open_timeout``, and
    return the stack that closes them. The first that fails, or passes ``open_timeout``
    (``TierTimeoutError`` naming it), fails the open, and the tiers opened before it are
    closed again."""
    opening: SecondaryTier | None = None
    async with AsyncExitStack() as stack:
        # Entered first, so left last: it bounds each tier's open, then stays entered (with
        # no deadline) until the stack closes, because task groups a tier enters while
        # opening must be left before the scope they were entered in.
        bound = stack.enter_context(anyio.CancelScope())
        for tier in tiers:
            opening = tier
            if open_timeout is not None:
                bound.deadline = anyio.current_time() + open_timeout
            await stack.enter_async_context(tier)
            stack.callback(tier.add_listener(listener))
        bound.deadline = math.inf
        return stack.pop_all()
    # Only here when the scope caught its deadline: that tier's open ran past open_timeout.
    assert opening is not None
    with anyio.move_on_after(close_timeout, shield=True):
        await opening.aclose()  # whatever its open had set up before it was cut
    raise _timed_out(opening, open_timeout)


async def _warm_up(tier: SecondaryTier, warm: anyio.Event) -> None:
    """Let ``tier`` prepare what its open needs from this process alone, if it says how
    (``warm_up``: the S3 tier's parse of botocore's model, a second in a fresh process
    on a busy machine); ``warm`` is set however it ends."""
    try:
        prepare = getattr(tier, "warm_up", None)
        if prepare is not None:
            await prepare()
    finally:
        warm.set()


class _Keeper:
    """One tier's keeper state: whether its tier is open, whether its backend answered
    (``answered``) and its first attempt has ended (``settled``), the configuration error
    that ended it, and the scope that close cancels while the tier is not open."""

    __slots__ = (
        "answered",
        "attempts",
        "fatal",
        "is_open",
        "scope",
        "settled",
        "stop",
        "tier",
        "warm",
    )

    def __init__(self, tier: SecondaryTier) -> None:
        self.tier = tier
        self.is_open = False
        self.attempts = 0
        self.warm = anyio.Event()  # its local preparation (``warm_up``) has ended
        self.settled = anyio.Event()
        self.answered = anyio.Event()  # its backend answered, or its first attempt ended
        if not tier.tells_answer:  # the whole open is waited for, as one that answered
            self.answered.set()
        self.stop = anyio.Event()  # set at close: an open tier is closed, not cancelled
        self.fatal: InvalidArgumentError | None = None
        self.scope = anyio.CancelScope()


class TierKeepers:
    """A keeper per tier, in a task group of their own (see the module doc).

    ``changed`` is called whenever a tier joins (the manager then asks it and writes to
    it); ``listener`` hears a joined tier's key changes, as with every open tier.
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        settings: ManagerConfig,
        *,
        listener: Listener,
        changed: Callable[[], None],
        log: BurstLogger,
    ) -> None:
        self._tiers = tuple(tiers)
        self._keepers: list[_Keeper] = []  # made at each open (events need a running loop)
        self._open_timeout = settings.open_timeout  # each attempt's bound
        self._close_timeout = settings.close_timeout
        self._listener = listener
        self._changed = changed
        self._log = log
        self._task_group: anyio.abc.TaskGroup | None = None
        self._late = False  # the manager is open: a tier that joins now joins late
        self.open_failures = 0
        self.joined_late = 0

    def available(self) -> list[SecondaryTier]:
        """The tiers open now, in the manager's order."""
        return [k.tier for k in self._keepers if k.is_open]

    def unavailable(self) -> tuple[str, ...]:
        """The names of the tiers being opened again (none while the manager is closed)."""
        if self._task_group is None:
            return ()
        return tuple(k.tier.name for k in self._keepers if not k.is_open)

    def counts(self) -> TierOpenCounts:
        """The ``opens`` group of the manager's statistics."""
        unavailable = self.unavailable()
        return TierOpenCounts(
            unavailable=unavailable,
            unavailable_tiers=len(unavailable),
            open_failures=self.open_failures,
            joined_late=self.joined_late,
        )

    async def open(self, answer_wait: float, wait: float) -> None:
        """Start the keepers; return once every tier has opened or failed its first
        attempt, or has not answered within ``answer_wait`` seconds, or ``wait`` seconds have
        passed. A configuration error in a first attempt is raised here (the first in tier
        order), after every keeper has stopped."""
        self._keepers = [_Keeper(tier) for tier in self._tiers]
        self._task_group = task_group = await enter_task_group()
        try:
            for keeper in self._keepers:
                task_group.start_soon(self._keep, keeper)
            # The wait bounds the tiers' answers, not the process's start: it begins once
            # every tier has prepared what is local to it (``_warm_up``).
            with anyio.move_on_after(
                math.inf if self._open_timeout is None else self._open_timeout
            ):
                for keeper in self._keepers:
                    await keeper.warm.wait()
            until = anyio.current_time() + wait
            with anyio.move_on_after(min(answer_wait, wait)):
                for keeper in self._keepers:
                    await keeper.answered.wait()
            with anyio.move_on_after(until - anyio.current_time()):
                for keeper in self._keepers:
                    if keeper.answered.is_set():  # the others are not waited for again
                        await keeper.settled.wait()
        except BaseException:
            await self.aclose()
            raise
        fatal = next((k.fatal for k in self._keepers if k.fatal is not None), None)
        if fatal is not None:
            await self.aclose()
            raise fatal
        self._late = True
        for keeper in self._keepers:
            if not keeper.answered.is_set():  # its backend said nothing: one that never answers
                logger.warning(
                    "tier %s has not answered within tier_answer_wait=%g s (an endpoint "
                    "that says nothing): the manager opens without it, and it joins "
                    "when an attempt to open it succeeds",
                    keeper.tier.name,
                    answer_wait,
                )
            elif not keeper.settled.is_set():  # answered, neither open nor failed: slow
                logger.warning(
                    "tier %s is still opening after tier_open_wait=%g s: the manager opens "
                    "without it and it joins when its open ends (writes to it are dropped "
                    "until then, counted as 'unavailable'; a tier named in deferred gets "
                    "them when it joins)",
                    keeper.tier.name,
                    wait,
                )

    async def aclose(self) -> None:
        """Stop every keeper: an open tier is closed by its keeper, not cancelled (it bounds
        its own cleanup); an open in progress or a wait for the next attempt is cancelled,
        and what a half-done open set up is closed, shielded, within ``close_timeout``."""
        task_group, self._task_group = self._task_group, None
        if task_group is None:
            return
        self._late = False
        for keeper in self._keepers:
            keeper.stop.set()
            if not keeper.is_open:
                keeper.scope.cancel()
        await task_group.__aexit__(None, None, None)

    async def _keep(self, keeper: _Keeper) -> None:
        """Open ``keeper``'s tier, again and again with backoff until it opens; then keep it
        open until the manager closes."""
        delay = RETRY_FIRST
        with keeper.scope:
            while True:
                await self._attempt(keeper)  # returns when it failed, or at close
                keeper.settled.set()
                keeper.answered.set()
                if keeper.stop.is_set() or (keeper.fatal is not None and not self._late):
                    return  # closing, or the manager's open raises the error
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MOST)

    async def _attempt(self, keeper: _Keeper) -> None:
        """One attempt to open the tier, bounded by ``open_timeout``. It returns when the
        attempt failed; a tier that opened stays open in here, and it returns once the
        manager's close has closed it."""
        tier = keeper.tier
        keeper.attempts += 1
        opened = False
        try:
            # The scope that bounds the open stays entered while the tier is open: task
            # groups the tier enters while opening are left before it, at close.
            with anyio.CancelScope() as bound:
                if self._open_timeout is not None:
                    bound.deadline = anyio.current_time() + self._open_timeout
                try:
                    await _warm_up(tier, keeper.warm)
                    with hearing_answers(keeper.answered.set):
                        await tier.__aenter__()
                except Exception as exc:
                    self._failed(keeper, exc)
                    return
                opened = True
                bound.deadline = math.inf
                await self._serve(keeper)
                return
            self._failed(keeper, _timed_out(tier, self._open_timeout))
        finally:
            if not opened:  # whatever the failed, timed-out or cancelled open set up
                with anyio.move_on_after(self._close_timeout, shield=True):
                    await tier.aclose()

    async def _serve(self, keeper: _Keeper) -> None:
        """The tier is open: it joins (the manager asks it and writes to it), and stays
        open until the manager closes; then it is closed here, in the task that opened it."""
        tier = keeper.tier
        remove = tier.add_listener(self._listener)
        try:
            keeper.is_open = True
            if self._late:
                self.joined_late += 1
                logger.warning(
                    "tier %s opened after %d failed attempt(s): it joins the manager now",
                    tier.name,
                    keeper.attempts - 1,
                )
            self._changed()
            keeper.settled.set()
            keeper.answered.set()
            await keeper.stop.wait()
        finally:
            keeper.is_open = False
            remove()
            await tier.aclose()  # not shielded: each tier shields and bounds its own cleanup

    def _failed(self, keeper: _Keeper, exc: Exception) -> None:
        """An attempt failed: count it, say it once per burst, and remember a configuration
        error for the manager's open to raise."""
        self.open_failures += 1
        if isinstance(exc, InvalidArgumentError):
            keeper.fatal = exc
            if not self._late:
                return  # raised by the manager's open, not logged
        self._log.warning(
            "open:" + keeper.tier.name,
            "tier %s cannot open (%r): the manager goes on without it (lookups are "
            "'unavailable' misses, writes to it are dropped) and opens it again in the "
            "background",
            keeper.tier.name,
            exc,
        )

    def __repr__(self) -> str:
        return f"<TierKeepers unavailable={list(self.unavailable())}>"
