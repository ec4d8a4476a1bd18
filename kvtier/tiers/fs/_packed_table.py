"""The hash tables of ``PackedOrder`` laid out at once, vectorised.

A table is two columns (``_packed``): the row of each slot and 29 bits of its ident's hash
with a mark (0: empty). Building one entry at a time costs a Python step per entry; these
functions lay a whole table out in a few ``numpy`` passes, for a table that grows or sheds
its tombstones and for an index built from a checkpoint.
"""

from __future__ import annotations

from array import array
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["MIN_TABLE", "as_array", "layout"]

MIN_TABLE: Final = 8


def as_array(typecode: str, values: npt.NDArray[np.generic]) -> array[int]:
    """``values`` as an ``array`` (cheap to index from Python, one element at a time)."""
    out = array(typecode)
    out.frombytes(np.ascontiguousarray(values).astype(typecode, copy=False).tobytes())
    return out


def layout(
    rows: npt.NDArray[np.int32], fps: npt.NDArray[np.uint32], room: int
) -> tuple[array[int], array[int]]:
    """A table (rows, marked hash bits) holding ``rows``, at most half full with ``room``
    entries.

    Taken in the order of their home slots, each entry goes to its home or just after the
    one before, whichever is later: what inserting them one by one in that order gives,
    computed at once. The few pushed past the end wrap round to the first free slots."""
    size = max(MIN_TABLE, 1 << (2 * room - 1).bit_length())
    # Sorted as 16-bit values where they fit: numpy sorts those stably by radix, in one pass.
    narrow = np.uint16 if size <= 1 << 16 else np.uint32
    homes = (fps & np.uint32(size - 1)).astype(narrow)
    order = np.argsort(homes, kind="stable")
    home = homes[order].astype(np.int64)
    steps = np.arange(len(order), dtype=np.int64)
    at = np.maximum.accumulate(home - steps) + steps if len(order) else steps
    inside = int(np.searchsorted(at, size))
    out = np.zeros(size, dtype=np.int32)
    out[at[:inside]] = rows[order[:inside]]
    out_fps = np.zeros(size, dtype=np.uint32)
    out_fps[at[:inside]] = fps[order[:inside]]
    table, table_fps = as_array("i", out), as_array("I", out_fps)
    mask = size - 1
    rest = order[inside:]
    for r, fp in zip(rows[rest].tolist(), fps[rest].tolist(), strict=True):
        i = 0  # their probes ran to the end, all of it taken: they wrap round
        while table_fps[i]:
            i = (i + 1) & mask
        table[i], table_fps[i] = r, fp
    return table, table_fps
