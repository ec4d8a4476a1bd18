"""Building the FS catalog's packed index at once, from names as a checkpoint holds them.

A checkpoint holds its names joined by ``\\n`` and their sizes as a column; a walk of the
folder gives a list of names. Either becomes a ``PackedOrder`` here in a few C-speed passes
(``numpy``) instead of a Python object per name: the name boundaries, the checks that each is
one ``_layout.name_of`` gives, the hex turned into key bytes lane by lane. Only the idents'
``hash`` needs a short-lived ``bytes`` per entry (the index is keyed by Python's own keyed
hash, so the caller's key is looked up as it is).

What a checkpoint holds is untrusted: a name that no key has is ``CatalogFormatError``, the
format's own error, and a name listed twice keeps its first place and its last size, as the
catalog's ``OrderedDict`` did. Blocks; called in worker threads.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from kvtier.tiers.fs._catalog_format import CatalogFormatError
from kvtier.tiers.fs._idents import HASHED_LANE, MAX_HEX_KEY, PAD, ident_of_name
from kvtier.tiers.fs._packed import PackedOrder

__all__ = [
    "Columns",
    "columns_of",
    "from_blob",
    "from_names",
    "hashes_of",
    "ident_or_error",
    "index_of",
    "names_of",
    "rebuilt",
    "snapshot",
]

_NL = ord("\n")
_H = ord("h")
_CHUNK = 1 << 16  # rows turned from hex at once: bounds the index arrays' size
_HEX_NL = b"0123456789abcdef\n"
_NIBBLE = np.full(256, 255, dtype=np.uint8)
_NIBBLE[np.frombuffer(b"0123456789", dtype=np.uint8)] = np.arange(10, dtype=np.uint8)
_NIBBLE[np.frombuffer(b"abcdef", dtype=np.uint8)] = np.arange(10, 16, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class Columns:
    """Entries as columns, oldest first: per lane its keys, and per entry its lane, its row
    in the lane and its size (what ``PackedOrder.packed`` takes, less the hashes)."""

    keys: dict[int, bytes]
    lanes: npt.NDArray[np.uint8]
    positions: npt.NDArray[np.uint32]
    sizes: npt.NDArray[np.uint64]

    def __len__(self) -> int:
        return len(self.sizes)


def from_blob(blob: bytes, count: int, sizes: npt.NDArray[np.uint64]) -> PackedOrder:
    """The index of ``count`` names joined by ``\\n`` in ``blob`` (oldest first) and their
    ``sizes``; ``CatalogFormatError`` unless every name is one ``name_of`` gives."""
    return index_of(columns_of(blob, count, sizes))


def from_names(names: Sequence[str], sizes: npt.NDArray[np.uint64]) -> PackedOrder:
    """The index of ``names`` (block names, oldest first) and their ``sizes``; a name that
    no key has (odd length: no ``name_of`` gives it) is left out."""
    keep = [i for i, n in enumerate(names) if n[:1] == "h" or not len(n) % 2]
    if len(keep) != len(names):
        names = [names[i] for i in keep]
        sizes = sizes[np.asarray(keep, dtype=np.int64)]
    if not names:
        return PackedOrder()
    blob = "\n".join(names).encode("ascii")
    return from_blob(blob, len(names), sizes)


def columns_of(blob: bytes, count: int, sizes: npt.NDArray[np.uint64]) -> Columns:
    """``from_blob``'s columns."""
    if len(sizes) != count:
        raise CatalogFormatError(f"{len(sizes)} sizes where {count} names were announced")
    chars = np.frombuffer(blob, dtype=np.uint8)
    if count == 0:
        if len(chars):
            raise CatalogFormatError("names where there should be none")
        empty = np.zeros(0, dtype=np.uint8)
        return Columns({}, empty, np.zeros(0, np.uint32), sizes)
    if not len(chars):
        raise CatalogFormatError(f"no names where {count} were announced")
    ends = np.flatnonzero(chars == _NL)
    if len(ends) != count - 1:
        raise CatalogFormatError(f"{len(ends) + 1} names where {count} were announced")
    starts = np.concatenate(([0], ends + 1))
    lengths = np.concatenate((ends, [len(chars)])) - starts
    hashed = chars[np.minimum(starts, len(chars) - 1)] == _H
    hashed &= lengths > 0
    at_starts = np.zeros(len(chars) + 1, dtype=bool)
    at_starts[starts[hashed]] = True
    if (chars == _H).sum() != hashed.sum() or not at_starts[np.flatnonzero(chars == _H)].all():
        raise CatalogFormatError("a name holds an h that is not its first character")
    if (lengths[hashed] != 65).any():
        raise CatalogFormatError("a hashed name of the wrong length")
    plain = lengths[~hashed]
    if len(plain) and (plain.min() < 2 or plain.max() > 2 * MAX_HEX_KEY or (plain % 2).any()):
        raise CatalogFormatError("a name no key has: its length is not that of a key's hex")
    lanes = np.where(hashed, HASHED_LANE, lengths // 2).astype(np.uint8)
    first = np.where(hashed, starts + 1, starts)
    positions = np.zeros(count, dtype=np.uint32)
    keys: dict[int, bytes] = {}
    present = np.flatnonzero(np.bincount(lanes, minlength=256)).tolist()
    if present != [HASHED_LANE] and len(present) == 1 and not blob.translate(None, _HEX_NL):
        # Keys of one length, named by their hex (the usual folder): ``fromhex`` skips the
        # newlines between them, so one call turns them all, at C speed.
        keys[present[0]] = bytes.fromhex(blob.decode("ascii"))
        return Columns(keys, lanes, np.arange(count, dtype=np.uint32), sizes)
    for lane in present:
        rows = np.flatnonzero(lanes == lane)
        positions[rows] = np.arange(len(rows), dtype=np.uint32)
        keys[lane] = _unhex(chars, first[rows], 64 if lane == HASHED_LANE else 2 * lane)
    return Columns(keys, lanes, positions, sizes)


def _unhex(chars: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], digits: int) -> bytes:
    """The bytes of the ``digits`` hex digits from each of ``starts``, concatenated."""
    parts: list[bytes] = []
    span = np.arange(digits, dtype=np.int64)
    for i in range(0, len(starts), _CHUNK):
        nibbles = _NIBBLE[chars[starts[i : i + _CHUNK, None] + span]]
        if (nibbles == 255).any():
            raise CatalogFormatError("a name holds a character no block name has")
        parts.append((nibbles[:, 0::2] << 4 | nibbles[:, 1::2]).tobytes())
    return b"".join(parts)


