"""The block names a loaded catalog holds, as the walk that reconciles it asks for them.

The walk learns which files the catalog knows and which it lacks. Holding the catalog's names
as Python strings in a set would cost well over 100 bytes a block for as long as the walk runs
(seconds to minutes on a large cold folder): more than the catalog itself. So the names stay
as the catalog's key columns hold them, with a sorted order per lane (9 bytes a block with
what was seen), and a shard folder's names are asked at once (``mark``): each turned into its
ident as the catalog does, then looked up in numpy passes. A name found is marked; the names no
folder had are the unmarked ones (``unseen``). Blocks; a worker thread's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier.tiers.fs._idents import HASHED_LANE, PAD, ident_of_name, lane_of, name_of_ident
from kvtier.tiers.fs._packed_build import Columns

__all__ = ["KnownNames"]


def _width(lane: int) -> int:
    """Bytes a lane's key takes in a column (a hashed name's ident less its ``PAD``)."""
    return 32 if lane == HASHED_LANE else lane


class _Lane:
    """One lane's keys (``S<width>``: every key of a lane has the width, so no two differ in
    trailing zeros alone) as the column holds them, their sorted order, and which have been
    seen, by sorted place. No sorted copy of the keys: the order is all the walk adds."""

    __slots__ = ("keys", "order", "seen", "width")

    def __init__(self, lane: int, blob: bytes) -> None:
        self.width = _width(lane)
        self.keys = np.frombuffer(blob, dtype=f"S{self.width}")
        self.order: npt.NDArray[np.intp] = np.argsort(self.keys, kind="stable")
        self.seen = np.zeros(len(self.keys), dtype=bool)

    def mark(self, asked: bytes) -> npt.NDArray[np.bool_]:
        """Which of the keys joined in ``asked`` this lane holds; those are marked."""
        wanted = np.frombuffer(asked, dtype=f"S{self.width}")
        if not len(self.keys):
            return np.zeros(len(wanted), dtype=bool)
        places = np.searchsorted(self.keys, wanted, sorter=self.order)
        places = np.minimum(places, len(self.keys) - 1)
        held: npt.NDArray[np.bool_] = self.keys[self.order[places]] == wanted
        self.seen[places[held]] = True
        return held

    def unseen_rows(self) -> npt.NDArray[np.bool_]:
        """Per row of the lane's column, whether no walked name was its key."""
        seen = self.seen.copy()
        # A key the column holds twice was marked at its first sorted place only.
        in_order = self.keys[self.order]
        repeated = np.flatnonzero(in_order[1:] == in_order[:-1])
        for place in repeated.tolist():
            seen[place + 1] |= seen[place]
        for place in reversed(repeated.tolist()):
            seen[place] |= seen[place + 1]
        by_row = np.empty_like(seen)
        by_row[self.order] = seen
        return ~by_row


class KnownNames:
    """The names of ``columns`` (a catalog as loaded), marked as a walk finds them."""

    def __init__(self, columns: Columns) -> None:
        self._columns = columns
        self._lanes = {lane: _Lane(lane, blob) for lane, blob in columns.keys.items()}

    def mark(self, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` (one folder's regular files) the catalog holds; each of those
        is marked as seen. A name no key has (not one ``name_of`` gives) is not held."""
        asked: dict[int, tuple[list[int], list[bytes]]] = {}
        for i, name in enumerate(names):
            ident = ident_of_name(name)
            lane = None if ident is None else lane_of(ident)
            if ident is None or lane not in self._lanes:
                continue
            rows, keys = asked.setdefault(lane, ([], []))
            rows.append(i)
            keys.append(ident[len(PAD) :] if lane == HASHED_LANE else ident)
        held = [False] * len(names)
        for lane, (rows, keys) in asked.items():
            found = self._lanes[lane].mark(b"".join(keys))
            for i, is_held in zip(rows, found.tolist(), strict=True):
                held[i] = is_held
        return held

    def unseen(self) -> list[str]:
        """The names no ``mark`` found, in the catalog's order (oldest first)."""
        columns = self._columns
        lost = np.zeros(len(columns), dtype=bool)
        for lane, held in self._lanes.items():
            entries = np.flatnonzero(columns.lanes == lane)
            lost[entries] = held.unseen_rows()[columns.positions[entries]]
        names: list[str] = []
        for entry in np.flatnonzero(lost).tolist():
            lane, row = int(columns.lanes[entry]), int(columns.positions[entry])
            width = _width(lane)
            key = columns.keys[lane][row * width : (row + 1) * width]
            names.append(name_of_ident(PAD + key if lane == HASHED_LANE else key))
        return names
