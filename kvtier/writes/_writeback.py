"""The blocks waiting for write-back tiers (docs/design.md, "Tiers, writes and cost"; the policy is
``kvtier.writes._admission``).

A tier named in ``AdmissionPolicy``'s ``write_back`` is not written on store: the block stays
in the pool, pinned so that it cannot be evicted unwritten, until the manager must make room
or closes. This queue holds those blocks, oldest first, and says which to write back now. It
is synchronous: the manager starts the writes it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.common._arguments import positive_int
from kvtier.writes._admission import AdmissionPolicy

__all__ = ["WriteBackQueue"]


class WriteBackQueue:
    """The dirty blocks of write-back tiers: stored in the pool, pinned there (so they cannot
    be evicted unwritten), oldest first. The manager writes back the oldest once more than
    ``limit`` are dirty, and all of them at close."""

    def __init__(self, limit: int) -> None:
        self.limit = positive_int(limit, "write_back_limit")
        self._dirty: dict[bytes, int] = {}  # key -> pinned slot, in the order stored
        self.written_back = 0

    def __len__(self) -> int:
        return len(self._dirty)

    def __contains__(self, key: object) -> bool:
        return key in self._dirty

    def add(self, key: bytes, slot: int) -> None:
        self._dirty[key] = slot

    def due(
        self, admission: AdmissionPolicy, tiers: Sequence[str], nbytes: int, *, everything: bool
    ) -> tuple[list[tuple[bytes, int, list[str]]], list[int]]:
        """What to write back now: (key, pinned slot, tiers to write) for each block taken
        off the queue, and the slots of blocks every tier dropped (to unpin).

        Oldest first, while more than ``limit`` wait (all of them when ``everything``: at
        close, admission or not). A tier short of in-flight room stops the pass (the block
        stays dirty, tried again when a write ends); a tier the latency rule closed, or one
        that is not open, drops the block for that tier (counted by the policy), even at
        close."""
        writes: list[tuple[bytes, int, list[str]]] = []
        unpin: list[int] = []
        while self._dirty and (everything or len(self._dirty) > self.limit):
            key, slot = next(iter(self._dirty.items()))
            targets: list[str] = []
            for tier in tiers:
                if everything and admission.is_available(tier):
                    admission.force(tier, nbytes)
                    targets.append(tier)
                elif admission.admit(tier, nbytes):
                    targets.append(tier)
                elif not admission.is_closed(tier) and admission.is_available(tier):
                    # full for now: retry later (a tier not open drops it, as a closed one)
                    for admitted in targets:
                        admission.cancel(admitted, nbytes)
                    return writes, unpin
            del self._dirty[key]
            if targets:
                writes.append((key, slot, targets))
                self.written_back += 1
            else:
                unpin.append(slot)
        return writes, unpin
