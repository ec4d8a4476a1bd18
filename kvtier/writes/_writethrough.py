"""Write-through: copying stored blocks from the pool to the secondary tiers (docs/design.md,
"Tiers, writes and cost").

The manager hands each newly stored block to ``WriteThrough``, which asks the admission
policy (``kvtier.writes._admission``) which tiers take it now, pins the slot and launches its write
to those tiers (a cascade, ``kvtier.writes._cascade``); blocks for write-back tiers wait pinned in
the ``WriteBackQueue`` (``kvtier.writes._writeback``) until they must leave the pool. Two more
sources of writes go through the same admission and accounting (``kvtier.writes._account``):
a block promoted from a slower tier is written up to the faster ones (``write_up``), and
writes that back-pressure dropped for a ``deferred`` tier are copied to it later from a
faster tier (``kvtier.writes._copydown``). Everything runs in the manager's task group, under
``store_timeout``; every write that ends starts the write-backs and deferred copies that now
fit. While a packing tier has deferred writes waiting, new writes for it join the queue
rather than going out one by one ahead of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import anyio.abc

from kvtier.common._background import Background
from kvtier.common._logging import BurstLogger
from kvtier.pools._base import PrimaryPool
from kvtier.tiers._base import SecondaryTier
from kvtier.writes._account import WriteAccount
from kvtier.writes._admission import AdmissionPolicy
from kvtier.writes._cascade import Cascades
from kvtier.writes._copydown import DeferredCopies
from kvtier.writes._counts import WriteCounts
from kvtier.writes._deferred import DeferredWrites
from kvtier.writes._writeback import WriteBackQueue

__all__ = ["WriteThrough"]


class WriteThrough(WriteAccount):
    """Writes stored blocks to the tiers, each tier as its admission allows.

    It is the account of every write it starts (``WriteAccount``: the counters, the
    ``cascades`` that closing waits for, the task group), and decides where each block goes.
    The manager opens it (``opened``), closes it in steps (``closing``, ``finish``,
    ``stopped``, ``closed``) and reads its statistics as one group (``counts``).
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
        super().__init__(
            pool,
            admission,
            max_in_flight_bytes=max_in_flight_bytes,
            store_timeout=store_timeout,
            background=background,
            callback=callback,
            log=log,
        )
        self.write_back = WriteBackQueue(write_back_limit)
        self.write_back_tiers = tuple(t for t in tiers if admission.is_write_back(t.name))
        self.through_tiers = tuple(t for t in tiers if not admission.is_write_back(t.name))
        self._above = {  # id(tier) -> the write-through tiers before it
            id(tier): tuple(t for t in tiers[:i] if t in self.through_tiers)
            for i, tier in enumerate(tiers)
        }
        deferred = [t for t in self.through_tiers[1:] if admission.is_deferred(t.name)]
        self._cascades = Cascades(self, track=bool(deferred))
        self._copies = DeferredCopies(tiers, deferred, self, wait_begun=self._cascades.wait_begun)
        self.deferred: DeferredWrites = self._copies.queue
        self.written_up = 0  # promoted blocks whose write to the tiers above was started

    # -- what the manager calls ---------------------------------------------------------------

    def closing(self) -> None:
        """The manager begins to close: write back every dirty block and start the deferred
        copies that fit, all with no regard to latency (``close_timeout`` bounds them)."""
        self.shutting_down = True
        task_group = self.task_group
        if task_group is not None:
            self.flush(task_group, everything=True)
            self.drain_deferred(task_group)

    def closed(self) -> None:
        """The manager's background work is cancelled: the deferred writes still queued are
        given up (counted as lost), and the next open starts afresh."""
        self.deferred.clear()
        self.shutting_down = False

    def counts(self) -> WriteCounts:
        """The ``writes`` group of the manager's statistics, from this writer's counters."""
        deferred = self.deferred
        return WriteCounts(
            started=self.started,
            succeeded=self.succeeded,
            failures_by_reason=dict(self.failures),
            skipped=self.skipped,
            cancelled=self.cancelled,
            dropped=self.admission.dropped(),
            in_flight_bytes=self.in_flight_bytes,
            written_back=self.write_back.written_back,
            dirty_blocks=len(self.write_back),
            deferred=deferred.deferred,
            deferred_written=deferred.written,
            deferred_lost=deferred.lost,
            deferred_pending=len(deferred),
        )

    def after_store(
        self, task_group: anyio.abc.TaskGroup, keys: Sequence[bytes], *, closing: bool
    ) -> None:
        """Write just-stored blocks through to the tiers that admit them now; hold them for
        the write-back tiers. A tier that refuses one block of the store is not asked about
        the rest: they are refused for the same cause (counted each, said once)."""
        refused: set[str] = set()
        groups: dict[tuple[SecondaryTier, ...], tuple[list[bytes], list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                if self._refused_by_all(refused):  # so are the rest: counted at once
                    for name in refused:
                        self.admission.refuse_again(name, len(keys) - i)
                    return
                if self.deferred:  # a rate limit refills with time: older deferred ones first
                    self.drain_deferred(task_group)
                if self.write_back_tiers and key not in self.write_back:
                    slot = self.pool.pin(key)  # not evictable until written back
                    if slot is not None:
                        self.write_back.add(key, slot)
                if self.through_tiers:
                    routed = self._route(task_group, key, self.through_tiers, refused=refused)
                    if routed is None:
                        continue
                    if routed:
                        targets, pinned = routed
                        assert isinstance(pinned, int)
                        group_keys, slots = groups.setdefault(targets, ([], []))
                        group_keys.append(key)
                        slots.append(pinned)
                if self.write_back:  # while closing (a store that raced aclose): at once
                    self.flush(task_group, everything=closing)
        finally:  # one cascade per group of blocks bound for the same tiers
            for targets, (group_keys, slots) in groups.items():
                self._cascades.launch(task_group, group_keys, targets, slots=slots)

    def _refused_by_all(self, refused: set[str]) -> bool:
        """Whether every tier of a store refused one of its blocks, and nothing more is to be
        done for its later blocks than counting them (no write-back to hold them for, no
        deferred writes to queue or drain, room under the global in-flight limit)."""
        return (
            len(refused) == len(self.through_tiers) > 0
            and not self.write_back_tiers
            and not self.deferred
            and self.in_flight_bytes + self.pool.block_bytes <= self.max_in_flight_bytes
            and not any(map(self.deferred.wants, refused))
        )

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
        if not targets:
            return
        routed = self._route(task_group, key, targets, copy)
        if not routed:
            return
        admitted, slot = routed
        if isinstance(slot, int):
            self._cascades.launch(task_group, [key], admitted, slots=[slot])
        else:
            self._cascades.launch(task_group, [key], admitted, copy=slot)
        self.written_up += 1

    def flush(self, task_group: anyio.abc.TaskGroup, *, everything: bool = False) -> None:
        """Start the write-backs the queue says are due (see ``WriteBackQueue.due``)."""
        by_name = {tier.name: tier for tier in self.write_back_tiers}
        writes, unpin = self.write_back.due(
            self.admission, list(by_name), self.pool.block_bytes, everything=everything
        )
        groups: dict[tuple[str, ...], tuple[list[bytes], list[int]]] = {}
        for key, slot, names in writes:
            group_keys, slots = groups.setdefault(tuple(names), ([], []))
            group_keys.append(key)
            slots.append(slot)
        for wanted, (keys, slots) in groups.items():
            self.take(len(keys))
            targets = [by_name[name] for name in wanted]
            self._cascades.launch(task_group, keys, targets, slots=slots)
        for slot in unpin:
            self.pool.unpin(slot)

    def drain_deferred(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the deferred copies that fit now (see ``DeferredCopies.drain``)."""
        self._copies.drain(task_group)

    # -- routing one block ----------------------------------------------------------------

    def _route(
        self,
        task_group: anyio.abc.TaskGroup,
        key: bytes,
        tiers: Sequence[SecondaryTier],
        copy: Callable[[], bytes | None] | None = None,
        *,
        refused: set[str] | None = None,
    ) -> tuple[tuple[SecondaryTier, ...], int | bytes] | Literal[False] | None:
        """Decide which of ``tiers`` take ``key``'s block now, pin its slot (or take the
        copy ``copy`` returns) and take its bytes in flight: the tiers admitted and the slot
        (or the copy), for the caller to launch; False if every tier dropped it, None if the
        global in-flight limit or an eviction skipped it (counted in ``skipped``).
        ``refused``: the tiers that refused an earlier block of the same store (added to)."""
        nbytes = self.pool.block_bytes
        if self.in_flight_bytes + nbytes > self.max_in_flight_bytes:
            self.skipped += 1
            return None
        targets: list[SecondaryTier] = []
        for tier in tiers:
            name = tier.name
            if self._copies.queues_first(name):
                self.deferred.add(name, key)  # written in a group, in turn
            elif refused is not None and name in refused:
                self.admission.refuse_again(name)
                self._refused(task_group, name, key, said=True)
            elif self.admission.admit(name, nbytes):
                targets.append(tier)
            else:  # counted as dropped by the policy; said once per burst
                if refused is not None:
                    refused.add(name)
                self._refused(task_group, name, key)
        if not targets:
            return False
        slot: int | bytes | None = self.pool.pin(key) if copy is None else copy()
        if slot is None:  # already evicted by a later store in the same burst
            for tier in targets:
                self.admission.cancel(tier.name, nbytes)
            self.skipped += 1
            return None
        self.take()
        return tuple(targets), slot

    def _refused(
        self, task_group: anyio.abc.TaskGroup, tier: str, key: bytes, *, said: bool = False
    ) -> None:
        """``tier``'s admission refused ``key``: defer it (a deferred tier) or drop it.
        ``said``: a refusal of the same store was logged already."""
        wanted = self.deferred.wants(tier)
        if wanted:
            self._copies.defer(task_group, tier, key)  # written later from a faster tier
        if said:
            return
        cause = self.admission.last_refusal(tier)
        if wanted:
            self.burst_log.warning(
                "admission:" + tier,
                "%s refuses writes for now (%s): they are deferred, to be copied "
                "from a faster tier when it has room",
                tier,
                cause,
            )
        else:
            self.burst_log.warning(
                "admission:" + tier,
                "%s refuses writes for now (%s): write-through to it is dropped until it has room",
                tier,
                cause,
            )

    def room_again(self) -> None:
        """A write ended: start the write-backs and deferred writes that now fit."""
        task_group = self.task_group
        if task_group is None:
            return
        if self.write_back:
            self.flush(task_group)
        if self.deferred:
            self.drain_deferred(task_group)

    def __repr__(self) -> str:
        return (
            f"<WriteThrough running={self.cascades.count} in_flight_bytes={self.in_flight_bytes}"
            f" dirty={len(self.write_back)}>"
        )
