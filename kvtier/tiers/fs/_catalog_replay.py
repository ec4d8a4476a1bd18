"""The log replayed onto the checkpoint, as columns, before the packed index is built.

A log holds what changed since its checkpoint, in order: mostly stores (``ADD``) and removals
(``DROP``), up to as many as the checkpoint has entries. Replaying them one by one onto a
``PackedOrder`` costs several Python steps each; instead, when the log holds nothing else,
what it leaves is computed on the side (``replayed``): the checkpoint's entries that no change
named keep their places, and after them come the names the log added last, in the order of
their last addition. With keys of one length (the usual folder) that is a few ``numpy``
passes over the keys and their hashes, however the changes alternate (a full tier's log is a
drop and an add per store: runs of one); otherwise a ``dict`` keeps the last additions, a run
of changes at a time. The index is then built once from those columns (``_packed_build``). A
log with ``BACK`` or ``SIZE`` changes (a failed store's victims put back, a size corrected:
rare) is replayed one change at a time onto the built index.

Blocks; called in the worker thread that reads the catalog at open. Untrusted input: a name
no key has, or more entries than ``most``, is ``CatalogFormatError``.
"""

from __future__ import annotations

import re
import struct
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter

import numpy as np

from kvtier.tiers.fs._catalog_format import CatalogFormatError, Change, Frame
from kvtier.tiers.fs._idents import HASHED_LANE, MAX_HEX_KEY, PAD
from kvtier.tiers.fs._packed import PackedOrder
from kvtier.tiers.fs._packed_build import (
    Columns,
    hashes_of,
    ident_or_error,
    index_of,
    snapshot,
)

__all__ = ["replay", "replayed"]

_PLAIN = bytes((Change.ADD, Change.DROP))
_RUNS = re.compile(rb"(.)\1*", re.DOTALL)


def replayed(columns: Columns, frames: Sequence[Frame], most: int) -> tuple[PackedOrder, Columns]:
    """The index the checkpoint's ``columns`` and the log's ``frames`` leave, and its
    columns as built (the rows before any one-by-one replay: what the walk compares)."""
    if any(frame.ops.translate(None, _PLAIN) for frame in frames):
        order = index_of(columns)
        replay(order, frames, most)
        return order, snapshot(order)
    at_once = _of_one_width(columns, frames, most)
    if at_once is not None:
        return at_once
    last: dict[bytes, int] = {}  # added by the log and not dropped since, in order
    named: set[bytes] = set()
    for frame in frames:
        idents = _idents_of(frame.names)
        named.update(idents)
        for run in _RUNS.finditer(frame.ops):
            start, end = run.span()
            mine = idents[start:end]
            if len(set(mine)) == len(mine):  # C-speed: each one's last change is here
                deque(map(last.pop, mine, repeat(None)), maxlen=0)
                if frame.ops[start] == Change.ADD:
                    last.update(zip(mine, frame.sizes[start:end], strict=True))
                continue
            for ident, size in zip(mine, frame.sizes[start:end], strict=True):
                last.pop(ident, None)
                if frame.ops[start] == Change.ADD:
                    last[ident] = size
    hashes = hashes_of(columns)
    keep = np.ones(len(columns), dtype=bool)
    if named:
        theirs = np.sort(np.fromiter(map(hash, named), dtype=np.int64, count=len(named)))
        ours = hashes.view(np.int64)
        at = np.minimum(np.searchsorted(theirs, ours), len(theirs) - 1)
        for row in np.flatnonzero(theirs[at] == ours).tolist():
            keep[row] = _ident_at(columns, row) not in named  # a hash alike is not a name
    tail = _columns_of(list(last), list(last.values()))
    if int(keep.sum()) + len(tail) > most:
        raise CatalogFormatError(f"more than {most} entries")
    both = _joined(columns, keep, tail)
    tail_hashes = np.fromiter(map(hash, last), dtype=np.int64, count=len(last)).view(np.uint64)
    return index_of(both, np.concatenate((hashes[keep], tail_hashes))), both


