"""Verdicts that expire: the one bounded map behind every "answer we remember for a while".

The async lookup helper caches existence answers, both indexes remember failed loads, the
manager remembers failed promotions and the engine bridge keeps a snapshot of answers; all of
them are this map. It is a synchronous structure with an injected clock, so it is tested
without an event loop.

An entry is one plain ``int``: (expiry in whole microseconds of the clock) << ``CODE_BITS`` |
code. Code ``PRESENT`` (0) means the key is there; any other code means it is absent, and
says why: ``code_of(reason)`` numbers ``MissReason`` from 1 in declaration order and
``reason_of_code`` reads it back; a user with reasons of its own numbers them after those, up to
``MAX_CODE``. An ``int`` is never tracked by the garbage collector, so a full map adds no work
to its passes; a tuple or an object per key did, and full passes over a hundred thousand of
them stalled the event loop for tens of milliseconds.

The map keeps the order in which entries were set: setting a key again moves it to the end,
and past ``max_entries`` the oldest entry goes. A large map is split into shards by the key's
hash, each holding its share of ``max_entries`` in its own order (the oldest of the key's
shard goes): a hash table grows by rebuilding itself in one step, and one table of a hundred
thousand entries took milliseconds to rebuild, a stall of the event loop at some insert; a
shard's rebuild stays small.

A shard is a plain ``dict``, never an ``OrderedDict``: a plain dict whose keys and values are
all untracked (bytes, int) is itself untracked, so the collector never walks it, while an
``OrderedDict`` is always tracked and every full pass visited each of its entries (for two
tiers' caches, most of the time such a pass took). A plain dict keeps insertion order too,
but finding its oldest entry walks past every slot deleted at its front since the table was
last rebuilt, so each shard also keeps ``front``: its oldest few keys in order (a prefix of
the shard's order, refilled in one walk when used up), from which evictions take.
Expiry is lazy: ``get`` drops an expired entry
it meets, and ``expire`` drops expired entries from the front (all of them when every entry has
the same TTL, since then the order of setting is the order of expiry). An expiry is kept
rounded down to the microsecond: an entry may end up to a microsecond early, never late, and a
clock read at exactly the expiry sees it gone. Every operation is O(1) (``expire``: amortized).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import islice
from typing import Final

from kvtier.common._lookup import MissReason

__all__ = ["CODE_BITS", "MAX_CODE", "PRESENT", "VerdictStore", "code_of", "reason_of_code"]

CODE_BITS: Final = 8
MAX_CODE: Final = (1 << CODE_BITS) - 1
PRESENT: Final = 0

_MASK: Final = MAX_CODE
# Entries a shard holds at most: what one insert may have to rebuild.
_SHARD_ENTRIES: Final = 8192
# Oldest keys of a shard taken at once into its ``front``: one walk over the shard's deleted
# front slots per this many evictions.
_FRONT: Final = 32
_FOREVER_US: Final = 1 << 62  # a TTL of math.inf: far beyond any clock's microseconds
_REASONS: Final[tuple[MissReason, ...]] = tuple(MissReason)
_CODE_OF: Final[dict[str, int]] = {reason: i + 1 for i, reason in enumerate(_REASONS)}
assert len(_REASONS) < MAX_CODE


def code_of(reason: MissReason | str) -> int:
    """The code of an absent verdict for ``reason`` (a ``MissReason`` or its value)."""
    code = _CODE_OF.get(reason)
    if code is None:
        raise ValueError(f"not a miss reason: {reason!r}; use one of {[r.value for r in _REASONS]}")
    return code


def reason_of_code(code: int) -> MissReason:
    """The ``MissReason`` of an absent verdict's ``code`` (one made by ``code_of``)."""
    return _REASONS[code - 1]


class VerdictStore:
    """Key -> (code, expiry): bounded, oldest first out, expired lazily (see the module doc)."""

    __slots__ = ("_clock", "_fronts", "_mask", "_per_shard", "_shards", "max_entries")

    def __init__(self, max_entries: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self._clock = clock
        shards = 1
        while shards * _SHARD_ENTRIES < max_entries:
            shards *= 2
        self._shards: list[dict[bytes, int]] = [{} for _ in range(shards)]
        # Per shard: its oldest keys, in order (a prefix of the shard's order; see the doc).
        self._fronts: list[dict[bytes, None]] = [{} for _ in range(shards)]
        self._mask = shards - 1
        self._per_shard = max(max_entries // shards, 1)

    def __len__(self) -> int:
        """Entries held, expired ones not dropped yet included."""
        return sum(map(len, self._shards))

    def __bool__(self) -> bool:
        """Whether any entry is held (cheaper than ``len``: the first shard that has one)."""
        return any(self._shards)

    def get(self, key: bytes) -> int | None:
        """The code of ``key``'s verdict, or None if there is none or it has expired."""
        index = hash(key) & self._mask
        entries = self._shards[index]
        entry = entries.get(key)
        if entry is None:
            return None
        if entry >> CODE_BITS > self._clock() * 1e6:
            return entry & _MASK
        del entries[key]
        self._fronts[index].pop(key, None)
        return None

    def set(self, key: bytes, code: int, ttl: float) -> None:
        """Hold ``code`` for ``key`` for ``ttl`` seconds (``math.inf``: until pushed out or
        forgotten), as the newest entry; the oldest of its shard goes past the shard's share
        of ``max_entries``."""
        if not 0 <= code <= MAX_CODE:
            raise ValueError(f"a verdict code is 0..{MAX_CODE}, got {code!r}")
        expires = self._clock() + ttl
        micros = _FOREVER_US if expires == math.inf else math.floor(expires * 1e6)
        index = hash(key) & self._mask
        entries = self._shards[index]
        if entries.pop(key, None) is not None:  # set again: it moves to the end
            self._fronts[index].pop(key, None)
        entries[key] = micros << CODE_BITS | code
        if len(entries) > self._per_shard:
            self._evict(index, len(entries) - self._per_shard)

    def _evict(self, index: int, count: int) -> None:
        """Drop the ``count`` oldest entries of shard ``index``."""
        entries, front = self._shards[index], self._fronts[index]
        for _ in range(count):
            if not front:
                front = self._fronts[index] = dict.fromkeys(islice(entries, _FRONT))
            oldest = next(iter(front))
            del front[oldest]
            del entries[oldest]

    def forget(self, key: bytes) -> bool:
        """Drop ``key``'s verdict; True if it had one (expired or not)."""
        index = hash(key) & self._mask
        self._fronts[index].pop(key, None)
        return self._shards[index].pop(key, None) is not None

    def expire(self) -> int:
        """Drop expired entries from the front of each shard (the oldest set) up to its first
        live one; how many went."""
        now = self._clock() * 1e6
        dropped = 0
        for entries, front in zip(self._shards, self._fronts, strict=True):
            stale: list[bytes] = []
            for key, entry in entries.items():
                if entry >> CODE_BITS > now:
                    break
                stale.append(key)
            for key in stale:
                del entries[key]
                front.pop(key, None)
            dropped += len(stale)
        return dropped

    def clear(self) -> None:
        for entries, front in zip(self._shards, self._fronts, strict=True):
            entries.clear()
            front.clear()

    def __repr__(self) -> str:
        shards = f" in {len(self._shards)} shards" if len(self._shards) > 1 else ""
        return f"<VerdictStore {len(self)}/{self.max_entries}{shards}>"
