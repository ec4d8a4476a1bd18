"""The FS layout's listing of a root: every block with its size and mtime (the walk at open),
or, given the names a loaded catalog holds (``KnownNames``, the reconcile), only the blocks it
lacks, a known name's file taken by its folder entry's type without a ``stat``; and what the
catalog holds that no folder had.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.fs._known import KnownNames
from kvtier.tiers.fs._layout import (
    STALE_TMP_SECONDS,
    Entry,
    Kind,
    Pruning,
    name_of,
    path_of,
    walk,
)
from kvtier.tiers.fs._packed_build import Columns, from_names, snapshot
from kvtier.tiers.fs._root import list_blocks, ready_root

NOW = time.time()


def block(root: Path, name: str, size: int, age: float) -> Path:
    """A regular file by a block's name, ``size`` bytes, written ``age`` seconds ago."""
    path = path_of(root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"b" * size)
    os.utime(path, (NOW - age, NOW - age))
    return path


def names(i: int) -> str:
    return f"{i:02x}" * 16


def columns(held: list[str]) -> Columns:
    """A catalog of ``held`` as loaded, oldest first."""
    return snapshot(from_names(held, np.full(len(held), 10, dtype=np.uint64)))


def test_the_walk_with_known_names_lists_only_the_rest_and_says_what_is_gone(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    ready_root(root)
    here = block(root, names(1), 10, 50)
    block(root, names(2), 10, 50).unlink()  # known, removed
    block(root, names(3), 10, 50).unlink()
    path_of(root, names(3)).mkdir()  # known, now a folder
    block(root, names(4), 10, 50).unlink()
    path_of(root, names(4)).symlink_to(here)  # known, now a link to a good file
    block(root, names(5), 20, 30)  # not known: listed with its size, by age
    block(root, names(6), 30, 40)
    path_of(root, names(7)).parent.mkdir(parents=True, exist_ok=True)
    path_of(root, names(7)).mkdir()  # not known, and a folder: not a block
    (here.parent / "notes.txt").write_bytes(b"not kvtier's")
    old_tmp = here.parent / f".tmp-ffffffff-1-0000-{names(8)}"
    fresh_tmp = here.parent / f".tmp-ffffffff-1-0001-{names(9)}"
    for tmp in (old_tmp, fresh_tmp):
        tmp.write_bytes(b"half a block")
    old = NOW - 2 * STALE_TMP_SECONDS
    os.utime(old_tmp, (old, old))

    known = KnownNames(columns([names(i) for i in (0xAA, 4, 1, 3, 2)]))  # 0xaa: never a file
    found = list_blocks(root, known.mark)

    mtime = path_of(root, names(6)).stat().st_mtime, path_of(root, names(5)).stat().st_mtime
    assert found == [Entry(names(6), 30, mtime[0]), Entry(names(5), 20, mtime[1])]  # by age
    assert known.unseen() == [names(i) for i in (0xAA, 4, 3, 2)]  # in the catalog's order
    assert not old_tmp.exists() and fresh_tmp.exists()  # a dead writer's, as at open
    assert (here.parent / "notes.txt").exists() and path_of(root, names(3)).is_dir()


def test_a_known_file_is_not_reported_and_the_walk_at_open_lists_all(tmp_path: Path) -> None:
    root = tmp_path / "c"
    ready_root(root)
    for i, (size, age) in enumerate([(10, 3), (20, 1), (30, 2)]):
        block(root, names(i), size, age)
    known = KnownNames(columns([names(0), names(1)]))
    reported = {item.parts[-1]: item.kind for item in walk(root, known.mark)}
    assert reported[names(2)] is Kind.BLOCK
    assert names(0) not in reported and names(1) not in reported
    assert known.unseen() == []
    assert [(e.name, e.size) for e in list_blocks(root)] == [  # with sizes, oldest first
        (names(0), 10),
        (names(2), 30),
        (names(1), 20),
    ]


@pytest.mark.parametrize("first", [False, True], ids=["after-listing", "tried-first"])
def test_the_listing_removes_shard_folders_left_empty_and_keeps_the_rest(
    tmp_path: Path, first: bool
) -> None:
    """A small tier under churn leaves a folder behind for every shard a block passed
    through; the listing removes the empty ones (a first-level folder once nothing is left in
    it) and nothing else: a folder with a block, a file not kvtier's or a block being
    written stays, whether each folder is tried before it is listed or removed once its
    listing was empty. A walk without ``prune`` (the folder commands) removes nothing."""
    root = tmp_path / "c"
    ready_root(root)
    kept = block(root, names(1), 10, 5).parent  # 01/01
    (root / "01" / "aa").mkdir()  # empty beside it: removed, 01 stays
    (root / "02" / "02").mkdir(parents=True)  # empty and alone: both levels removed
    foreign = root / "03" / "03" / "notes.txt"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"not kvtier's")
    writing = path_of(root, names(4)).parent / f".tmp-ffffffff-1-0001-{names(4)}"
    writing.parent.mkdir(parents=True)
    writing.write_bytes(b"half a block")  # a writer's, fresh: stays, and so does its folder

    before = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir())
    assert len(list(walk(root))) > 0
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()) == before

    pruning = Pruning(first=first)
    assert [e.name for e in list_blocks(root, None, pruning)] == [names(1)]
    assert pruning.folders == 3  # 01/aa, 02/02, 02
    assert kept.is_dir() and foreign.exists() and writing.exists()
    assert not (root / "01" / "aa").exists() and not (root / "02").exists()
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()) == [
        "01",
        "01/01",
        "03",
        "03/03",
        "04",
        "04/04",
    ]


def test_known_names_of_every_lane_hashed_and_repeated() -> None:
    short, long_key = bytes([0xAB, 1, 2]), bytes(range(120))  # 3 bytes; one too long for hex
    hashed = name_of(long_key)
    assert hashed.startswith("h")
    other_hashed = "h" + hashlib.blake2b(b"other", digest_size=32).hexdigest()
    held = [names(1), short.hex(), hashed, names(2), names(1)]  # names(1) twice
    known = KnownNames(snapshot_with_repeats(held))
    asked = [names(1), hashed, other_hashed, "ab", short.hex().upper(), "zz", names(3), ""]
    assert known.mark(asked) == [True, True, False, False, False, False, False, False]
    assert known.unseen() == [short.hex(), names(2)]  # both places of names(1) are seen
    assert known.mark([short.hex(), names(2)]) == [True, True]
    assert known.unseen() == []


def snapshot_with_repeats(held: list[str]) -> Columns:
    """Columns that hold a name more than once, as a checkpoint may (the index keeps one)."""
    once = snapshot(from_names(list(dict.fromkeys(held)), np.zeros(len(set(held)), np.uint64)))
    lanes, positions = [], []
    place = {name: i for i, name in enumerate(dict.fromkeys(held))}
    for name in held:
        lanes.append(once.lanes[place[name]])
        positions.append(once.positions[place[name]])
    return Columns(
        once.keys,
        np.array(lanes, dtype=np.uint8),
        np.array(positions, dtype=np.uint32),
        np.zeros(len(held), dtype=np.uint64),
    )


def test_no_known_names() -> None:
    known = KnownNames(columns([]))
    assert known.mark([names(1)]) == [False]
    assert known.unseen() == []
