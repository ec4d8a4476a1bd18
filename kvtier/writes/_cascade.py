"""The write of a group of blocks from the pool to the tiers admitted for them (a cascade).

``WriteThrough`` decides which tiers take each block and launches one cascade per group of
blocks bound for the same tiers (the blocks of one store, usually): one task reads the
blocks from their pinned slots (or one block from a copy taken as it left the pool), stores
them in every target tier at once, each tier with one ``store_many``, under one
``store_timeout``; it reports each block's store to the admission policy, tells the tier's
listeners, and gives back the pins and the bytes in flight. A task per block, with its own
cancel scope and timer, cost more loop time than the block's bookkeeping. A task cancelled
before it ran gives everything back through its undo (``kvtier.common._background``).

A deferred copy of a block reads it from a faster tier, so it must not ask that tier before the
block's own write-through has reached it: ``wait_begun`` waits until every store of the
block's cascades in flight has begun (each tier then knows it is writing the block and answers
RETRY, not MISS) or ended. The waiters are woken from a loop callback queued as the last store
begins, so they run after whatever the tier's store started in that step.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

import anyio
import anyio.abc

from kvtier.common._lookup import MissReason
from kvtier.tiers._base import SecondaryTier, one_per_key
from kvtier.writes._account import WriteAccount, bump, reason_of_failure

__all__ = ["Cascades"]


class _Cascade:
    """One launched group: its keys and where their bytes come from (pinned ``slots``, or
    the ``copy`` of a single block), the tiers to write, and what each block met: the
    tiers whose store began (they report to the admission themselves) and the failures."""

    __slots__ = ("begun", "copy", "failures", "keys", "slots", "targets")

    def __init__(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        copy: bytes | None,
        targets: tuple[SecondaryTier, ...],
    ) -> None:
        self.keys = keys
        self.slots = slots
        self.copy = copy
        self.targets = targets
        self.begun: list[list[SecondaryTier]] = [[] for _ in keys]
        self.failures: list[list[MissReason]] = [[] for _ in keys]


class Cascades:
    """Launches and runs the cascades, counted in ``account``. ``track``: keep what
    ``wait_begun`` needs (only when some tier takes deferred copies)."""

    def __init__(self, account: WriteAccount, *, track: bool) -> None:
        self.account = account
        self.pool = account.pool
        self.admission = account.admission
        # With ``track``: key -> cascades launched that have not yet begun every store, and
        # an event for each key a deferred copy waits on (see ``wait_begun``).
        self._cascading: dict[bytes, int] | None = {} if track else None
        self._cascade_ends: dict[bytes, anyio.Event] = {}

    def launch(
        self,
        task_group: anyio.abc.TaskGroup,
        keys: Sequence[bytes],
        targets: Sequence[SecondaryTier],
        *,
        slots: Sequence[int] = (),
        copy: bytes | None = None,
    ) -> None:
        """Start writing the pinned ``slots`` of ``keys`` (or the ``copy`` of the one block
        of ``keys``) to ``targets``, each already admitted for every block, their bytes in
        flight already taken (``WriteAccount.take``); the write gives the pins back."""
        assert (copy is None) == (len(slots) == len(keys)), "slots for each key, or one copy"
        cascading = self._cascading
        if cascading is not None:
            for key in keys:
                cascading[key] = cascading.get(key, 0) + 1
        cascade = _Cascade(keys, slots, copy, tuple(targets))
        undo = functools.partial(self._never_ran, cascade)
        self.account.background.start_soon(task_group, undo, self._cascade, cascade)

    async def wait_begun(self, key: bytes) -> None:
        """Return once no cascade of ``key`` is launched without having begun its stores."""
        cascading = self._cascading
        while cascading is not None and key in cascading:
            ended = self._cascade_ends.get(key)
            if ended is None:
                ended = self._cascade_ends[key] = anyio.Event()
            await ended.wait()

    def _never_ran(self, cascade: _Cascade) -> None:
        """Give back what ``launch`` took for a write whose task was cancelled unstarted."""
        nbytes = self.pool.block_bytes
        for i, key in enumerate(cascade.keys):
            for tier in cascade.targets:
                self.admission.cancel(tier.name, nbytes)
            if cascade.copy is None:
                self.pool.unpin(cascade.slots[i])
            self.account.in_flight_bytes -= nbytes
            self._reached(key)
            self.account.cascades.finished()

    def _reached(self, key: bytes) -> None:
        """A cascade of ``key`` has begun every tier's store (each tier knows it is writing
        the block now), or ended first: wake the deferred copies waiting for it."""
        cascading = self._cascading
        if cascading is None:
            return
        left = cascading.pop(key, 1) - 1
        if left:
            cascading[key] = left
        elif (ended := self._cascade_ends.pop(key, None)) is not None:
            ended.set()

    async def _cascade(self, cascade: _Cascade) -> None:
        account, nbytes = self.account, self.pool.block_bytes
        write = functools.partial(self._write_through, cascade)
        try:
            with anyio.fail_after(account.store_timeout):
                if cascade.copy is None:
                    drained = await self.pool.drain_many(cascade.slots, write)
                    for i, outcome in enumerate(drained):
                        if outcome is not None:
                            cascade.failures[i].append(reason_of_failure(outcome))
                else:
                    await write((0,), (memoryview(cascade.copy),))
        except Exception as exc:
            reason = reason_of_failure(exc)
            for failures in cascade.failures:
                failures.append(reason)
        finally:
            for i, key in enumerate(cascade.keys):
                for tier in cascade.targets:
                    if tier not in cascade.begun[i]:  # never began: give the admission back
                        self.admission.cancel(tier.name, nbytes)
                if cascade.copy is None:
                    self.pool.unpin(cascade.slots[i])
                account.in_flight_bytes -= nbytes
                if len(cascade.begun[i]) < len(cascade.targets):  # ended before every tier
                    self._reached(key)
            try:
                account.room_again()  # before this one stops counting: closing waits for it
            finally:
                for _ in cascade.keys:
                    account.cascades.finished()
        for failures in cascade.failures:
            for reason in failures:
                bump(account.failures, reason)
            account.succeeded += not failures

    async def _write_through(
        self, cascade: _Cascade, positions: Sequence[int], views: Sequence[memoryview]
    ) -> None:
        """Store the blocks at ``positions`` of the cascade in every target at once."""
        targets = cascade.targets
        if len(targets) == 1:  # the common case: no task group and task to build
            await self._store(cascade, targets[0], positions, views)
            return
        async with anyio.create_task_group() as tg:
            for tier in targets:
                tg.start_soon(self._store, cascade, tier, positions, views)

    async def _store(
        self,
        cascade: _Cascade,
        tier: SecondaryTier,
        positions: Sequence[int],
        views: Sequence[memoryview],
    ) -> None:
        """One tier's store of the blocks at ``positions``: one ``store`` for one block, one
        ``store_many`` for more; each block's outcome counted and reported on its own."""
        keys = [cascade.keys[i] for i in positions]
        reached: list[bytes] = []
        for i in positions:
            begun = cascade.begun[i]
            begun.append(tier)  # from here on this write reports to the admission itself
            if len(begun) == len(cascade.targets):
                reached.append(cascade.keys[i])
        if reached and self._cascading is not None:  # after the store below has begun
            asyncio.get_running_loop().call_soon(self._reached_all, reached)
        started = time.perf_counter()
        outcomes: Sequence[BaseException | None]
        try:
            if len(keys) == 1:
                await tier.store(keys[0], views[0])
                outcomes = (None,)
            else:
                outcomes = one_per_key(
                    await tier.store_many(keys, views), keys, tier.name, "store_many"
                )
        except Exception as exc:
            outcomes = [exc] * len(keys)
        finally:  # cancelled too (the cascade's deadline): the tier held the bytes this long
            seconds = time.perf_counter() - started
            for _ in keys:
                self.admission.finished(tier.name, views[0].nbytes, seconds)
        stored: list[bytes] = []
        for i, key, outcome in zip(positions, keys, outcomes, strict=True):
            if outcome is None:
                stored.append(key)
            else:
                self._failed(cascade, i, tier, outcome)
        if stored:
            self.account.callback("notify", tier.notify, stored)

    def _reached_all(self, keys: list[bytes]) -> None:
        for key in keys:
            self._reached(key)

    def _failed(
        self, cascade: _Cascade, position: int, tier: SecondaryTier, exc: BaseException
    ) -> None:
        reason = reason_of_failure(exc)
        cascade.failures[position].append(reason)
        self.account.burst_log.warning(
            "store:" + tier.name,
            "write-through to %s failed (%s): %r",
            tier.name,
            reason.value,
            exc,
        )
