"""The write of one block from the pool to the tiers admitted for it (a cascade).

``WriteThrough`` decides which tiers take a block and launches its cascade here: the task
reads the block from its pinned slot (or from a copy taken as it left the pool), stores it in
every target tier at once under ``store_timeout``, reports each store's time to the admission
policy, tells the tier's listeners, and gives back the pin and the bytes in flight. A task
cancelled before it ran gives everything back through its undo (``kvtier._background``).

A deferred copy of a block reads it from a faster tier, so it must not ask that tier before the
block's own write-through has reached it: ``wait_begun`` waits until every store of the
block's cascades in flight has begun (each tier then knows it is writing the block and answers
RETRY, not MISS) or ended.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import anyio
import anyio.abc

from kvtier._lookup import MissReason
from kvtier.tiers._base import SecondaryTier
from kvtier.writes._account import WriteAccount, bump, reason_of

__all__ = ["Cascades"]


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
        key: bytes,
        slot: int | bytes,
        targets: Sequence[SecondaryTier],
    ) -> None:
        """Start writing the pinned ``slot`` (or a copy of the block) to ``targets``, each
        already admitted; the write gives the pin back."""
        nbytes = self.pool.block_bytes
        self.account.take()
        if self._cascading is not None:
            self._cascading[key] = self._cascading.get(key, 0) + 1
        targets = tuple(targets)
        undo = functools.partial(self._never_ran, key, slot, nbytes, targets)
        self.account.background.start_soon(
            task_group, undo, self._cascade, key, slot, nbytes, targets
        )

    async def wait_begun(self, key: bytes) -> None:
        """Return once no cascade of ``key`` is launched without having begun its stores."""
        cascading = self._cascading
        while cascading is not None and key in cascading:
            ended = self._cascade_ends.get(key)
            if ended is None:
                ended = self._cascade_ends[key] = anyio.Event()
            await ended.wait()

    def _never_ran(
        self, key: bytes, slot: int | bytes, nbytes: int, targets: tuple[SecondaryTier, ...]
    ) -> None:
        """Give back what ``launch`` took for a write whose task was cancelled unstarted."""
        for tier in targets:
            self.admission.cancel(tier.name, nbytes)
        if isinstance(slot, int):
            self.pool.unpin(slot)
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

    async def _cascade(
        self, key: bytes, slot: int | bytes, nbytes: int, targets: tuple[SecondaryTier, ...]
    ) -> None:
        failures: list[MissReason] = []
        # The tiers whose write started (and reports itself); once all have, the deferred
        # copies waiting for this one are told (``_reached``).
        begun: list[SecondaryTier] = []
        write = functools.partial(self._write_through, key, targets, failures, begun)
        account = self.account
        try:
            with anyio.fail_after(self.account.store_timeout):
                if isinstance(slot, int):
                    await self.pool.drain(slot, write)
                else:
                    await write(memoryview(slot))
        except Exception as exc:
            failures.append(reason_of(exc))
        finally:
            for tier in targets:
                if tier not in begun:  # the drain failed first: give the admission back
                    self.admission.cancel(tier.name, nbytes)
            if isinstance(slot, int):
                self.pool.unpin(slot)
            account.in_flight_bytes -= nbytes
            if len(begun) < len(targets):  # ended before reaching every tier
                self._reached(key)
            try:
                account.room_again()  # before this one stops counting: closing waits for it
            finally:
                account.cascades.finished()
        for reason in failures:
            bump(account.failures, reason)
        account.succeeded += not failures

    async def _write_through(
        self,
        key: bytes,
        targets: tuple[SecondaryTier, ...],
        failures: list[MissReason],
        begun: list[SecondaryTier],
        view: memoryview,
    ) -> None:
        if len(targets) == 1:  # the common case: no task group and task to build
            await self._store_one(targets[0], key, view, failures, begun, 1)
            return
        async with anyio.create_task_group() as tg:
            for tier in targets:
                tg.start_soon(self._store_one, tier, key, view, failures, begun, len(targets))

    async def _store_one(
        self,
        tier: SecondaryTier,
        key: bytes,
        view: memoryview,
        failures: list[MissReason],
        begun: list[SecondaryTier],
        targets: int,
    ) -> None:
        begun.append(tier)  # from here on this write reports to the admission policy itself
        if len(begun) == targets:
            # The last to begin: the others' stores took the key when they began, this one
            # takes it in this same step, before a deferred copy woken here can ask.
            self._reached(key)
        started = time.perf_counter()
        try:
            await tier.store(key, view)
        except Exception as exc:
            reason = reason_of(exc)
            failures.append(reason)
            self.account.burst_log.warning(
                "store:" + tier.name,
                "write-through to %s failed (%s): %r",
                tier.name,
                reason.value,
                exc,
            )
        else:
            self.account.callback("notify", tier.notify, [key])
        finally:
            self.admission.finished(tier.name, view.nbytes, time.perf_counter() - started)