def _of_one_width(
    columns: Columns, frames: Sequence[Frame], most: int
) -> tuple[PackedOrder, Columns] | None:
    """``replayed`` for the usual folder (every key of one length, named by its hex) in
    numpy passes, whatever the log's runs: a full tier's log alternates drops and adds, one
    change a run. None when it does not apply (other lengths, no change, or two idents whose
    ``hash`` is alike: the general way tells them apart).

    Each ident's last change decides it: dropped, or added at the place of that change among
    the others added. The checkpoint's entries that no change names keep their places."""
    idents: list[bytes] = []
    for frame in frames:
        idents += _idents_of(frame.names)
    if not idents:
        return None
    width = len(idents[0])
    if not 0 < width <= MAX_HEX_KEY or set(columns.keys) - {width}:
        return None
    if len(set(map(len, idents))) != 1:
        return None
    count = len(idents)
    ops = np.frombuffer(b"".join(frame.ops for frame in frames), dtype=np.uint8)
    sizes = np.concatenate([np.frombuffer(frame.sizes, dtype=np.uint64) for frame in frames])
    theirs = np.frombuffer(b"".join(idents), dtype=np.uint8).reshape(count, width)
    hashes = np.fromiter(map(hash, idents), dtype=np.int64, count=count)
    del idents
    # Per distinct hash, its last change: the first one in the changes reversed.
    distinct, first_back, back = np.unique(hashes[::-1], return_index=True, return_inverse=True)
    last = count - 1 - first_back
    if (theirs != theirs[last[back[::-1]]]).any():  # two idents of one hash
        return None
    added = np.sort(last[ops[last] == Change.ADD])  # in the order of their last addition
    ours = hashes_of(columns)
    keep = np.ones(len(columns), dtype=bool)
    kept_keys = np.zeros((0, width), dtype=np.uint8)
    if len(columns):
        table = np.frombuffer(columns.keys[width], dtype=np.uint8).reshape(-1, width)
        at = np.minimum(np.searchsorted(distinct, ours.view(np.int64)), len(distinct) - 1)
        rows = np.flatnonzero(distinct[at] == ours.view(np.int64))
        named = (table[columns.positions[rows]] == theirs[last[at[rows]]]).all(axis=1)
        keep[rows[named]] = False  # a hash alike is not a name: only the same bytes are
        kept_keys = table[columns.positions[keep]]
    total = int(keep.sum()) + len(added)
    if total > most:
        raise CatalogFormatError(f"more than {most} entries")
    both = Columns(
        {width: kept_keys.tobytes() + theirs[added].tobytes()} if total else {},
        np.full(total, width, dtype=np.uint8),
        np.arange(total, dtype=np.uint32),
        np.concatenate((columns.sizes[keep], sizes[added])),
    )
    return index_of(both, np.concatenate((ours[keep], hashes[added].view(np.uint64)))), both


def replay(order: PackedOrder, frames: Sequence[Frame], most: int) -> None:
    """Replay ``frames`` in order onto ``order``, one change at a time, as the catalog's own
    operations made them."""
    for frame in frames:
        idents = list(map(ident_or_error, frame.names))
        for op, ident, size in zip(frame.ops, idents, frame.sizes, strict=True):
            if op == Change.ADD:
                order.put_last(ident, size)
            elif op == Change.DROP:
                order.pop(ident, None)
            elif op == Change.BACK:
                if ident not in order:
                    order[ident] = size
                    order.move_to_end(ident, last=False)
            elif ident in order:  # Change.SIZE: in place
                order[ident] = size
        if len(order) > most:
            raise CatalogFormatError(f"more than {most} entries")


def _idents_of(names: list[str]) -> list[bytes]:
    """The idents of a frame's ``names`` (checked by the format: name characters only, the
    lengths of block names); at C speed when they are hex names of one length."""
    if names:
        text = "".join(names)
        width = len(names[0])
        if "h" not in text and not width % 2 and len(set(map(len, names))) == 1:
            raw = bytes.fromhex(text)
            w = width // 2
            return list(map(itemgetter(0), struct.iter_unpack(f"{w}s", raw)))
    return list(map(ident_or_error, names))


def _width(lane: int) -> int:
    return 32 if lane == HASHED_LANE else lane


def _ident_at(columns: Columns, row: int) -> bytes:
    lane = int(columns.lanes[row])
    w = _width(lane)
    pos = int(columns.positions[row]) * w
    key = columns.keys[lane][pos : pos + w]
    return PAD + key if lane == HASHED_LANE else key


def _columns_of(idents: list[bytes], sizes: list[int]) -> Columns:
    """Columns of distinct ``idents`` (as ``ident_or_error`` gives them)."""
    lanes = np.fromiter(map(len, idents), dtype=np.uint8, count=len(idents))
    positions = np.zeros(len(idents), dtype=np.uint32)
    keys: dict[int, bytes] = {}
    for lane in np.flatnonzero(np.bincount(lanes, minlength=256)).tolist():
        rows = np.flatnonzero(lanes == lane)
        positions[rows] = np.arange(len(rows), dtype=np.uint32)
        mine = idents if len(rows) == len(idents) else [idents[i] for i in rows.tolist()]
        if lane == HASHED_LANE:
            mine = [ident[len(PAD) :] for ident in mine]
        keys[lane] = b"".join(mine)
    return Columns(keys, lanes, positions, np.fromiter(sizes, dtype=np.uint64, count=len(sizes)))


def _joined(head: Columns, keep: np.ndarray, tail: Columns) -> Columns:
    """``head``'s rows where ``keep``, then ``tail``'s."""
    lanes = np.concatenate((head.lanes[keep], tail.lanes))
    positions = np.zeros(len(lanes), dtype=np.uint32)
    keys: dict[int, bytes] = {}
    for lane in np.flatnonzero(np.bincount(lanes, minlength=256)).tolist():
        w = _width(lane)
        parts: list[bytes] = []
        if lane in head.keys:
            table = np.frombuffer(head.keys[lane], dtype=np.uint8).reshape(-1, w)
            parts.append(table[head.positions[keep & (head.lanes == lane)]].tobytes())
        parts.append(tail.keys.get(lane, b""))
        keys[lane] = b"".join(parts)
        rows = np.flatnonzero(lanes == lane)
        positions[rows] = np.arange(len(rows), dtype=np.uint32)
    sizes = np.concatenate((head.sizes[keep], tail.sizes))
    return Columns(keys, lanes, positions, sizes)
