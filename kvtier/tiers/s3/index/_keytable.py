"""The packed store behind the existence index: keys and their pack locations, no object per key.

An index of millions of keys held as Python objects costs a ``bytes`` per key, a dict slot and
a ``Location`` per packed key: several hundred bytes each, and as many objects for the garbage
collector to walk. Here a key is a row in a *chunk*: its bytes in the chunk's ``bytearray``,
its pack (a small number naming an interned pack name), offset and length in ``array``
columns, and a flag saying whether the row still holds a live key. A chunk holds keys of one
length only (deployments use one or two lengths), up to ``CHUNK_ROWS`` rows, filled in
insertion order; chunks are numbered in the order they were opened, so the oldest live row of
the oldest chunk is the oldest key (what a full index evicts first; with keys of several
lengths, the order is exact within a length and by chunk across lengths).

Finding a key: open addressing with linear probing over ``array`` columns, split into shards
by the key's hash as the verdict store is (``kvtier.common._verdicts``), so a table that grows
rebuilds one shard of a few thousand slots, never the whole index, in one step on the event
loop. A slot is one word: the row's id (never 0: an empty slot is 0) and 32 bits of the
key's hash, so a probe compares the key's bytes only when those are equal. Python's ``hash``
of ``bytes`` is keyed per process, so keys chosen by whoever writes the bucket cannot be made
to collide.
Removal shifts the following slots back (no tombstones), so probe lengths stay those of the
live keys.

Rows of removed keys stay until their chunk is mostly dead: then the chunk is compacted in
place (its live rows keep their order, their slots are pointed at the new rows), or, with
fewer than ``_MIN_COMPACT`` left, those are indexed again as the newest keys and the chunk is
dropped (as one with no live row left is), so a chunk always holds enough keys to pay for
itself and memory follows the live keys within a factor of two (plus the oldest chunk,
which evictions empty from its front, and the one being filled). Each step is bounded by
one chunk or one shard, never the whole index.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterator
from typing import Final

from kvtier.tiers.s3._pack_format import Location

__all__ = ["CHUNK_ROWS", "KeyTable"]

CHUNK_BITS: Final = 12
CHUNK_ROWS: Final = 1 << CHUNK_BITS
_ROW_MASK: Final = CHUNK_ROWS - 1
# Keys one shard holds at most on average: growing one rebuilds about this many slots.
_SHARD_KEYS: Final = 4096
_FIRST_SLOTS: Final = 8
_MIN_COMPACT: Final = 64  # rows below which a chunk is never compacted (not worth it)
# A slot is one 64-bit word: 32 bits of its key's hash (those above the shard's bits: enough
# to place it in any shard's table and to rule out almost every other key without reading
# its bytes) over the row id's 32 bits.
_FP_MASK: Final = 0xFFFFFFFF
_MAX_CHUNKS: Final = 1 << (32 - CHUNK_BITS)
_U32: Final = 1 << 32


class _Chunk:
    """Up to ``CHUNK_ROWS`` rows of keys of ``width`` bytes, in insertion order."""

    __slots__ = ("alive", "front", "keys", "length", "live", "number", "offset", "pack", "width")

    def __init__(self, number: int, width: int) -> None:
        self.number = number
        self.width = width
        self.keys = bytearray()
        self.alive = bytearray()  # 1 while the row holds a live key
        self.pack = array.array("I")  # pack number plus one; 0: the key's own object
        # 32 bits each until a location needs more (packs past 4 GiB): then 64.
        self.offset = array.array("I")
        self.length = array.array("I")
        self.live = 0
        self.front = 0  # no live row before this one

    def key(self, row: int) -> bytes:
        w = self.width
        return bytes(self.keys[row * w : row * w + w])


class KeyTable:
    """Keys of 1..255 bytes, each with an optional pack location (see the module docstring)."""

    __slots__ = (
        "_chunks",
        "_filling",
        "_free_chunks",
        "_free_packs",
        "_last_pack",
        "_last_pack_name",
        "_next_chunk",
        "_pack_ids",
        "_pack_refs",
        "_packs",
        "_shard_mask",
        "_shift",
        "_slots",
        "_used",
        "count",
        "find",
    )

    def __init__(self, max_keys: int) -> None:
        shards = 1
        while shards * _SHARD_KEYS < max_keys and shards < 1 << 16:
            shards *= 2
        self._shard_mask = shards - 1
        self._shift = shards.bit_length() - 1
        self._slots = [array.array("Q", bytes(8 * _FIRST_SLOTS)) for _ in range(shards)]
        self._used = [0] * shards
        self._chunks: dict[int, _Chunk] = {}  # by number: the oldest first
        # The row id of a key, or -1: a closure over the tables (they are changed in place,
        # never replaced), whose cells read faster than attributes on the request path.
        self.find = _finder(self._slots, self._chunks, self._shard_mask, self._shift)
        self._filling: dict[int, _Chunk] = {}  # by key width: the chunk new keys go to
        # Chunk numbers from 1 (a row id is never 0, which marks an empty slot), those of
        # dropped chunks used again, so that a row id fits in 32 bits for good.
        self._next_chunk = 1
        self._free_chunks: list[int] = []
        self.count = 0  # keys held (read without a call on the hot path)
        self._packs: list[str | None] = []  # pack number -> name (None: free)
        self._pack_ids: dict[str, int] = {}
        self._pack_refs = array.array("I")
        self._free_packs: list[int] = []
        self._last_pack_name: str | None = None  # the pack named last, and its number
        self._last_pack = -1

    def __len__(self) -> int:
        return self.count

    # -- finding -----------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return self.find(key) >= 0

    def location(self, key: bytes) -> Location | None:
        """The pack section holding ``key``; None for its own object, or a key not held."""
        rid = self.find(key)
        return None if rid < 0 else self._location(rid)

    def _location(self, rid: int) -> Location | None:
        c = self._chunks[rid >> CHUNK_BITS]
        row = rid & _ROW_MASK
        pack = c.pack[row]
        if not pack:
            return None
        name = self._packs[pack - 1]
        assert name is not None
        return Location(name, c.offset[row], c.length[row])

    # -- changing ----------------------------------------------------------------------------

    def put(self, key: bytes, where: Location | None) -> int:
        """The row id of ``key`` if it is held (nothing changes); else -1, once it is held
        as the newest key (in the pack section ``where``, or as its own object). One probe
        finds it or the slot it goes to: bulk loads add keys one at a time."""
        h = hash(key)
        s = h & self._shard_mask
        slots = self._slots[s]
        if 8 * (self._used[s] + 1) > 5 * len(slots):  # past 5/8 full: twice the slots
            slots = self._slots[s] = _grown(slots)
        g = (h >> self._shift) & _FP_MASK
        chunks = self._chunks
        found = _probe(slots, chunks, g, key)
        if found >= 0:
            return found
        i = ~found  # the free slot the key goes to
        width = len(key)
        tail = self._filling.get(width)
        if tail is None or len(tail.alive) >= CHUNK_ROWS:
            tail = self._filling[width] = _Chunk(self._chunk_number(), width)
            chunks[tail.number] = tail
        c = tail
        row = len(c.alive)
        c.keys += key
        c.alive.append(1)
        if where is None:
            c.pack.append(0)
            c.offset.append(0)
            c.length.append(0)
        else:
            c.pack.append(self._pack_ref(where.pack) + 1)
            if (where.offset >= _U32 or where.length >= _U32) and c.offset.typecode == "I":
                c.offset, c.length = array.array("Q", c.offset), array.array("Q", c.length)
            c.offset.append(where.offset)
            c.length.append(where.length)
        c.live += 1
        self.count += 1
        rid = c.number << CHUNK_BITS | row
        slots[i] = g << 32 | rid
        self._used[s] += 1
        return -1

    def _chunk_number(self) -> int:
        if self._free_chunks:
            return self._free_chunks.pop()
        number = self._next_chunk
        if number >= _MAX_CHUNKS:
            raise OverflowError(f"more than {_MAX_CHUNKS * CHUNK_ROWS} keys in one index")
        self._next_chunk += 1
        return number

    def set_location(self, rid: int, where: Location | None) -> None:
        """Say where row ``rid``'s key lives now (a pack section, or None: its own object)."""
        c = self._chunks[rid >> CHUNK_BITS]
        row = rid & _ROW_MASK
        self._unplace(c, row)
        if where is not None:
            self._place(c, row, where)

    def remove(self, key: bytes) -> bool:
        """Stop holding ``key``; whether it was held."""
        rid = self.find(key)
        if rid < 0:
            return False
        self._unslot(hash(key), rid)
        self._kill(rid)
        return True

    def pop_oldest(self) -> bytes | None:
        """Remove the oldest key and return it; None when empty."""
        for c in self._chunks.values():
            if not c.live:
                continue
            row = c.alive.find(1, c.front)
            assert row >= 0
            c.front = row + 1
            key = c.key(row)
            self.remove(key)
            return key
        return None

    def _kill(self, rid: int) -> None:
        c = self._chunks[rid >> CHUNK_BITS]
        row = rid & _ROW_MASK
        self._unplace(c, row)
        c.alive[row] = 0
        c.live -= 1
        self.count -= 1
        # Rows before the front are dead (evicted, oldest first): a chunk emptied from its
        # front is not compacted, it is dropped once its last row goes.
        rows = len(c.alive) - c.front
        if not c.live and self._filling.get(c.width) is not c:
            del self._chunks[c.number]
            self._free_chunks.append(c.number)
        elif rows >= _MIN_COMPACT and 2 * c.live < rows:
            if c.live < _MIN_COMPACT and self._filling.get(c.width) is not c:
                self._move_to_back(c)  # too few left to keep a chunk for
            else:
                self._compact(c)

    def _move_to_back(self, c: _Chunk) -> None:
        """Index the few live keys of ``c`` again as the newest, and drop ``c``."""
        moved: list[tuple[bytes, Location | None]] = []
        base = c.number << CHUNK_BITS
        for row in range(c.front, len(c.alive)):
            if c.alive[row]:
                key = c.key(row)
                moved.append((key, self._location(base | row)))
                self._unslot(hash(key), base | row)
                self._unplace(c, row)
        self.count -= len(moved)
        del self._chunks[c.number]
        self._free_chunks.append(c.number)
        for key, where in moved:
            self.put(key, where)

    def _compact(self, c: _Chunk) -> None:
        """Move the live rows of ``c`` to its start, in order, and truncate it."""
        w, base, to = c.width, c.number << CHUNK_BITS, 0
        for row in range(c.front, len(c.alive)):
            if not c.alive[row]:
                continue
            if row != to:
                key = c.key(row)
                c.keys[to * w : to * w + w] = key
                c.alive[to] = 1
                c.pack[to], c.offset[to], c.length[to] = c.pack[row], c.offset[row], c.length[row]
                self._repoint(hash(key), base | row, base | to)
            to += 1
        del c.keys[to * w :], c.alive[to:], c.pack[to:], c.offset[to:], c.length[to:]
        c.front = 0

    # -- pack names --------------------------------------------------------------------------

    def _pack_ref(self, name: str) -> int:
        """The number of pack ``name`` (interned: its keys share one name), one more key
        referring to it. The keys of one pack arrive together: the last name is at hand."""
        if name is self._last_pack_name:
            pack = self._last_pack
        else:
            found = self._pack_ids.get(name)
            if found is None:
                if self._free_packs:
                    found = self._free_packs.pop()
                    self._packs[found] = name
                    self._pack_refs[found] = 0
                else:
                    found = len(self._packs)
                    self._packs.append(name)
                    self._pack_refs.append(0)
                self._pack_ids[name] = found
            pack, self._last_pack_name, self._last_pack = found, name, found
        self._pack_refs[pack] += 1
        return pack

    def _place(self, c: _Chunk, row: int, where: Location) -> None:
        pack = self._pack_ref(where.pack)
        if (where.offset >= _U32 or where.length >= _U32) and c.offset.typecode == "I":
            c.offset, c.length = array.array("Q", c.offset), array.array("Q", c.length)
        c.pack[row], c.offset[row], c.length[row] = pack + 1, where.offset, where.length

    def _unplace(self, c: _Chunk, row: int) -> None:
        pack = c.pack[row] - 1
        if pack < 0:
            return
        c.pack[row] = 0
        self._pack_refs[pack] -= 1
        if not self._pack_refs[pack]:
            name = self._packs[pack]
            assert name is not None
            del self._pack_ids[name]
            if pack == self._last_pack:
                self._last_pack_name = None
            self._packs[pack] = None
            self._free_packs.append(pack)

    # -- the hash table ----------------------------------------------------------------------

    def _slot_of(self, h: int, rid: int) -> tuple[array.array[int], int]:
        """The shard's slots and the slot holding row ``rid`` (whose key hashes to ``h``)."""
        slots = self._slots[h & self._shard_mask]
        mask = len(slots) - 1
        i = (h >> self._shift) & mask
        while (v := slots[i]) & _FP_MASK != rid:
            assert v, "a row not in the table"
            i = (i + 1) & mask
        return slots, i

    def _repoint(self, h: int, old: int, new: int) -> None:
        slots, i = self._slot_of(h, old)
        slots[i] = slots[i] >> 32 << 32 | new

    def _unslot(self, h: int, rid: int) -> None:
        """Take row ``rid`` out of the hash table, shifting the slots after it back."""
        slots, i = self._slot_of(h, rid)
        mask = len(slots) - 1
        j = i
        while True:  # backward-shift deletion for linear probing
            j = (j + 1) & mask
            v = slots[j]
            if not v:
                break
            home = (v >> 32) & mask
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                slots[i] = v
                i = j
        slots[i] = 0
        self._used[h & self._shard_mask] -= 1

    # -- reading it all ----------------------------------------------------------------------

    def keys(self) -> Iterator[bytes]:
        """Every key held, the oldest first."""
        for c in list(self._chunks.values()):
            for row in range(c.front, len(c.alive)):
                if c.alive[row]:
                    yield c.key(row)

    def entries_reader(self) -> Callable[[], list[tuple[bytes, Location | None]]]:
        """A function returning every key held with its location, to run in a worker thread:
        the columns are copied here, on the event loop, at memory speed (the table changes
        under the loop while the thread runs)."""
        chunks = [
            (c.width, bytes(c.keys), bytes(c.alive), c.pack[:], c.offset[:], c.length[:])
            for c in self._chunks.values()
        ]
        packs = list(self._packs)

        def entries() -> list[tuple[bytes, Location | None]]:
            out: list[tuple[bytes, Location | None]] = []
            for w, keys, alive, pack, off, n in chunks:
                for row, live in enumerate(alive):
                    if not live:
                        continue
                    key = keys[row * w : row * w + w]
                    name = packs[pack[row] - 1] if pack[row] else None
                    out.append((key, None if name is None else Location(name, off[row], n[row])))
            return out

        return entries


