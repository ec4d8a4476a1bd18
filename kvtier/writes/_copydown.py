"""Deferred writes, copied down to their tier from a faster one when it has room (docs/design.md,
"Tiers, writes and cost").

A write that back-pressure dropped for a ``deferred`` tier waits, as a key, in the
``DeferredWrites`` queue; ``DeferredCopies`` drains that queue as the tier's admission and
the global in-flight limit allow: each copy reads the block from the first faster tier that
holds it and stores it in the deferred tier, counted in the shared ``WriteAccount``.

A tier that packs the stores it is given together into one object (``write_batch`` > 1: one
request per pack, and one request for a node that later reads them) gets its deferred writes
in groups: each group is one task that loads every block of the group from the faster tiers,
then starts all its stores at once, so that they reach the tier in the same event-loop tick.

A copy waits for its source to have the block: first for the block's own write-through to
reach the tiers (launched, its task may not have run yet: ``Cascades.wait_begun``), then for
a tier that answers RETRY while it writes the block (``settled_lookup``). And the queue drains
on its own: when the admission leaves work waiting for time alone (a rate budget that refills,
a latency probe that comes due), one timer wakes the drain when the admission says there will
be room; waits that a write ending resolves need none, since every write ending drains again.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import anyio
import anyio.abc

from kvtier.common._lookup import LookupResult, MissReason
from kvtier.tiers._base import SecondaryTier, settled_lookup
from kvtier.writes._account import WriteAccount, bump, reason_of_failure
from kvtier.writes._deferred import DeferredWrites

__all__ = ["DEFERRED_LIMIT", "DeferredCopies"]

DEFERRED_LIMIT = 65536
"""Keys waiting per deferred tier; past it the oldest is given up (see ``DeferredWrites``)."""

WAKE_SLACK = 0.001
"""Seconds added to the time the admission says a deferred tier has room again, so that the
drain the timer starts is not refused by the rounding of a token bucket's refill."""


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


