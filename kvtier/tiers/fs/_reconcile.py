"""Bringing a catalog loaded from a checkpoint in line with the folder, while the tier serves.

A checkpoint says what the folder held when it was written; the folder may have changed since
(another process stored or removed blocks while this one was closed, someone removed files by
hand, a kill -9 lost the last changes of the log). So after an open from a checkpoint the
folder is walked in the background (``compare``, in a worker thread: the walk at open it
replaces, stale temporary files removed as there) and the difference applied on the event loop
(``apply``, a slice at a time): files the catalog did not know join it at the most recent end,
in the order they were written; entries with no file are dropped (``not_found``); sizes are
corrected where they stand. Both are told as they are applied (``found``, ``forget``: the tier
announces them as ``stored`` and ``removed`` events), so a router that took the node's state
before the walk ended learns the difference too.

The tier keeps storing, loading, deleting and evicting meanwhile, and the walk must not undo
any of it: the difference is taken against the catalog as loaded (the epoch ``since`` the walk
began at, a watcher held throughout), and a name that an operation added or dropped after
``since`` keeps what the operation made of it (``Catalog.changed_since``,
``Catalog.drop_unless_newer``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio.lowlevel

from kvtier.tiers.fs._catalog import Catalog
from kvtier.tiers.fs._packed_build import Columns, names_of
from kvtier.tiers.fs._root import list_blocks

__all__ = ["SLICE", "Difference", "apply", "compare"]

SLICE = 256
"""Changes applied per turn of the event loop."""


@dataclass(frozen=True, slots=True)
class Difference:
    """The folder against the catalog as loaded: files it did not know (oldest first),
    entries with no file, and entries whose file has another size."""

    found: list[tuple[str, int]]
    gone: list[str]
    resized: list[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class Applied:
    """What ``apply`` changed: names added and resized, names dropped."""

    found: int
    gone: list[str]
    resized: int


def compare(root: Path, loaded: Columns) -> Difference:
    """Walk ``root`` and compare it with the catalog as ``loaded``. Blocks; a worker
    thread's."""
    walked = list_blocks(root)
    names = names_of(loaded)
    known = dict(zip(names, loaded.sizes.tolist(), strict=True))
    found: list[tuple[str, int]] = []
    resized: list[tuple[str, int]] = []
    on_disk: set[str] = set()
    for entry in walked:
        on_disk.add(entry.name)
        size = known.get(entry.name)
        if size is None:
            found.append((entry.name, entry.size))
        elif size != entry.size:
            resized.append((entry.name, entry.size))
    gone = [name for name in names if name not in on_disk]
    return Difference(found, gone, resized)


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
            n for n in diff.gone[start : start + SLICE] if catalog.drop_unless_newer(n, since)
        ]
        gone.extend(dropped)
        forget(dropped)
        await anyio.lowlevel.checkpoint()
    added = resized = 0
    for start in range(0, len(diff.found), SLICE):
        names: list[str] = []
        for name, size in diff.found[start : start + SLICE]:
            if name not in catalog and not catalog.changed_since(name, since):
                catalog.add(name, size)
                names.append(name)
        added += len(names)
        found(names)
        await anyio.lowlevel.checkpoint()
    for name, size in diff.resized:
        if not catalog.changed_since(name, since) and catalog.size_of(name) not in (None, size):
            catalog.resize(name, size)
            resized += 1
    return Applied(added, gone, resized)