def _grown(slots: array.array[int]) -> array.array[int]:
    """``slots`` in a table twice as large."""
    size = 2 * len(slots)
    out = array.array("Q", bytes(8 * size))
    mask = size - 1
    for v in slots:
        if v:
            i = (v >> 32) & mask
            while out[i]:
                i = (i + 1) & mask
            out[i] = v
    return out


def _probe(slots: array.array[int], chunks: dict[int, _Chunk], g: int, key: bytes) -> int:
    """The row id of ``key`` (fingerprint ``g``) in the shard table ``slots``, or, when it is
    not there, ``~i`` for the free slot ``i`` where the probe ended (where it would go): the
    one probe loop that finding and inserting share."""
    mask = len(slots) - 1
    i = g & mask
    while v := slots[i]:
        if v >> 32 == g:
            rid = v & _FP_MASK
            c = chunks[rid >> CHUNK_BITS]
            w = c.width
            start = (rid & _ROW_MASK) * w
            if c.keys[start : start + w] == key:
                return rid
        i = (i + 1) & mask
    return ~i


def _finder(
    tables: list[array.array[int]], chunks: dict[int, _Chunk], shard_mask: int, shift: int
) -> Callable[[bytes], int]:
    def find(key: bytes) -> int:
        h = hash(key)
        rid = _probe(tables[h & shard_mask], chunks, (h >> shift) & _FP_MASK, key)
        return rid if rid >= 0 else -1

    return find
