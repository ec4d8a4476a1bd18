"""Promotions that failed recently, remembered by the manager whatever the tier does.

A tier may keep answering HIT for a block it cannot serve (its checksum fails, or it keeps the
default ``record_miss``); promoting that block again at every wake of a waiting scan is a
livelock (issue 11: 7,542 promotions in one second). The manager asks this memory before it
promotes, and the failure's reason becomes the miss's reason until the entry expires.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvtier._lookup import MissReason

__all__ = ["RecentFailures"]


class RecentFailures:
    """(tier, key) -> reason, each for ``ttl`` seconds, at most ``max_entries`` at once.

    One TTL for all entries makes insertion order expiry order, so expired entries are
    dropped from the front in O(1) amortized and the oldest goes first when full.
    """

    def __init__(
        self,
        ttl: float,
        *,
        max_entries: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[tuple[Hashable, bytes], tuple[MissReason, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tier: Hashable, key: bytes) -> MissReason | None:
        """Why promoting ``key`` from ``tier`` failed, if that was less than ``ttl`` ago."""
        entry = self._entries.get((tier, key))
        if entry is None:
            return None
        reason, expires = entry
        if self._clock() < expires:
            return reason
        del self._entries[tier, key]
        return None

    def remember(self, tier: Hashable, key: bytes, reason: MissReason) -> None:
        entries = self._entries
        now = self._clock()
        entries.pop((tier, key), None)
        entries[tier, key] = (reason, now + self._ttl)
        while len(entries) > self._max or next(iter(entries.values()))[1] <= now:
            entries.popitem(last=False)
