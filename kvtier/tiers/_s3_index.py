"""The existence index of the S3 tier: ``lookup()`` without a round trip (design §5a).

A synchronous state machine, no I/O: which keys the bucket is known to hold, learnt from this
node's own writes, the listing made at open and the journal segments other nodes publish
(``_s3_journal``). A key it holds answers HIT; a key it does not hold answers MISS
(``not_found``) at once, so the request path never waits on the object store for a block that
cannot be there. A load that finds an indexed object gone or corrupt removes it; a load that
fails for another reason (timeout, unavailable) suppresses the key for ``miss_ttl`` seconds so
the manager does not promote it again at every wake.

The index also keeps the journal's bookkeeping: keys this node wrote that are not published
yet, and which segments of other writers it has read (forgotten once older than the lookback).

Memory: one Python ``bytes`` per key (about 70 bytes for a 32-byte key plus the set slot),
and for a key in a pack its ``Location`` (about 80 bytes more; the pack's name is shared by
its keys); ``max_keys`` bounds it, past which new keys are not indexed (they answer MISS,
as before a refresh) and a warning is logged by the tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvtier._lookup import LookupResult, MissReason
from kvtier.tiers._base import LookupStatistics
from kvtier.tiers._s3_pack import Location

__all__ = ["ExistenceIndex", "key_from_object"]


def key_from_object(name: str, prefix: str) -> bytes | None:
    """The key of a block object ``<prefix>/<2 hex>/<hex key>``; None for anything else."""
    rest = name[len(prefix) + 1 :] if prefix else name
    if prefix and not name.startswith(prefix + "/"):
        return None
    if len(rest) < 3 + 32 or rest[2] != "/":
        return None
    hexkey = rest[3:]
    if hexkey[:2] != rest[:2]:
        return None
    try:
        return bytes.fromhex(hexkey)
    except ValueError:
        return None


class ExistenceIndex:
    """Known keys, short suppressions and the journal's bookkeeping."""

    def __init__(
        self,
        *,
        miss_ttl: float,
        max_keys: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._miss_ttl = miss_ttl
        self._max_keys = max_keys
        self._clock = clock
        self._keys: set[bytes] = set()
        self._where: dict[bytes, Location] = {}  # keys held in a pack, not a block object
        self._suppressed: dict[bytes, tuple[float, MissReason]] = {}
        self._unpublished: dict[bytes, Location | None] = {}
        self._seen: dict[str, int] = {}  # segment name -> its wall ms
        self.full = False  # max_keys reached at least once
        self.listed = 0  # keys found by the listing at open
        self.learnt = 0  # keys learnt from other writers' journals
        self._hits = 0
        self._misses = 0
        self._reasons: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def location(self, key: bytes) -> Location | None:
        """The pack section holding ``key``; None for a key stored as its own object."""
        return self._where.get(key)

    # -- answers -------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if key in self._keys:
            if self._suppressed:
                held = self._suppressed.get(key)
                if held is not None:
                    if held[0] > self._clock():
                        return self.miss(held[1])
                    del self._suppressed[key]
            self._hits += 1
            return LookupResult.HIT
        return self.miss(MissReason.NOT_FOUND)

    def miss(self, reason: MissReason) -> LookupResult:
        self._misses += 1
        self._reasons[reason.value] = self._reasons.get(reason.value, 0) + 1
        return LookupResult.MISS

    # -- updates -------------------------------------------------------------------------------

    def add(self, key: bytes, where: Location | None = None) -> bool:
        """Index ``key`` (in the pack section ``where``, or as its own object); True if it
        was not known (and there was room). A key known in a pack keeps its location when
        its own object is found too: reading it with its pack's neighbours costs less."""
        if key in self._keys:
            self._suppressed.pop(key, None)
            if where is not None:
                self._where[key] = where
            return False
        if len(self._keys) >= self._max_keys:
            self.full = True
            return False
        self._keys.add(key)
        if where is not None:
            self._where[key] = where
        return True

    def add_many(self, entries: Iterable[tuple[bytes, Location | None]]) -> list[bytes]:
        return [key for key, where in entries if self.add(key, where)]

    def wrote(self, key: bytes, where: Location | None = None) -> None:
        """This node stored ``key``: index it and queue it for the next journal segment."""
        self.add(key, where)
        self._unpublished[key] = where

    def discard(self, key: bytes) -> None:
        """The object is gone (a GET found nothing, it was corrupt, or deleted)."""
        self._keys.discard(key)
        self._where.pop(key, None)
        self._suppressed.pop(key, None)

    def suppress(self, key: bytes, reason: MissReason) -> None:
        """A load failed for ``reason``: answer MISS for ``key`` for ``miss_ttl`` seconds."""
        if reason in (MissReason.NOT_FOUND, MissReason.CORRUPT):
            self.discard(key)
        elif key in self._keys:
            self._suppressed[key] = (self._clock() + self._miss_ttl, reason)

    # -- journal bookkeeping ---------------------------------------------------------------

    def take_unpublished(self) -> list[tuple[bytes, Location | None]]:
        entries = list(self._unpublished.items())
        self._unpublished.clear()
        return entries

    def requeue(self, entries: list[tuple[bytes, Location | None]]) -> None:
        """A segment could not be published: send its keys with the next one."""
        for key, where in entries:
            self._unpublished.setdefault(key, where)

    def unseen(self, names: Iterable[str]) -> list[str]:
        return [name for name in names if name not in self._seen]

    def seen(self, name: str, wall_ms: int) -> None:
        self._seen[name] = wall_ms

    def forget_seen_before(self, wall_ms: int) -> None:
        """Segments older than the lookback are never listed again: drop their names."""
        for name in [n for n, t in self._seen.items() if t < wall_ms]:
            del self._seen[name]

    def statistics(self) -> LookupStatistics:
        return LookupStatistics(
            hits=self._hits,
            misses=self._misses,
            misses_by_reason=dict(self._reasons),
            cached_verdicts=len(self._keys),
        )
