"""The keys waiting for deferred tiers (docs/design.md, "Tiers, writes and cost"; the policy is
``kvtier.writes._admission``).

For a tier named in ``AdmissionPolicy``'s ``deferred``, a write that back-pressure drops is
not forgotten: its key waits here, and once the tier has room again the manager copies the
block to it from a faster tier that holds it (``_copydown``). Only keys are held, never
blocks, and the queue is bounded. It is synchronous: it says which keys go now, in groups for
a tier that packs the stores it is given together, and the manager starts the copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping

from kvtier.common._arguments import positive_int
from kvtier.writes._admission import AdmissionPolicy

__all__ = ["DeferredWrites"]


class DeferredWrites:
    """Keys whose write to a ``deferred`` tier back-pressure dropped, oldest first, per tier.

    At most ``limit`` keys wait per tier; past it the oldest is given up (counted in
    ``lost``). Only keys are held: the block is read again, when its turn comes, from a
    faster tier that holds it.
    """

    def __init__(self, tiers: Collection[str], limit: int) -> None:
        self.limit = positive_int(limit, "deferred_limit")
        self._queues: dict[str, dict[bytes, None]] = {tier: {} for tier in tiers}
        self.deferred = self.written = self.lost = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        """Whether any write waits (checked at every store: cheaper than ``len``)."""
        return any(self._queues.values())

    def wants(self, tier: str) -> bool:
        return tier in self._queues

    def add(self, tier: str, key: bytes) -> None:
        queue = self._queues[tier]
        if key in queue:
            return
        queue[key] = None
        self.deferred += 1
        if len(queue) > self.limit:
            del queue[next(iter(queue))]
            self.lost += 1

    def pending(self, tier: str) -> int:
        """How many keys wait for ``tier``."""
        queue = self._queues.get(tier)
        return 0 if queue is None else len(queue)

    def due(
        self, admission: AdmissionPolicy, nbytes: int, room: int, *, closing: bool = False
    ) -> list[tuple[str, bytes]]:
        """Take (tier, key) off the queues, oldest first, while the tier admits a write of
        ``nbytes`` (each taken one is admitted: give it back with ``finished`` or ``cancel``)
        and at most ``room`` in all. ``closing``: the manager is closing and gives what is
        left its ``close_timeout``, so only each tier's in-flight limit applies."""
        groups = self.due_groups(admission, nbytes, room, closing=closing)
        return [(tier, key) for tier, keys in groups for key in keys]

    def due_groups(
        self,
        admission: AdmissionPolicy,
        nbytes: int,
        room: int,
        *,
        sizes: Mapping[str, int] | None = None,
        closing: bool = False,
    ) -> list[tuple[str, list[bytes]]]:
        """Like ``due``, but each tier's keys come in groups of ``sizes[tier]`` (1 for a
        tier not named), oldest first, each group admitted whole or not at all: a tier that
        packs the stores it is given together gets whole packs, and a rate limit lets a
        group through once it has a group's worth instead of trickling one block each time
        it refills. A queue holding fewer keys than a group gives what it holds. A group
        larger than the tier's in-flight limit or than ``room`` could ever hold is never
        admitted: the caller keeps ``sizes`` within them."""
        out: list[tuple[str, list[bytes]]] = []
        for tier, queue in self._queues.items():
            size = 1 if sizes is None else sizes.get(tier, 1)
            while queue:
                count = min(size, len(queue))
                if count > room or not admission.has_room(
                    tier, nbytes, ignore_latency=closing, count=count
                ):
                    break
                if closing:
                    admission.force(tier, nbytes, count=count)
                elif not admission.admit(tier, nbytes, count=count):
                    break
                keys = list(itertools.islice(queue, count))
                for key in keys:
                    del queue[key]
                out.append((tier, keys))
                room -= count
        return out

    def clear(self) -> int:
        """Give up every waiting key (at close); returns how many."""
        n = len(self)
        for queue in self._queues.values():
            queue.clear()
        self.lost += n
        return n