class DeferredCopies:
    """The deferred tiers among ``tiers`` (in the manager's order, fastest first), their
    queue (``queue``) and the copies that drain it.

    ``wait_begun(key)`` returns once the block's write-through in flight has reached the
    faster tiers. Each copy is counted in ``account`` and calls its ``room_again`` as it
    ends, before it stops counting.
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        deferred: Sequence[SecondaryTier],
        account: WriteAccount,
        *,
        wait_begun: Callable[[bytes], Awaitable[None]],
    ) -> None:
        self.account = account
        self.admission = account.admission
        self.queue = DeferredWrites([t.name for t in deferred], DEFERRED_LIMIT)
        self._names = tuple(t.name for t in deferred)
        self._sources = {tier.name: tuple(tiers[:i]) for i, tier in enumerate(tiers)}
        self._by_name = {tier.name: tier for tier in tiers}
        self._wait_begun = wait_begun
        # The one pending wake-up of the drain: the task group it runs in and the scope
        # whose deadline it sleeps until (moved earlier when a sooner one is asked).
        self._timer: tuple[anyio.abc.TaskGroup, anyio.CancelScope] | None = None
        self.batch = {  # packing deferred tier -> group size (the groups always fit)
            tier.name: size for tier in deferred if (size := self._group_size(tier)) > 1
        }

    def _group_size(self, tier: SecondaryTier) -> int:
        """The tier's ``write_batch``, cut to what the global and the tier's own in-flight
        limits can hold at once: a group is admitted whole, so a larger one never would."""
        nbytes = self.account.block_bytes
        size = min(int(tier.write_batch), self.account.max_in_flight_bytes // nbytes)
        capacity = self.admission.capacity(tier.name, nbytes)
        return max(1, size if capacity is None else min(size, capacity))

    def queues_first(self, tier: str) -> bool:
        """Whether a new write for ``tier`` joins its queue rather than going out alone: a
        packing tier's deferred writes wait for a group's worth of room, and a write taking
        that room one block first would hold them back."""
        return tier in self.batch and bool(self.queue.pending(tier))

    def defer(self, task_group: anyio.abc.TaskGroup, tier: str, key: bytes) -> None:
        """Queue ``key`` for ``tier`` (its admission refused the write), to be copied from a
        faster tier once the tier has room."""
        self.queue.add(tier, key)
        self.wake_later(task_group, (tier,))

    def drain(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the deferred writes that the tiers' admission and the in-flight limit
        take now; each copies its block from a faster tier that holds it. A packing tier's
        come in groups (see ``DeferredWrites.due_groups``), one task each. What is left for
        want of time alone gets a wake-up (``wake_later``); what waits for room in flight
        is drained again when a write ends."""
        account = self.account
        nbytes = account.block_bytes
        room = account.room()
        if room <= 0:
            return
        due = self.queue.due_groups(
            self.admission, nbytes, room, sizes=self.batch, closing=account.shutting_down
        )
        for name, keys in due:
            target = self._by_name[name]
            account.take(len(keys))
            undo = functools.partial(self._never_ran, target, nbytes, len(keys))
            self.account.background.start_soon(
                task_group, undo, self._write_down, keys, target, nbytes
            )
        if self.queue:
            self.wake_later(task_group, self._names)

    def wake_later(self, task_group: anyio.abc.TaskGroup, names: Sequence[str]) -> None:
        """Make sure the deferred writes of ``names`` are drained again once the admission
        says the passing of time alone gives one of them room (its rate budget refilled, its
        latency probe due): one timer in the manager's task group, its deadline moved
        earlier if a sooner wake-up is needed, cancelled with the group at close. Nothing
        to do while closing (the rate and latency no longer apply) or when only a write
        ending makes room (every write ending drains)."""
        if self.account.shutting_down:
            return
        nbytes = self.account.block_bytes
        soonest = math.inf
        for name in names:
            pending = self.queue.pending(name)
            if pending:
                count = min(pending, self.batch.get(name, 1))
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
        """The timer of ``wake_later``: sleep until ``scope``'s deadline, then drain."""
        with scope:
            await anyio.sleep_forever()
        if self._timer is not None and self._timer[1] is scope:
            self._timer = None
        if self.account.task_group is task_group and self.queue:
            self.drain(task_group)

    def _never_ran(self, target: SecondaryTier, nbytes: int, count: int) -> None:
        """Give back what ``drain`` took for a group whose task never ran."""
        for _ in range(count):
            self.admission.cancel(target.name, nbytes)
            self.account.in_flight_bytes -= nbytes
            self.queue.lost += 1
            self.account.cascades.finished()

    async def _source_of(self, key: bytes, target: SecondaryTier) -> SecondaryTier | None:
        """The first tier above ``target`` that holds ``key``. The block's write-through
        still in flight, and a tier still finding out (its own write of the block in
        flight, an existence check), are waited for: asked at once, the tier would answer
        MISS or RETRY and the block would be lost for ``target``."""
        await self._wait_begun(key)
        for tier in self._sources[target.name]:
            if not self.admission.is_available(tier.name):  # not open: never asked
                continue
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
            with anyio.fail_after(self.account.store_timeout):
                await _each(downs, load)
                await _each([d for d in downs if not d.settled], store)
        except Exception as exc:  # the deadline: what has not ended has failed
            failure = reason_of_failure(exc)
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
            failure = reason_of_failure(exc)
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
            failure = reason_of_failure(exc)
            self._failed(target, failure, exc)
            self._settle(down, target, nbytes, failure)
        else:
            down.written = True
            self._settle(down, target, nbytes, None)

    def _failed(self, target: SecondaryTier, failure: MissReason, exc: BaseException) -> None:
        self.account.burst_log.warning(
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
        account = self.account
        account.in_flight_bytes -= nbytes
        if failure is not None:
            bump(account.failures, failure)
        if down.written:
            account.succeeded += 1
            self.queue.written += 1
        else:
            self.queue.lost += 1
        try:  # counted first: what room_again starts can never leave this write uncounted
            account.room_again()  # before this one stops counting: closing waits for the next
        finally:
            account.cascades.finished()
        if down.written:
            self.account.callback("notify", target.notify, [down.key])
