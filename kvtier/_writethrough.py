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

A tier that packs the stores it is given together into one object (``write_batch`` > 1:
one request per pack, and one request for a node that later reads them) gets its deferred
writes in groups: each group is one task that loads every block of the group from the
faster tiers, then starts all its stores at once, so that they reach the tier in the same
event-loop tick. While such a tier has deferred writes waiting, new writes for it join the
queue rather than going out one by one ahead of it.

A deferred write copies its block from a faster tier, so it waits for that tier to have it:
first for the block's own write-through to reach the tiers (launched, its task may not have
run yet), then for a tier that answers RETRY while it writes the block (``settled_lookup``).
And the queue drains on its own: when the tiers' admission leaves work waiting for time
alone (a rate budget that refills, a latency probe that comes due), one timer wakes the
drain when the admission says there will be room; waits that a write ending resolves need
none, since every write ending drains again.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import anyio.abc

from kvtier._admission import AdmissionPolicy
from kvtier._background import Background, InFlight
from kvtier._deferred import DeferredWrites
from kvtier._errors import TierError
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier._writeback import WriteBackQueue
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier, settled_lookup

__all__ = ["WriteThrough", "bump", "reason_of"]

DEFERRED_LIMIT = 65536
"""Keys waiting per deferred tier; past it the oldest is given up (see ``DeferredWrites``)."""

WAKE_SLACK = 0.001
"""Seconds added to the time the admission says a deferred tier has room again, so that the
drain the timer starts is not refused by the rounding of a token bucket's refill."""


def bump(counter: dict[str, int], reason: MissReason) -> None:
    counter[reason.value] = counter.get(reason.value, 0) + 1


class _Down:
    """One key of a group of deferred writes, settled (counted) exactly once."""

    __slots__ = ("began", "buffer", "key", "settled", "written")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.buffer: memoryview | None = None  # the block, once loaded from a faster tier
        self.began: float | None = None  # when its store started (None: never started)
        self.written = self.settled = False


