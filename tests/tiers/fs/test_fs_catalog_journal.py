"""The journal of an FS catalog as a state machine: what it writes, and that replaying what it
wrote reproduces the catalog exactly (entries, sizes, LRU order).

Random runs of the catalog's operations (stores with and without victims returned, loads,
drops, evictions on a full disk, size corrections, whole replacements) drive a ``Catalog``
whose changes go to a ``JournalState``; its writes are made synchronously with the functions
the worker thread runs, and the folder read back after each must equal the catalog.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.tiers.fs import _catalog_journal
from kvtier.tiers.fs._catalog import Catalog, NoRoom
from kvtier.tiers.fs._catalog_files import JournalFiles, load
from kvtier.tiers.fs._catalog_format import Change, Limits
from kvtier.tiers.fs._catalog_journal import (
    MIN_LOG_CHANGES,
    Append,
    Compact,
    Job,
    JournalState,
    Rewrite,
)
from kvtier.tiers.fs._layout import name_of


def key(i: int) -> bytes:
    return b"\x01" + i.to_bytes(15, "big")


def name(i: int) -> str:
    return name_of(key(i))


class Kept:
    """A catalog, its journal state and its files, written synchronously."""

    def __init__(self, root: Path, capacity: int | None) -> None:
        self.catalog: Catalog[str] = Catalog(capacity)
        self.catalog.reset([])
        self.state = JournalState()
        self.catalog.changes = self.state
        self.files = JournalFiles(root, durable=False)
        self.root = root

    def flush(self, final: bool = False) -> Job | None:
        job = self.state.take(self.catalog.entries, final)
        if job is not None:
            entries = _catalog_journal._write(self.files, job)
            if isinstance(job, Compact):
                self.state.compacted(entries)
        return job

    def read_back(self) -> list[tuple[str, int]]:
        loaded, why = load(self.root, Limits())
        assert loaded is not None, why
        return list(zip(loaded.names, loaded.sizes, strict=True))


def step(kept: Kept, rng: random.Random) -> None:
    catalog = kept.catalog
    i = rng.randrange(40)
    op = rng.randrange(7)
    if op <= 1:  # a store: room, then written, found there, or failed before the disk
        try:
            res = catalog.reserve(key(i), name(i), rng.choice((10, 20, 30)))
        except NoRoom:
            return
        outcome = rng.randrange(3)
        landed = res.size if outcome < 2 else None
        catalog.settle(res, landed, written=outcome == 0, touched=outcome == 0)
    elif op == 2:
        catalog.loaded(name(i), 20)
    elif op == 3:
        catalog.drop(name(i))
    elif op == 4:
        res = catalog.reserve(key(i), name(i), 10)
        catalog.evict_more(res, rng.choice((10, 40)))
        catalog.settle(res, None, written=False, touched=rng.random() < 0.5)
    elif op == 5:
        catalog.loaded(name(i), rng.choice((15, 25)))  # a file replaced: its size as read
    elif rng.random() < 0.05:
        catalog.reset([(name(j), 10) for j in rng.sample(range(40), 5)])


@pytest.mark.parametrize("seed", range(8))
def test_replaying_the_journal_reproduces_the_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    monkeypatch.setattr(_catalog_journal, "MIN_LOG_CHANGES", 50)  # compactions, too
    rng = random.Random(seed)
    kept = Kept(tmp_path, capacity=rng.choice((None, 200, 400)))
    for _ in range(60):
        for _ in range(rng.randrange(1, 30)):
            step(kept, rng)
        kept.flush()
        assert kept.read_back() == kept.catalog.entries()
    kept.flush(final=True)
    assert kept.read_back() == kept.catalog.entries()


def test_the_first_write_is_a_checkpoint_then_appends(tmp_path: Path) -> None:
    kept = Kept(tmp_path, None)
    kept.catalog.add(name(1), 10)
    assert isinstance(kept.flush(), Rewrite)  # no checkpoint yet: the notes are not kept
    assert kept.flush() is None  # nothing changed
    kept.catalog.add(name(2), 10)
    job = kept.flush()
    assert isinstance(job, Append) and job.changes.names == [name(2)]
    assert list(job.changes.ops) == [Change.ADD]
    assert isinstance(kept.flush(final=True), Compact)  # the close: a checkpoint, read back
    assert kept.flush(final=True) is None  # nothing since


def test_a_log_past_its_bound_becomes_a_checkpoint() -> None:
    state = JournalState()
    state.resume(5, entries=10, log_changes=MIN_LOG_CHANGES - 2, end=100)
    state.note(Change.ADD, name(1), 1)
    state.note(Change.ADD, name(2), 1)
    assert state.pending == 2 and not state.rewrite
    assert isinstance(state.take(list, final=False), Append)
    state.note(Change.ADD, name(3), 1)  # past max(entries, MIN_LOG_CHANGES)
    job = state.take(list, final=False)
    assert isinstance(job, Compact) and (job.previous, job.resume_end) == (5, None)
    assert job.generation != 5 and state.log_changes == 0


def test_a_failed_write_is_followed_by_a_checkpoint() -> None:
    state = JournalState()
    state.resume(5, entries=1, log_changes=0, end=100)
    state.note(Change.DROP, name(1), 0)
    job = state.take(list, final=False)
    assert isinstance(job, Append) and job.resume_end == 100  # the loaded log, cut there
    state.failed()
    assert state.rewrite and isinstance(state.take(list, final=False), Rewrite)


def test_changes_noted_while_a_checkpoint_is_written_go_to_its_log() -> None:
    state = JournalState()
    rewrite = state.take(lambda: [(name(1), 1)], final=False)
    assert isinstance(rewrite, Rewrite)
    state.note(Change.ADD, name(2), 2)  # the checkpoint is being written meanwhile
    job = state.take(list, final=False)
    assert isinstance(job, Append) and job.generation == rewrite.generation
    assert job.resume_end is None and job.changes.names == [name(2)]


def test_a_reset_from_an_index_built_off_the_loop_keeps_what_changed_meanwhile() -> None:
    catalog: Catalog[str] = Catalog(None)
    catalog.reset([(name(1), 10), (name(2), 20)])
    since = catalog.watch()
    built = Catalog.build([(name(1), 10), (name(2), 20), (name(3), 30)])  # the walk, meanwhile:
    catalog.drop(name(1))  # ... deleted after it was listed
    catalog.add(name(4), 40)  # ... stored after its shard was listed
    catalog.reset(built, since)
    catalog.unwatch()
    assert catalog.entries() == [(name(2), 20), (name(3), 30), (name(4), 40)]
    assert catalog.used == 90
