"""Promotions that failed recently, remembered by the manager whatever the tier does.

A tier may keep answering HIT for a block it cannot serve (its checksum fails, or it keeps the
default ``record_miss``); promoting that block again at every wake of a waiting scan is a
livelock (thousands of failed promotions a second). The manager asks this memory before it
promotes, and the failure's reason becomes the miss's reason until the entry expires.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from kvtier.common._lookup import MissReason
from kvtier.common._verdicts import VerdictStore, code_of, reason_of_code

__all__ = ["RecentFailures"]


class RecentFailures:
    """(tier, key) -> reason, each for ``ttl`` seconds, at most ``max_entries`` at once.

    One ``VerdictStore`` for all tiers, so the bound and the oldest-first order span them: an
    entry's key is the tier's tag (four bytes, given at its first failure) and the block key.
    One TTL for all entries makes the order of setting the order of expiry, so each
    ``remember`` drops every expired entry from the front (amortized O(1)).
    """

    def __init__(
        self,
        ttl: float,
        *,
        max_entries: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl
        self._store = VerdictStore(max_entries, clock=clock)
        self._tags: dict[Hashable, bytes] = {}

    def __len__(self) -> int:
        return len(self._store)

    def __bool__(self) -> bool:
        return bool(self._store)

    def get(self, tier: Hashable, key: bytes) -> MissReason | None:
        """Why promoting ``key`` from ``tier`` failed, if that was less than ``ttl`` ago."""
        tag = self._tags.get(tier)
        if tag is None:
            return None
        code = self._store.get(tag + key)
        return None if code is None else reason_of_code(code)

    def remember(self, tier: Hashable, key: bytes, reason: MissReason) -> None:
        tag = self._tags.get(tier)
        if tag is None:
            tag = self._tags[tier] = len(self._tags).to_bytes(4, "big")
        self._store.set(tag + key, code_of(reason), self._ttl)
        self._store.expire()
