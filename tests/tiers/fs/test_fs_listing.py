"""The FS layout's two listings of a root: every block with its size and mtime (the walk at
open), and the folder against the names a loaded catalog knows (the reconcile), which takes a
known name's file by its folder entry's type, without a ``stat``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvtier.tiers.fs._layout import (
    STALE_TMP_SECONDS,
    Entry,
    Kind,
    path_of,
    walk,
)
from kvtier.tiers.fs._root import Changes, list_blocks, list_changes, ready_root

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


def test_list_changes_takes_known_names_by_type_and_lists_the_rest(tmp_path: Path) -> None:
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

    known = {names(i) for i in (1, 2, 3, 4)} | {names(0xAA)}  # 0xaa never had a file
    got = list_changes(root, frozenset(known))

    mtime = path_of(root, names(6)).stat().st_mtime, path_of(root, names(5)).stat().st_mtime
    assert got == Changes(
        gone={names(i) for i in (2, 3, 4, 0xAA)},
        found=[Entry(names(6), 30, mtime[0]), Entry(names(5), 20, mtime[1])],  # oldest first
    )
    assert not old_tmp.exists() and fresh_tmp.exists()  # a dead writer's, as at open
    assert (here.parent / "notes.txt").exists() and path_of(root, names(3)).is_dir()


def test_a_known_file_has_no_size_and_the_walk_at_open_has_all(tmp_path: Path) -> None:
    root = tmp_path / "c"
    ready_root(root)
    for i, (size, age) in enumerate([(10, 3), (20, 1), (30, 2)]):
        block(root, names(i), size, age)
    known = frozenset({names(0), names(1)})
    kinds = {
        item.parts[-1]: (item.kind, item.size) for item in walk(root, known) if len(item.parts) == 3
    }
    assert kinds == {
        names(0): (Kind.KNOWN, 0),
        names(1): (Kind.KNOWN, 0),
        names(2): (Kind.BLOCK, 30),
    }
    every = list_blocks(root)
    assert list_changes(root, known).found == [e for e in every if e.name not in known]
    assert [(e.name, e.size) for e in every] == [  # with sizes, oldest first
        (names(0), 10),
        (names(2), 30),
        (names(1), 20),
    ]
    assert all(item.kind is not Kind.KNOWN for item in walk(root))
