"""The FS catalog's index packed into arrays: block files by key, with their sizes, in LRU order.

An ``OrderedDict[str, int]`` of millions of block files costs a ``str`` per name, a linked node
per entry and an ``int`` per size: a few hundred bytes each, and as many objects for the
garbage collector to walk. ``PackedOrder`` answers the ``OrderedDict`` calls the catalog makes
with the same results and no Python object per entry.

Entries are keyed by *idents* (``_idents``): a block's key itself when its file is named by
the key's hex, so ``lookup`` asks with the caller's ``bytes`` (whose hash Python caches) and
never builds a name. Rows are columns: the ident's bytes in a *lane* of fixed-width rows (one
lane per key length), and beside them the lane, the row within it, the size, and the previous
and next rows of a doubly linked LRU list, so every move, pop of the oldest and put-back at
the front is a few array writes, as in ``OrderedDict``, never a search.

Finding an ident: linear probing in one of ``SHARDS`` tables of two columns: 29 bits of the
ident's ``hash`` with a mark (compared before anything else is read: a miss reads no row and
no key) and the row. The 29 bits are cut from the 64-bit hash in one step, the only one on a
many-digit ``int`` (Python's slow path); the table is chosen by their top bits and the home
slot by their low bits, and every value stays below 2**30, which Python's ints hold in one
digit: the probe's arithmetic is the cheapest there is. A table is rebuilt
(vectorised, from its columns alone) when two thirds of it are taken, tombstones counted; as
each holds one ``SHARDS``-th of the entries, no call pays for more than a small share of the
index. ``hash`` of ``bytes`` is keyed per process: idents chosen by whoever writes the folder
cannot be made to collide. Removed rows are reused, never moved.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Final, TypeVar, overload

import numpy as np
import numpy.typing as npt

from kvtier.tiers.fs._idents import HASHED_LANE, MAX_HEX_KEY, MAX_LANE, PAD, lane_of
from kvtier.tiers.fs._packed_table import MIN_TABLE, as_array, layout

__all__ = ["SHARDS", "PackedOrder"]

T = TypeVar("T")

_SHARD_BITS: Final = 8
SHARDS: Final = 1 << _SHARD_BITS
_SHARD_SHIFT: Final = 29 - _SHARD_BITS  # a table: the top bits of the hash bits kept
_M32: Final = (1 << 32) - 1
_FP: Final = (1 << 29) - 1  # the hash bits a slot keeps (with _LIVE: a one-digit int, fast)
_LIVE: Final = 1 << 29  # a slot's mark beside its bits of the hash; 0 empty, _TOMB removed
_TOMB: Final = 1
_NIL: Final = -1
_MAX_ROWS: Final = (1 << 31) - 2
_MISSING: Final = object()


def _width(lane: int) -> int:
    return 32 if lane == HASHED_LANE else lane


class PackedOrder:
    """Ident -> size, least recently used first, with no Python object per entry.

    Answers the ``OrderedDict`` calls the FS catalog makes, with the same results; ``total``
    sums the sizes in constant time. Idents must be ones ``_idents`` gives (storing another
    raises ``ValueError``; any object may be looked up); sizes fit in 64 unsigned bits.
    Iterating while the order changes raises ``RuntimeError``, as ``OrderedDict`` does.
    """

    def __init__(self, entries: Iterable[tuple[bytes, int]] = ()) -> None:
        """``entries``: (ident, size) pairs, oldest first; a repeated ident keeps its first
        place and its last size, as ``OrderedDict`` does."""
        self._tables: list[array[int]] = [array("i", bytes(4 * MIN_TABLE)) for _ in range(SHARDS)]
        self._fps: list[array[int]] = [array("I", bytes(4 * MIN_TABLE)) for _ in range(SHARDS)]
        self._taken = [0] * SHARDS  # slots live or tombstones, per table
        self._keys: list[bytearray] = [bytearray() for _ in range(MAX_LANE + 1)]
        self._lane_free: list[array[int]] = [array("I") for _ in range(MAX_LANE + 1)]
        self._lane = bytearray()  # per row: its lane, 0 when the row is free
        self._pos = array("I")  # per row: its row in the lane
        self._sizes = array("Q")
        self._prev = array("i")
        self._next = array("i")
        self._free = array("I")  # free rows, reused first
        self._head = self._tail = _NIL
        self._count = self._total = 0
        self._version = 0
        for ident, size in entries:
            self[ident] = size

    # -- reading -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    @property
    def total(self) -> int:
        """The sum of the sizes."""
        return self._total

    def find(self, ident: object) -> int:
        """The row holding ``ident``, or -1.

        Every call the catalog makes goes through here,
        so the usual ident (a key named by its hex) takes the fewest steps: literals, locals,
        one table probe, and the key compared in place."""
        if type(ident) is not bytes:
            return -1
        lane = len(ident)
        if not 0 < lane <= 100:  # MAX_HEX_KEY
            return self._find_hashed(ident) if lane == HASHED_LANE else -1
        fp = hash(ident) & 0x1FFFFFFF  # _FP: the one step on the 64-bit hash (slow)
        shard = fp >> 21  # _SHARD_SHIFT
        fps = self._fps[shard]
        mask = len(fps) - 1
        want = fp | 0x20000000  # _LIVE
        i = fp & mask
        while f := fps[i]:
            if f == want:
                row = self._tables[shard][i] - 1
                if self._lane[row] == lane and self._keys[lane].startswith(
                    ident, self._pos[row] * lane
                ):
                    return row
            i = (i + 1) & mask
        return -1

    def _find_hashed(self, ident: bytes) -> int:
        """``find`` for a hashed name's ident (``PAD`` and its hash; a long key's file)."""
        if ident[: len(PAD)] != PAD:
            return -1
        fp = hash(ident) & _FP
        fps = self._fps[fp >> _SHARD_SHIFT]
        mask = len(fps) - 1
        want = fp | _LIVE
        digest = ident[len(PAD) :]
        i = fp & mask
        while f := fps[i]:
            if f == want:
                row = self._tables[fp >> _SHARD_SHIFT][i] - 1
                if self._lane[row] == HASHED_LANE and self._keys[HASHED_LANE].startswith(
                    digest, self._pos[row] * 32
                ):
                    return row
            i = (i + 1) & mask
        return -1

    def __contains__(self, ident: object) -> bool:
        return self.find(ident) >= 0

    def touch(self, ident: bytes) -> int | None:
        """Make ``ident`` the most recently used entry; its size (None: not held)."""
        row = self.find(ident)
        if row < 0:
            return None
        self._version += 1
        tail = self._tail
        if tail != row:  # unlinked, then linked at the back: ``_unlink``, ``_link_back``
            prev, nxt = self._prev, self._next
            before, after = prev[row], nxt[row]
            if before == _NIL:
                self._head = after
            else:
                nxt[before] = after
            prev[after] = before  # ``row`` is not the tail: ``after`` is a row
            prev[row], nxt[row] = tail, _NIL
            nxt[tail] = row
            self._tail = row
        return self._sizes[row]

    def get(self, ident: bytes, default: int | None = None) -> int | None:
        row = self.find(ident)
        return default if row < 0 else self._sizes[row]

    def __getitem__(self, ident: bytes) -> int:
        row = self.find(ident)
        if row < 0:
            raise KeyError(ident)
        return self._sizes[row]

    def ident(self, row: int) -> bytes:
        lane = self._lane[row]
        w = _width(lane)
        start = self._pos[row] * w
        key = bytes(self._keys[lane][start : start + w])
        return PAD + key if lane == HASHED_LANE else key

    def __iter__(self) -> Iterator[bytes]:
        """Idents, least recently used first."""
        return map(self.ident, self._rows())

    def keys_reader(self) -> Callable[[], list[bytes]]:
        """A function returning every ident that is a key (a name of hex digits; hashed names
        are left out: their keys are not known), in no particular order, to run in a worker
        thread: the columns it reads are copied here, at memory speed, so the index may change
        on the loop while the thread turns them into ``bytes``."""
        lane = np.frombuffer(bytes(self._lane), dtype=np.uint8)
        pos = np.frombuffer(self._pos, dtype=f"u{self._pos.itemsize}").copy()
        used = np.flatnonzero(np.bincount(lane, minlength=MAX_LANE + 1)[1 : MAX_HEX_KEY + 1]) + 1
        lanes = {n: bytes(self._keys[n]) for n in used.tolist()}

        def read() -> list[bytes]:
            keys: list[bytes] = []
            for n, column in lanes.items():
                rows = pos[lane[: len(pos)] == n].astype(np.int64) * n
                view = memoryview(column)
                keys.extend(bytes(view[start : start + n]) for start in rows.tolist())
            return keys

        return read

    def items(self) -> Iterator[tuple[bytes, int]]:
        """(ident, size) pairs, least recently used first."""
        sizes = self._sizes
        return ((self.ident(row), sizes[row]) for row in self._rows())

    # -- changing ------------------------------------------------------------------------------

    def __setitem__(self, ident: bytes, size: int) -> None:
        """A new ident goes to the most recently used end; a known one keeps its place."""
        row = self.find(ident)
        if row >= 0:
            old = self._sizes[row]
            self._sizes[row] = size
            self._total += size - old
            return
        self._insert(ident, size)

    def put_last(self, ident: bytes, size: int) -> int | None:
        """``ident`` becomes the most recently used entry, of ``size``, as a ``pop`` and a
        store would leave it (one search, not two); the size it had (None: not held)."""
        row = self.find(ident)
        if row < 0:
            self._insert(ident, size)
            return None
        old = self._sizes[row]
        self._sizes[row] = size
        self._total += size - old
        self._version += 1
        if self._tail != row:
            self._to_back(row)
        return old

    def _insert(self, ident: bytes, size: int) -> None:
        """Store ``ident``, which is not held, at the most recently used end."""
        lane = len(ident)
        if not 0 < lane <= MAX_HEX_KEY and lane_of(ident) is None:
            raise ValueError(f"not a block key or hashed name: {ident!r}")
        key = ident if lane <= MAX_HEX_KEY else ident[len(PAD) :]
        row = self._new_row(lane, key, size)
        tail = self._tail  # ``_link_back``
        self._prev[row], self._next[row] = tail, _NIL
        if tail == _NIL:
            self._head = row
        else:
            self._next[tail] = row
        self._tail = row
        self._count += 1
        self._total += size
        self._version += 1
        self._place(hash(ident), row)

    def has_key(self, key: bytes) -> bool:
        """``key in self`` for a key named by its hex (1 to ``MAX_HEX_KEY`` bytes): the
        lookup's hot path, so ``find`` spelled out for that lane alone."""
        fp = hash(key) & 0x1FFFFFFF
        shard = fp >> 21
        fps = self._fps[shard]
        mask = len(fps) - 1
        want = fp | 0x20000000
        i = fp & mask
        while f := fps[i]:
            if f == want:
                row = self._tables[shard][i] - 1
                lane = len(key)
                if self._lane[row] == lane and self._keys[lane].startswith(
                    key, self._pos[row] * lane
                ):
                    return True
            i = (i + 1) & mask
        return False

    def _new_row(self, lane: int, key: bytes, size: int) -> int:
        keys, lane_free = self._keys[lane], self._lane_free[lane]
        if self._free:
            row = self._free[-1]
            self._sizes[row] = size  # first: a size that does not fit changes nothing
            self._free.pop()
        else:
            row = len(self._sizes)
            if row > _MAX_ROWS:
                raise ValueError("more entries than a packed index holds")
            self._sizes.append(size)
            self._lane.append(0)
            self._pos.append(0)
            self._prev.append(_NIL)
            self._next.append(_NIL)
        w = len(key)
        if lane_free:
            pos = lane_free.pop()
            keys[pos * w : pos * w + w] = key
        else:
            pos = len(keys) // w
            keys += key
        self._lane[row] = lane
        self._pos[row] = pos
        return row

    def _to_back(self, row: int) -> None:
        """Move ``row``, held and not the tail, to the back: ``_unlink`` and ``_link_back``
        in one step."""
        prev, nxt, tail = self._prev, self._next, self._tail
        before, after = prev[row], nxt[row]
        if before == _NIL:
            self._head = after
        else:
            nxt[before] = after
        prev[after] = before
        prev[row], nxt[row] = tail, _NIL
        nxt[tail] = row
        self._tail = row

    def _link_back(self, row: int) -> None:
        tail = self._tail
        self._prev[row], self._next[row] = tail, _NIL
        if tail == _NIL:
            self._head = row
        else:
            self._next[tail] = row
        self._tail = row

    def _link_front(self, row: int) -> None:
        head = self._head
        self._prev[row], self._next[row] = _NIL, head
        if head == _NIL:
            self._tail = row
        else:
            self._prev[head] = row
        self._head = row

    def _unlink(self, row: int) -> None:
        prev, nxt = self._prev[row], self._next[row]
        if prev == _NIL:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == _NIL:
            self._tail = prev
        else:
            self._prev[nxt] = prev

    def _place(self, h: int, row: int) -> None:
        """Put ``row`` (hash ``h``) in its table, growing or cleaning the table first."""
        fp = h & _FP
        shard = fp >> _SHARD_SHIFT
        table = self._tables[shard]
        if 3 * (self._taken[shard] + 1) > 2 * len(table):
            table = self._rebuild(shard, 1)
        fps = self._fps[shard]
        mask = len(table) - 1
        i = fp & mask
        while (f := fps[i]) > _TOMB:
            i = (i + 1) & mask
        if not f:
            self._taken[shard] += 1
        table[i] = row + 1
        fps[i] = fp | _LIVE

    @overload
    def pop(self, ident: bytes) -> int: ...
    @overload
    def pop(self, ident: bytes, default: T) -> int | T: ...
    def pop(self, ident: bytes, default: object = _MISSING) -> object:
        row = self.find(ident)
        if row < 0:
            if default is _MISSING:
                raise KeyError(ident)
            return default
        return self._remove(ident, row)

    def popitem(self, last: bool = True) -> tuple[bytes, int]:
        """Remove and return the most recently used entry, or the least with ``last=False``."""
        if not self._count:
            raise KeyError("popitem(): PackedOrder is empty")
        row = self._tail if last else self._head
        ident = self.ident(row)
        return ident, self._remove(ident, row)

    def move_to_end(self, ident: bytes, last: bool = True) -> None:
        """Make ``ident`` the most recently used entry, or the least with ``last=False``."""
        row = self.find(ident)
        if row < 0:
            raise KeyError(ident)
        self._version += 1
        if (self._tail if last else self._head) == row:
            return
        self._unlink(row)
        if last:
            self._link_back(row)
        else:
            self._link_front(row)

    def _remove(self, ident: bytes, row: int) -> int:
        """Take ``ident``'s entry, in ``row``, out; its size."""
        fp = hash(ident) & _FP
        table = self._tables[fp >> _SHARD_SHIFT]
        mask = len(table) - 1
        i = fp & mask
        want = row + 1
        while table[i] != want:
            i = (i + 1) & mask
        table[i] = 0
        self._fps[fp >> _SHARD_SHIFT][i] = _TOMB
        self._unlink(row)
        lane = self._lane[row]
        self._lane_free[lane].append(self._pos[row])
        self._lane[row] = 0
        size = self._sizes[row]
        self._sizes[row] = 0
        self._free.append(row)
        self._count -= 1
        self._total -= size
        self._version += 1
        return size

    # -- tables --------------------------------------------------------------------------------

    def _rebuild(self, shard: int, more: int) -> array[int]:
        """Lay table ``shard``'s live slots out afresh, with room for ``more``."""
        held = np.frombuffer(self._fps[shard], dtype=np.uint32)
        live = held > _TOMB
        fps = held[live]
        rows = np.frombuffer(self._tables[shard], dtype=np.int32)[live]
        table, self._fps[shard] = layout(rows, fps, len(fps) + more)
        self._tables[shard] = table
        self._taken[shard] = len(fps)
        return table

    # -- bulk ----------------------------------------------------------------------------------

    @classmethod
    def packed(
        cls,
        keys: dict[int, bytes],
        lanes: npt.NDArray[np.uint8],
        positions: npt.NDArray[np.uint32],
        sizes: npt.NDArray[np.uint64],
        hashes: npt.NDArray[np.uint64],
    ) -> PackedOrder:
        """An index of rows given as columns, oldest first (``_packed_build``: no Python
        object per row): each lane's keys, and per row its lane, its row there, its size and
        its ident's ``hash``. The idents must be distinct."""
        order = cls()
        n = len(sizes)
        if n > _MAX_ROWS:
            raise ValueError("more entries than a packed index holds")
        for lane, blob in keys.items():
            order._keys[lane] = bytearray(blob)
        order._lane = bytearray(lanes.tobytes())
        order._pos = as_array("I", positions)
        order._sizes = as_array("Q", sizes)
        rows = np.arange(n, dtype=np.int64)
        nxt = rows + 1
        if n:
            nxt[-1] = _NIL
        order._prev = as_array("i", rows - 1)
        order._next = as_array("i", nxt)
        order._head, order._tail = (0, n - 1) if n else (_NIL, _NIL)
        order._count = n
        # In two halves: one numpy sum of 64-bit sizes could wrap round.
        order._total = (int((sizes >> np.uint64(32)).sum()) << 32) + int(
            (sizes & np.uint64(_M32)).sum()
        )
        slots = (rows + 1).astype(np.int32)
        fps = (hashes & np.uint64(_FP) | np.uint64(_LIVE)).astype(np.uint32)
        shard_of = (fps >> np.uint32(_SHARD_SHIFT) & np.uint32(SHARDS - 1)).astype(np.uint8)
        by_shard = np.argsort(shard_of, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(np.bincount(shard_of, minlength=SHARDS))))
        for shard in range(SHARDS):
            mine = by_shard[bounds[shard] : bounds[shard + 1]]
            order._tables[shard], order._fps[shard] = layout(slots[mine], fps[mine], len(mine))
            order._taken[shard] = len(mine)
        return order

    def columns(self) -> tuple[dict[int, bytes], npt.NDArray[np.uint8], npt.NDArray[np.uint32]]:
        """A copy of the live rows' keys in LRU order, as ``_packed_build`` reads them back:
        per lane its keys in that order, and per entry its lane and its row there."""
        rows = np.fromiter(self._rows(), dtype=np.int64, count=self._count)
        lanes = np.frombuffer(self._lane, dtype=np.uint8)[rows]
        pos = np.frombuffer(self._pos, dtype=np.uint32)[rows]
        keys: dict[int, bytes] = {}
        new_pos = np.zeros(len(rows), dtype=np.uint32)
        for lane in np.flatnonzero(np.bincount(lanes, minlength=256)).tolist():
            w = _width(lane)
            mine = np.flatnonzero(lanes == lane)
            table = np.frombuffer(self._keys[lane], dtype=np.uint8).reshape(-1, w)
            keys[lane] = table[pos[mine]].tobytes()
            new_pos[mine] = np.arange(len(mine), dtype=np.uint32)
        return keys, lanes, new_pos

    def sizes_in_order(self) -> npt.NDArray[np.uint64]:
        rows = np.fromiter(self._rows(), dtype=np.int64, count=self._count)
        return np.frombuffer(self._sizes, dtype=np.uint64)[rows].copy()

    def _rows(self) -> Iterator[int]:
        """Rows, least recently used first; ``RuntimeError`` once the order changed."""
        version, nxt, row = self._version, self._next, self._head
        while row != _NIL:
            yield row
            if self._version != version:
                raise RuntimeError("PackedOrder changed during iteration")
            row = nxt[row]

    def __repr__(self) -> str:
        slots = sum(map(len, self._tables))
        return f"<PackedOrder entries={self._count} total={self._total} slots={slots}>"