def hashes_of(columns: Columns) -> npt.NDArray[np.uint64]:
    """Each entry's ident's ``hash`` (a short-lived ``bytes`` each: the one Python object
    per entry the build makes)."""
    out = np.zeros(len(columns), dtype=np.int64)
    for lane, blob in columns.keys.items():
        rows = np.flatnonzero(columns.lanes == lane)
        w = 32 if lane == HASHED_LANE else lane
        keys = map(itemgetter(0), struct.iter_unpack(f"{w}s", blob))
        if lane == HASHED_LANE:
            keys = map(PAD.__add__, keys)
        mine = np.fromiter(map(hash, keys), dtype=np.int64, count=len(blob) // w)
        out[rows] = mine[columns.positions[rows]]
    return out.view(np.uint64)


def index_of(columns: Columns, hashes: npt.NDArray[np.uint64] | None = None) -> PackedOrder:
    """The index of ``columns`` (``hashes``: their ``hashes_of``, when at hand); an ident
    listed twice keeps its first place and last size."""
    if hashes is None:
        hashes = hashes_of(columns)
    ordered = np.sort(hashes)
    if len(ordered) > 1 and (ordered[1:] == ordered[:-1]).any():  # an ident may be repeated
        return PackedOrder(dict(_pairs(columns)).items())
    return PackedOrder.packed(columns.keys, columns.lanes, columns.positions, columns.sizes, hashes)


def _pairs(columns: Columns) -> list[tuple[bytes, int]]:
    out: list[tuple[bytes, int]] = []
    for lane, pos, size in zip(
        columns.lanes.tolist(), columns.positions.tolist(), columns.sizes.tolist(), strict=True
    ):
        w = 32 if lane == HASHED_LANE else lane
        key = columns.keys[lane][pos * w : pos * w + w]
        out.append((PAD + key if lane == HASHED_LANE else key, size))
    return out


def snapshot(order: PackedOrder) -> Columns:
    """A copy of ``order``'s entries as columns (a fraction of its memory)."""
    keys, lanes, positions = order.columns()
    return Columns(keys, lanes, positions, order.sizes_in_order())


def rebuilt(order: PackedOrder) -> PackedOrder:
    """A copy of ``order``, built at once (its tables as full as they are built)."""
    return index_of(snapshot(order))


def names_of(columns: Columns) -> list[str]:
    """The block names of ``columns``, oldest first."""
    per_lane: dict[int, list[str]] = {}
    for lane, blob in columns.keys.items():
        text = blob.hex()
        w = 64 if lane == HASHED_LANE else 2 * lane
        prefix = "h" if lane == HASHED_LANE else ""
        per_lane[lane] = [prefix + text[i : i + w] for i in range(0, len(text), w)]
    if len(per_lane) == 1:
        return next(iter(per_lane.values()))
    return [
        per_lane[lane][pos]
        for lane, pos in zip(columns.lanes.tolist(), columns.positions.tolist(), strict=True)
    ]


def ident_or_error(name: str) -> bytes:
    """The ident of a name read back; ``CatalogFormatError`` when no key has it."""
    ident = ident_of_name(name)
    if ident is None:
        raise CatalogFormatError("a name no key has")
    return ident
