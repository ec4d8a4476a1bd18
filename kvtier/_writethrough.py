"""Write-through: copying stored blocks from the pool to the secondary tiers (design §3).

The manager hands each newly stored block to ``WriteThrough``, which asks the admission
policy (``kvtier._admission``) which tiers take it now, pins the slot, counts the bytes in
flight against ``max_in_flight_bytes`` and writes the block to those tiers in a background
task; blocks for write-back tiers wait pinned in the ``WriteBackQueue`` until they must leave
the pool. Two more sources of writes go through the same admission and accounting: a block
promoted from a slower tier is written up to the faster ones (``write_up``), and writes that
back-pressure dropped for a ``deferred`` tier are copied to it later from a faster tier
(``drain_deferred``). Everything here runs in the manager's task group, under
``store_timeout``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.abc

from kvtier._admission import AdmissionPolicy, DeferredWrites, WriteBackQueue
from kvtier._background import Background, InFlight
from kvtier._errors import TierError
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier, settled_lookup

__all__ = ["WriteThrough", "bump", "reason_of"]

DEFERRED_LIMIT = 65536
"""Keys waiting per deferred tier; past it the oldest is given up (see ``DeferredWrites``)."""


def bump(counter: dict[str, int], reason: MissReason) -> None:
    counter[reason.value] = counter.get(reason.value, 0) + 1


def reason_of(exc: BaseException) -> MissReason:
    """The miss reason a failed tier operation is counted and remembered under."""
    if isinstance(exc, TimeoutError):
        return MissReason.TIMEOUT
    if isinstance(exc, TierError):
        return exc.reason
    return MissReason.UNAVAILABLE


class WriteThrough:
    """Writes stored blocks to the tiers, each tier as its admission allows.

    ``background`` starts and counts every background task of the manager (promotions
    too); ``cascades`` counts only the writes, which is what closing waits for. ``callback``
    calls a tier's hook with its exceptions contained (the manager's ``_callback``).
    """

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[SecondaryTier],
        admission: AdmissionPolicy,
        *,
        max_in_flight_bytes: int,
        store_timeout: float,
        write_back_limit: int,
        background: Background,
        callback: Callable[..., None],
        log: BurstLogger,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self._max_in_flight_bytes = max_in_flight_bytes
        self._store_timeout = store_timeout
        self.write_back = WriteBackQueue(write_back_limit)
        self.write_back_tiers = tuple(t for t in tiers if admission.is_write_back(t.name))
        self.through_tiers = tuple(t for t in tiers if not admission.is_write_back(t.name))
        self._above = {  # id(tier) -> the write-through tiers before it
            id(tier): tuple(t for t in tiers[:i] if t in self.through_tiers)
            for i, tier in enumerate(tiers)
        }
        self._sources = {tier.name: tuple(tiers[:i]) for i, tier in enumerate(tiers)}
        self._by_name = {tier.name: tier for tier in tiers}
        self.deferred = DeferredWrites(
            [t.name for t in self.through_tiers[1:] if admission.is_deferred(t.name)],
            DEFERRED_LIMIT,
        )
        self._background = background
        self.cascades = InFlight()  # write-through only: what exit waits for
        self._callback = callback
        self._log = log
        self.task_group: anyio.abc.TaskGroup | None = None  # the manager's, while open
        self.closing = False  # deferred writes then ignore latency: close_timeout bounds them
        self.in_flight_bytes = 0
        self.started = self.succeeded = self.skipped = self.cancelled = 0
        self.written_up = 0  # promoted blocks whose write to the tiers above was started
        self.failures: dict[str, int] = {}

    def after_store(self, task_group: anyio.abc.TaskGroup, key: bytes, *, closing: bool) -> None:
        """Write a just-stored block through to the tiers that admit it now; hold it for the
        write-back tiers."""
        if self.deferred:  # a rate limit refills with time: older deferred writes go first
            self.drain_deferred(task_group)
        if self.write_back_tiers and key not in self.write_back:
            slot = self.pool.pin(key)  # not evictable until written back
            if slot is not None:
                self.write_back.add(key, slot)
        if self.through_tiers and self._write(task_group, key, self.through_tiers) is None:
            return
        if self.write_back:  # while closing (a store that raced aclose), write back at once
            self.flush(task_group, everything=closing)

    def write_up(self, task_group: anyio.abc.TaskGroup, key: bytes, source: SecondaryTier) -> None:
        """Write a block just promoted from ``source`` to the write-through tiers above it,
        so that the next time it leaves the pool it is found in a faster tier (a node that
        promotes from a shared S3 tier keeps a copy on its own disk). Admitted, counted and
        dropped under back-pressure exactly like a store's write-through; write-back tiers
        are not given promoted blocks."""
        targets = self._above.get(id(source))
        if targets and self._write(task_group, key, targets):
            self.written_up += 1

    def _write(
        self, task_group: anyio.abc.TaskGroup, key: bytes, tiers: Sequence[SecondaryTier]
    ) -> bool | None:
        """Start writing ``key``'s block to those of ``tiers`` that admit it now: True if
        started, False if every tier dropped it, None if the global in-flight limit or an
        eviction skipped it (counted in ``skipped``)."""
        nbytes = self.pool.block_bytes
        if self.in_flight_bytes + nbytes > self._max_in_flight_bytes:
            self.skipped += 1
            return None
        targets: list[SecondaryTier] = []
        for tier in tiers:
            if self.admission.admit(tier.name, nbytes):
                targets.append(tier)
            else:  # counted as dropped by the policy; said once per burst
                cause = self.admission.last_refusal(tier.name)
                if self.deferred.wants(tier.name):
                    self.deferred.add(tier.name, key)  # written later from a faster tier
                    self._log.warning(
                        "admission:" + tier.name,
                        "%s refuses writes for now (%s): they are deferred, to be copied "
                        "from a faster tier when it has room",
                        tier.name,
                        cause,
                    )
                else:
                    self._log.warning(
                        "admission:" + tier.name,
                        "%s refuses writes for now (%s): write-through to it is dropped "
                        "until it has room",
                        tier.name,
                        cause,
                    )
        if not targets:
            return False
        slot = self.pool.pin(key)
        if slot is None:  # already evicted by a later store in the same burst
            for tier in targets:
                self.admission.cancel(tier.name, nbytes)
            self.skipped += 1
            return None
        self._launch(task_group, key, slot, targets)
        return True

    def flush(self, task_group: anyio.abc.TaskGroup, *, everything: bool = False) -> None:
        """Start the write-backs the queue says are due (see ``WriteBackQueue.due``)."""
        by_name = {tier.name: tier for tier in self.write_back_tiers}
        writes, unpin = self.write_back.due(
            self.admission, list(by_name), self.pool.block_bytes, everything=everything
        )
        for key, slot, names in writes:
            self._launch(task_group, key, slot, [by_name[name] for name in names])
        for slot in unpin:
            self.pool.unpin(slot)

    def _launch(
        self,
        task_group: anyio.abc.TaskGroup,
        key: bytes,
        slot: int,
        targets: Sequence[SecondaryTier],
    ) -> None:
        """Start writing the pinned ``slot`` to ``targets``; the write gives the pin back."""
        nbytes = self.pool.block_bytes
        self.in_flight_bytes += nbytes
        self.started += 1
        self.cascades.started()
        targets = tuple(targets)
        undo = functools.partial(self._never_ran, slot, nbytes, targets)
        self._background.start_soon(task_group, undo, self._cascade, key, slot, nbytes, targets)

    def _never_ran(self, slot: int, nbytes: int, targets: tuple[SecondaryTier, ...]) -> None:
        """Give back what ``_launch`` took for a write whose task was cancelled unstarted."""
        for tier in targets:
            self.admission.cancel(tier.name, nbytes)
        self.pool.unpin(slot)
        self.in_flight_bytes -= nbytes
        self.cascades.finished()

    async def _cascade(
        self, key: bytes, slot: int, nbytes: int, targets: tuple[SecondaryTier, ...]
    ) -> None:
        failures: list[MissReason] = []
        begun: list[SecondaryTier] = []  # the tiers whose write started (and reports itself)
        write = functools.partial(self._write_through, key, targets, failures, begun)
        try:
            with anyio.fail_after(self._store_timeout):
                await self.pool.drain(slot, write)
        except Exception as exc:
            failures.append(reason_of(exc))
        finally:
            for tier in targets:
                if tier not in begun:  # the drain failed first: give the admission back
                    self.admission.cancel(tier.name, nbytes)
            self.pool.unpin(slot)
            self.in_flight_bytes -= nbytes
            self._room_again()  # before this one stops counting: closing waits for the next
            self.cascades.finished()
        for reason in failures:
            bump(self.failures, reason)
        self.succeeded += not failures

    def _room_again(self) -> None:
        """A write ended: start the write-backs and deferred writes that now fit."""
        task_group = self.task_group
        if task_group is None:
            return
        if self.write_back:
            self.flush(task_group)
        if self.deferred:
            self.drain_deferred(task_group)

    def drain_deferred(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the deferred writes that the tiers' admission and the in-flight limit
        take now; each copies its block from a faster tier that holds it."""
        nbytes = self.pool.block_bytes
        room = (self._max_in_flight_bytes - self.in_flight_bytes) // nbytes
        if room <= 0:
            return
        for name, key in self.deferred.due(self.admission, nbytes, room, closing=self.closing):
            target = self._by_name[name]
            self.in_flight_bytes += nbytes
            self.started += 1
            self.cascades.started()
            undo = functools.partial(self._write_down_never_ran, target, nbytes)
            self._background.start_soon(task_group, undo, self._write_down, key, target, nbytes)

    def _write_down_never_ran(self, target: SecondaryTier, nbytes: int) -> None:
        self.admission.cancel(target.name, nbytes)
        self.in_flight_bytes -= nbytes
        self.deferred.lost += 1
        self.cascades.finished()

    async def _source_of(self, key: bytes, target: SecondaryTier) -> SecondaryTier | None:
        """The first tier above ``target`` that holds ``key``. A tier still finding out
        (its own write of the block in flight, an existence check) is waited for: asked
        at once, it would answer RETRY and the block would be lost for ``target``."""
        for tier in self._sources[target.name]:
            if await settled_lookup(tier, key) is LookupResult.HIT:
                return tier
        return None

    async def _write_down(self, key: bytes, target: SecondaryTier, nbytes: int) -> None:
        """Copy a deferred block from a faster tier that holds it to ``target``. One that
        cannot be copied (no faster tier holds it any more, cancelled at close) is lost."""
        began: float | None = None
        written = False
        failure: MissReason | None = None
        try:
            with anyio.fail_after(self._store_timeout):
                source = await self._source_of(key, target)
                if source is not None:
                    buffer = memoryview(bytearray(nbytes))
                    await source.load(key, buffer)
                    began = time.perf_counter()
                    await target.store(key, buffer)
                    written = True
        except Exception as exc:
            failure = reason_of(exc)
            self._log.warning(
                "store:" + target.name,
                "deferred write to %s failed (%s): %r",
                target.name,
                failure.value,
                exc,
            )
        finally:
            if began is None:
                self.admission.cancel(target.name, nbytes)
            else:
                self.admission.finished(target.name, nbytes, time.perf_counter() - began)
            self.in_flight_bytes -= nbytes
            if not written:
                self.deferred.lost += 1
            self._room_again()  # before this one stops counting: closing waits for the next
            self.cascades.finished()
        if failure is not None:
            bump(self.failures, failure)
        elif written:
            self.succeeded += 1
            self.deferred.written += 1
            self._callback("notify", target.notify, [key])

    async def _write_through(
        self,
        key: bytes,
        targets: tuple[SecondaryTier, ...],
        failures: list[MissReason],
        begun: list[SecondaryTier],
        view: memoryview,
    ) -> None:
        async with anyio.create_task_group() as tg:
            for tier in targets:
                tg.start_soon(self._store_one, tier, key, view, failures, begun)

    async def _store_one(
        self,
        tier: SecondaryTier,
        key: bytes,
        view: memoryview,
        failures: list[MissReason],
        begun: list[SecondaryTier],
    ) -> None:
        begun.append(tier)  # from here on this write reports to the admission policy itself
        started = time.perf_counter()
        try:
            await tier.store(key, view)
        except Exception as exc:
            reason = reason_of(exc)
            failures.append(reason)
            self._log.warning(
                "store:" + tier.name,
                "write-through to %s failed (%s): %r",
                tier.name,
                reason.value,
                exc,
            )
        else:
            self._callback("notify", tier.notify, [key])
        finally:
            self.admission.finished(tier.name, view.nbytes, time.perf_counter() - started)

    def __repr__(self) -> str:
        return (
            f"<WriteThrough running={self.cascades.count} in_flight_bytes={self.in_flight_bytes}"
            f" dirty={len(self.write_back)}>"
        )
