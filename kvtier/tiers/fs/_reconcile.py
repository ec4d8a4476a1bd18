"""Bringing a catalog loaded from a checkpoint in line with the folder, while the tier serves.

A checkpoint says what the folder held when it was written; the folder may have changed since
(another process stored or removed blocks while this one was closed, someone removed files by
hand, a kill -9 lost the last changes of the log). So after an open from a checkpoint the
folder is walked in the background (``compare``, in a worker thread: the walk at open it
replaces, stale temporary files removed as there) and the difference applied on the event loop
(``apply``, a slice at a time): files the catalog did not know join it at the most recent end,
in the order they were written; entries with no file are dropped (``not_found``). Both are
told as they are applied (``found``, ``forget``: the tier announces them as ``stored`` and
``removed`` events), so a router that took the node's state before the walk ended learns the
difference too.

The walk ``stat``s only the files the catalog did not know (``_root.list_blocks`` with the
catalog's names, ``_known``): a name it knows is there when its folder lists a regular file
by that name, which the folder's entry says without a ``stat`` (on a cold page cache a
``stat`` per file is much of what a walk of many files costs). So a file that another writer
replaced with one of another size keeps the size the catalog had until its first load, which
corrects it (``Catalog.loaded``); that load verifies every byte, as every load does (a file
that is not the block is a miss with a reason, and is dropped).

The tier keeps storing, loading, deleting and evicting meanwhile, and the walk must not undo
any of it: the difference is taken against the catalog as loaded (the epoch ``since`` the walk
began at, a watcher held throughout), and a name that an operation added or dropped after
``since`` keeps what the operation made of it (``Catalog.changed_since``,
``Catalog.drop_unless_newer``). And the catalog hears of some changes only after the files
changed: a store's file is renamed into place before the catalog adds its name, its victims
leave the catalog before their files are removed, a delete removes its file before the name
is dropped. While such an operation is in flight (``Catalog.changing``) the walk leaves its
names to it, so each change is told once, by the operation that made it. The same walk runs
again while the tier is open (``walk_interval``, ``_persistence``), compared with the
catalog as it was when that walk began.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio.lowlevel

from kvtier.tiers.fs._catalog import Catalog
from kvtier.tiers.fs._known import KnownNames
from kvtier.tiers.fs._layout import SHARD_FOLDERS, Pruning
from kvtier.tiers.fs._packed_build import Columns
from kvtier.tiers.fs._root import list_blocks

__all__ = ["SLICE", "Difference", "apply", "compare"]

SLICE = 256
"""Changes applied per turn of the event loop."""


@dataclass(frozen=True, slots=True)
class Difference:
    """The folder against the catalog as loaded: files it did not know with their sizes
    (oldest first), and entries with no file (in the catalog's order); and the empty shard
    folders the walk removed."""

    found: list[tuple[str, int]]
    gone: list[str]
    pruning: Pruning = field(default_factory=Pruning)


@dataclass(frozen=True, slots=True)
class Applied:
    """What ``apply`` changed: names added, names dropped."""

    found: int
    gone: list[str]


def compare(root: Path, loaded: Columns) -> Difference:
    """Walk ``root`` and compare it with the catalog as ``loaded``. Blocks; a worker
    thread's."""
    # Far fewer blocks than shard folders: most folders found are empty ones churn left.
    known, pruning = KnownNames(loaded), Pruning(first=len(loaded) < SHARD_FOLDERS // 4)
    found = list_blocks(root, known.mark, pruning)
    return Difference([(entry.name, entry.size) for entry in found], known.unseen(), pruning)


async def apply(
    catalog: Catalog[anyio.Event],
    diff: Difference,
    since: int,
    forget: Callable[[list[str]], None],
    found: Callable[[list[str]], None],
) -> Applied:
    """Apply ``diff`` (taken from epoch ``since`` on) to ``catalog``, ``SLICE`` changes per
    turn of the loop; ``forget(names)`` is told the entries dropped, ``found(names)`` the
    files added, as they are."""
    gone: list[str] = []
    for start in range(0, len(diff.gone), SLICE):
        dropped = [
            n
            for n in diff.gone[start : start + SLICE]
            if not catalog.changing(n) and catalog.drop_unless_newer(n, since)
        ]
        gone.extend(dropped)
        forget(dropped)
        await anyio.lowlevel.checkpoint()
    added = 0
    for start in range(0, len(diff.found), SLICE):
        names: list[str] = []
        for name, size in diff.found[start : start + SLICE]:
            if (
                name not in catalog
                and not catalog.changing(name)
                and not catalog.changed_since(name, since)
            ):
                catalog.add(name, size)
                names.append(name)
        added += len(names)
        found(names)
        await anyio.lowlevel.checkpoint()
    return Applied(added, gone)