async def _each(items: Sequence[_Down], step: Callable[[_Down], Coroutine[Any, Any, None]]) -> None:
    """Run ``step`` on every item at once: all the tasks are started back to back, so each
    reaches its first wait in the same event-loop tick."""
    if len(items) == 1:
        await step(items[0])
        return
    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(step, item)


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
        deferred = [t for t in self.through_tiers[1:] if admission.is_deferred(t.name)]
        self.deferred = DeferredWrites([t.name for t in deferred], DEFERRED_LIMIT)
        self._deferred_names = tuple(t.name for t in deferred)
        # With deferred tiers: key -> write-through tasks launched that have not yet begun
        # their tiers' stores, and an event for each key a deferred write waits on (see
        # ``_source_of``).
        self._cascading: dict[bytes, int] | None = {} if deferred else None
        self._cascade_ends: dict[bytes, anyio.Event] = {}
        # The one pending wake-up of the deferred writes: the task group it runs in and the
        # scope whose deadline it sleeps until (moved earlier when a sooner one is asked).
        self._timer: tuple[anyio.abc.TaskGroup, anyio.CancelScope] | None = None
        self._batch = {  # packing deferred tier -> group size (the groups always fit)
            tier.name: size for tier in deferred if (size := self._group_size(tier)) > 1
        }
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

    def _group_size(self, tier: SecondaryTier) -> int:
        """The tier's ``write_batch``, cut to what the global and the tier's own in-flight
        limits can hold at once: a group is admitted whole, so a larger one never would."""
        nbytes = self.pool.block_bytes
        size = min(int(tier.write_batch), self._max_in_flight_bytes // nbytes)
        capacity = self.admission.capacity(tier.name, nbytes)
        return max(1, size if capacity is None else min(size, capacity))

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

    def writes_up(self, source: SecondaryTier) -> bool:
        """Whether blocks promoted from ``source`` have write-through tiers above it."""
        return bool(self._above.get(id(source)))

    def write_up(
        self,
        task_group: anyio.abc.TaskGroup,
        key: bytes,
        source: SecondaryTier,
        copy: Callable[[], bytes | None] | None = None,
    ) -> None:
        """Write a block promoted from ``source`` to the write-through tiers above it, so
        that the next time it is needed it is found in a faster tier (a node that promotes
        from a shared S3 tier keeps a copy on its own disk). Admitted, counted and dropped
        under back-pressure exactly like a store's write-through; write-back tiers are not
        given promoted blocks. ``copy``: the block is leaving the pool (evicted), so it is
        written from a copy taken now instead of its pinned slot."""
        targets = self._above.get(id(source))
        if targets and self._write(task_group, key, targets, copy):
            self.written_up += 1

    def _write(
        self,
        task_group: anyio.abc.TaskGroup,
        key: bytes,
        tiers: Sequence[SecondaryTier],
        copy: Callable[[], bytes | None] | None = None,
    ) -> bool | None:
        """Start writing ``key``'s block (its pinned slot, or what ``copy`` returns) to those
        of ``tiers`` that admit it now: True if started, False if every tier dropped it, None
        if the global in-flight limit or an eviction skipped it (counted in ``skipped``)."""
        nbytes = self.pool.block_bytes
        if self.in_flight_bytes + nbytes > self._max_in_flight_bytes:
            self.skipped += 1
            return None
        targets: list[SecondaryTier] = []
        for tier in tiers:
            if tier.name in self._batch and self.deferred.pending(tier.name):
                # Its deferred writes wait for a group's worth of room: this one joins them
                # (written in a group, in turn) rather than taking that room one block first.
                self.deferred.add(tier.name, key)
            elif self.admission.admit(tier.name, nbytes):
                targets.append(tier)
            else:  # counted as dropped by the policy; said once per burst
                cause = self.admission.last_refusal(tier.name)
                if self.deferred.wants(tier.name):
                    self.deferred.add(tier.name, key)  # written later from a faster tier
                    self._wake_later(task_group, (tier.name,))
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
        slot: int | bytes | None = self.pool.pin(key) if copy is None else copy()
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
        slot: int | bytes,
        targets: Sequence[SecondaryTier],
    ) -> None:
        """Start writing the pinned ``slot`` (or a copy of the block) to ``targets``; the
        write gives the pin back."""
        nbytes = self.pool.block_bytes
        self.in_flight_bytes += nbytes
        self.started += 1
        self.cascades.started()
        if self._cascading is not None:
            self._cascading[key] = self._cascading.get(key, 0) + 1
        targets = tuple(targets)
        undo = functools.partial(self._never_ran, key, slot, nbytes, targets)
        self._background.start_soon(task_group, undo, self._cascade, key, slot, nbytes, targets)

    def _never_ran(
        self, key: bytes, slot: int | bytes, nbytes: int, targets: tuple[SecondaryTier, ...]
    ) -> None:
        """Give back what ``_launch`` took for a write whose task was cancelled unstarted."""
        for tier in targets:
            self.admission.cancel(tier.name, nbytes)
        if isinstance(slot, int):
            self.pool.unpin(slot)
        self.in_flight_bytes -= nbytes
        self._cascade_reached(key)
        self.cascades.finished()

    def _cascade_reached(self, key: bytes) -> None:
        """A write-through of ``key`` has begun every tier's store (each tier knows it is
        writing the block now), or ended first: wake the deferred writes waiting for it."""
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
        # writes waiting for this one are told (``_cascade_reached``).
        begun: list[SecondaryTier] = []
        write = functools.partial(self._write_through, key, targets, failures, begun)
        try:
            with anyio.fail_after(self._store_timeout):
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
            self.in_flight_bytes -= nbytes
            if len(begun) < len(targets):  # ended before reaching every tier
                self._cascade_reached(key)
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
        take now; each copies its block from a faster tier that holds it. A packing tier's
        come in groups (see ``DeferredWrites.due_groups``), one task each. What is left for
        want of time alone gets a wake-up (``_wake_later``); what waits for room in flight
        is drained again when a write ends."""
        nbytes = self.pool.block_bytes
        room = (self._max_in_flight_bytes - self.in_flight_bytes) // nbytes
        if room <= 0:
            return
        due = self.deferred.due_groups(
            self.admission, nbytes, room, sizes=self._batch, closing=self.closing
        )
        for name, keys in due:
            target = self._by_name[name]
            self.in_flight_bytes += nbytes * len(keys)
            self.started += len(keys)
            for _ in keys:
                self.cascades.started()
            undo = functools.partial(self._write_down_never_ran, target, nbytes, len(keys))
            self._background.start_soon(task_group, undo, self._write_down, keys, target, nbytes)
        if self.deferred:
            self._wake_later(task_group, self._deferred_names)

    def _wake_later(self, task_group: anyio.abc.TaskGroup, names: Sequence[str]) -> None:
        """Make sure the deferred writes of ``names`` are drained again once the admission
        says the passing of time alone gives one of them room (its rate budget refilled, its
        latency probe due): one timer in the manager's task group, its deadline moved
        earlier if a sooner wake-up is needed, cancelled with the group at close. Nothing
        to do while closing (the rate and latency no longer apply) or when only a write
        ending makes room (every write ending drains)."""
        if self.closing:
            return
        nbytes = self.pool.block_bytes
        soonest = math.inf
        for name in names:
            pending = self.deferred.pending(name)
            if pending:
                count = min(pending, self._batch.get(name, 1))
                wait = self.admission.ready_in(name, nbytes, count=count)
                if wait is not None and wait > 0:
                    soonest = min(soonest, wait)
        if soonest == math.inf:
            return
        deadline = anyio.current_time() + soonest + WAKE_SLACK
        timer = self._timer
        if timer is not None and timer[0] is task_group:  # one is pending already
            if deadline < timer[1].deadline:
                timer[1].deadline = deadline
            return
        scope = anyio.CancelScope(deadline=deadline)
        self._timer = (task_group, scope)
        task_group.start_soon(self._wake, task_group, scope)

    async def _wake(self, task_group: anyio.abc.TaskGroup, scope: anyio.CancelScope) -> None:
        """The timer of ``_wake_later``: sleep until ``scope``'s deadline, then drain."""
        with scope:
            await anyio.sleep_forever()
        if self._timer is not None and self._timer[1] is scope:
            self._timer = None
        if self.task_group is task_group and self.deferred:
            self.drain_deferred(task_group)

    def _write_down_never_ran(self, target: SecondaryTier, nbytes: int, count: int) -> None:
        """Give back what ``drain_deferred`` took for a group whose task never ran."""
        for _ in range(count):
            self.admission.cancel(target.name, nbytes)
            self.in_flight_bytes -= nbytes
            self.deferred.lost += 1
            self.cascades.finished()

    async def _source_of(self, key: bytes, target: SecondaryTier) -> SecondaryTier | None:
        """The first tier above ``target`` that holds ``key``. The block's write-through
        still in flight, and a tier still finding out (its own write of the block in
        flight, an existence check), are waited for: asked at once, the tier would answer
        MISS or RETRY and the block would be lost for ``target``."""
        cascading = self._cascading
        while cascading is not None and key in cascading:
            # Its write-through was launched and has not reached the faster tiers yet (they
            # would not know they are writing it): wait until it has.
            ended = self._cascade_ends.get(key)
            if ended is None:
                ended = self._cascade_ends[key] = anyio.Event()
            await ended.wait()
        for tier in self._sources[target.name]:
            if await settled_lookup(tier, key) is LookupResult.HIT:
                return tier
        return None

    async def _write_down(self, keys: list[bytes], target: SecondaryTier, nbytes: int) -> None:
        """Copy a group of deferred blocks (one, for a tier that does not pack) from the
        faster tiers that hold them to ``target``: load them all, then start every store at
        once, so that a packing tier receives them together. A block that cannot be copied
        (no faster tier holds it any more, its load failed, cancelled at close) is lost,
        and the rest of its group is written all the same. ``store_timeout`` bounds the
        whole group."""
        downs = [_Down(key) for key in keys]
        load = functools.partial(self._load_down, target, nbytes)
        store = functools.partial(self._store_down, target, nbytes)
        try:
            with anyio.fail_after(self._store_timeout):
                await _each(downs, load)
                await _each([d for d in downs if not d.settled], store)
        except Exception as exc:  # the deadline: what has not ended has failed
            failure = reason_of(exc)
            self._failed(target, failure, exc)
            for down in downs:
                self._settle(down, target, nbytes, failure)
        finally:  # cancelled (at close): what has not ended is lost
            for down in downs:
                self._settle(down, target, nbytes, None)

    async def _load_down(self, target: SecondaryTier, nbytes: int, down: _Down) -> None:
        """Read ``down``'s block from the first faster tier that holds it; a block none
        holds, or whose load fails, is settled as lost here."""
        try:
            source = await self._source_of(down.key, target)
            if source is not None:
                buffer = memoryview(bytearray(nbytes))
                await source.load(down.key, buffer)
                down.buffer = buffer
        except Exception as exc:
            failure = reason_of(exc)
            self._failed(target, failure, exc)
            self._settle(down, target, nbytes, failure)
        else:
            if down.buffer is None:
                self._settle(down, target, nbytes, None)

    async def _store_down(self, target: SecondaryTier, nbytes: int, down: _Down) -> None:
        assert down.buffer is not None
        down.began = time.perf_counter()
        try:
            await target.store(down.key, down.buffer)
        except Exception as exc:
            failure = reason_of(exc)
            self._failed(target, failure, exc)
            self._settle(down, target, nbytes, failure)
        else:
            down.written = True
            self._settle(down, target, nbytes, None)

    def _failed(self, target: SecondaryTier, failure: MissReason, exc: BaseException) -> None:
        self._log.warning(
            "store:" + target.name,
            "deferred write to %s failed (%s): %r",
            target.name,
            failure.value,
            exc,
        )

    def _settle(
        self, down: _Down, target: SecondaryTier, nbytes: int, failure: MissReason | None
    ) -> None:
        """Account for one deferred write that ended (written, failed, lost or cancelled),
        once: give back its admission and bytes, count it, start what now fits."""
        if down.settled:
            return
        down.settled = True
        if down.began is None:
            self.admission.cancel(target.name, nbytes)
        else:
            self.admission.finished(target.name, nbytes, time.perf_counter() - down.began)
        self.in_flight_bytes -= nbytes
        if not down.written:
            self.deferred.lost += 1
        self._room_again()  # before this one stops counting: closing waits for the next
        self.cascades.finished()
        if failure is not None:
            bump(self.failures, failure)
        elif down.written:
            self.succeeded += 1
            self.deferred.written += 1
            self._callback("notify", target.notify, [down.key])

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
            # takes it in this same step, before a deferred write woken here can ask.
            self._cascade_reached(key)
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
