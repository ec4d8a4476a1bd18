"""An owner FS tier across restarts: it serves at once from the catalog it kept, brings that
catalog in line with the folder in the background without undoing what happens meanwhile,
keeps its LRU order, falls back to the walk when the catalog is not usable, and after a
kill -9 at any step of its writes serves every block the folder holds, correctly.

The walk in the background is held where a test needs it held (a ``threading.Event`` in the
worker thread's path), so nothing here depends on timing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvtier import BlockNotFoundError, LookupResult
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier, _persistence, _reconcile, _write
from kvtier.tiers.fs._catalog_files import CHECKPOINT_NAME, LOG_NAME, STEPS
from kvtier.tiers.fs._layout import Entry, Known, Pruning, path_of
from tests.tiers.fs import catalog_worker
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 4096
key, data = key_and_data("restart", BLOCK)
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
REPO = Path(__file__).parents[3]


def file_of(root: Path, i: int) -> Path:
    return path_of(root, key(i).hex())


async def stored(tier: FSTier, *blocks: int) -> None:
    for i in blocks:
        await tier.store(key(i), memoryview(data(i)))


async def read(tier: FSTier, i: int) -> bytes:
    dst = bytearray(BLOCK)
    await tier.load(key(i), memoryview(dst))
    return bytes(dst)


class HeldWalk:
    """Holds the background walk after it listed the folder, until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.listed = threading.Event()
        self._go = threading.Event()
        real = _reconcile.list_blocks  # type: ignore[attr-defined]  # the seam the walk calls

        def held(
            root: Path, known: Known | None = None, pruning: Pruning | None = None
        ) -> list[Entry]:
            found = real(root, known, pruning)
            self.listed.set()
            self._go.wait(30)
            return found

        monkeypatch.setattr(_reconcile, "list_blocks", held)

    async def wait_listed(self) -> None:
        await anyio.to_thread.run_sync(self.listed.wait, 30)

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldWalk]:
    walk = HeldWalk(monkeypatch)
    yield walk
    walk.release()


async def test_a_reopened_owner_serves_at_once_from_its_catalog(
    tmp_path: Path, held: HeldWalk
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        await stored(tier, 0, 1, 2)
        assert not tier.statistics().catalog_from_checkpoint  # a new folder: walked
    assert (root / CHECKPOINT_NAME).exists() and (root / LOG_NAME).exists()
    async with FSTier(root, shared=True) as other:  # another process, while it is closed
        await stored(other, 3)
    async with FSTier(root, shared=False) as tier:
        s = tier.statistics()
        assert (s.catalog_from_checkpoint, s.catalog_complete, s.blocks) == (True, False, 3)
        assert [tier.lookup(key(i)) for i in range(3)] == [HIT] * 3  # at once
        assert await read(tier, 1) == data(1)
        assert tier.lookup(key(3)) is RETRY  # not in the catalog: checked on the disk
        assert await resolve_lookup(tier, key(3)) is HIT
        assert await resolve_lookup(tier, key(9)) is MISS
        held.release()
        await tier._persistence.walked()
        s = tier.statistics()
        assert (s.catalog_complete, s.blocks) == (True, 4)
        assert tier.lookup(key(8)) is MISS  # the index alone again: a miss at once
        assert await read(tier, 3) == data(3)


async def test_the_walk_reconciles_what_changed_while_closed(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        await stored(tier, 0, 1, 2, 3)
    async with FSTier(root, shared=True) as other:  # stored and replaced elsewhere
        await stored(other, 4)
        await other.delete(key(2))
        await other.delete(key(3))
        await other.store(key(3), memoryview(data(3) * 2))  # another size now
    file_of(root, 1).unlink()  # by hand
    async with FSTier(root, shared=False) as tier:
        tier.events.drain()
        before = dict(tier._catalog.entries())
        await tier._persistence.walked()
        told = {(k, e.reason) for e in tier.events.drain() for k in e.keys}
        # gone: removed (not_found); found: stored (no reason); replaced: nothing to tell
        assert told == {(key(1), "not_found"), (key(2), "not_found"), (key(4), None)}
        assert [tier.lookup(key(i)) for i in range(5)] == [HIT, MISS, MISS, HIT, HIT]
        sizes = dict(tier._catalog.entries())
        # A known name's file is not stat'ed: the one replaced with another size keeps the
        # size the catalog had; a found file comes with its own.
        assert file_of(root, 3).stat().st_size != before[key(3).hex()]
        assert sizes[key(3).hex()] == before[key(3).hex()]
        assert sizes[key(4).hex()] == file_of(root, 4).stat().st_size
        assert tier.statistics().bytes_stored == sum(sizes.values())
        dst = bytearray(2 * BLOCK)
        await tier.load(key(3), memoryview(dst))  # the load reads the file as it is
        assert bytes(dst) == data(3) * 2
        sizes = dict(tier._catalog.entries())  # and corrects its size
        assert sizes[key(3).hex()] == file_of(root, 3).stat().st_size
        assert tier.statistics().bytes_stored == sum(sizes.values())


async def test_a_walk_while_open_finds_what_changed_behind_the_tiers_back(tmp_path: Path) -> None:
    """An owner walks its folder again while open (``walk_interval``): a file removed by hand
    is dropped and said as removed, a block file copied in is taken in and said as stored,
    without waiting for a load or the next open."""
    root, other = tmp_path / "c", tmp_path / "other"
    async with FSTier(other, shared=False) as elsewhere:
        await stored(elsewhere, 9)  # a block file to copy in by hand
    async with FSTier(root, shared=False, walk_interval=0.05) as tier:
        await stored(tier, 0, 1, 2)
        heard = {key(1): anyio.Event(), key(9): anyio.Event()}
        tier.add_listener(lambda k: heard[k].set() if k in heard else None)
        tier.events.drain()
        file_of(root, 1).unlink()
        file_of(root, 9).parent.mkdir(parents=True, exist_ok=True)
        file_of(root, 9).write_bytes(file_of(other, 9).read_bytes())
        assert [tier.lookup(key(i)) for i in (1, 9)] == [HIT, MISS]  # from the catalog
        with anyio.fail_after(30):
            for event in heard.values():
                await event.wait()
        told = {(k, e.kind.value, e.reason) for e in tier.events.drain() for k in e.keys}
        assert told == {(key(1), "removed", "not_found"), (key(9), "stored", None)}
        assert [tier.lookup(key(i)) for i in (0, 1, 2, 9)] == [HIT, MISS, HIT, HIT]
        assert await read(tier, 9) == data(9)
        stats = tier.statistics()
        assert stats.catalog_walks >= 1 and stats.catalog_walk_failures == 0
        assert stats.blocks == 3


async def test_walks_while_stores_evict_and_delete_find_nothing_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Walks back to back while stores evict (their victims' files removed in worker threads
    after the catalog let them go) and deletes remove files: nothing changed behind the
    tier's back, so no walk may find a file the catalog lacks or an entry without a file."""
    monkeypatch.setattr(_persistence, "WALK_COST_RATIO", 0)  # a walk as soon as one ends
    caplog.set_level(logging.INFO, logger="kvtier.tiers.fs")
    capacity = 24 * (BLOCK + 4096)  # a block file is its payload and a header: 24 fit
    async with FSTier(
        tmp_path / "c", shared=False, capacity_bytes=capacity, walk_interval=0.001
    ) as tier:
        walks_before = tier.statistics().catalog_walks
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for lane in range(4):
                    tg.start_soon(churn, tier, lane)
        assert tier.statistics().catalog_walks - walks_before >= 5
    assert "a walk found" not in caplog.text
    assert tier.statistics().catalog_walk_failures == 0


async def test_walks_while_open_remove_the_shard_folders_churn_left_empty(
    tmp_path: Path,
) -> None:
    """Stores past a small capacity leave a shard folder behind for nearly every block
    that passed through; the owner's walks remove those left empty, so a walk's cost
    follows the blocks held, not every block ever stored, while the blocks held stay
    whole."""
    root = tmp_path / "c"
    capacity = 24 * (BLOCK + 4096)
    async with FSTier(root, shared=False, capacity_bytes=capacity, walk_interval=3600) as tier:
        await stored(tier, *range(300))
        held = [i for i in range(300) if tier.lookup(key(i)) is HIT]
        assert 0 < len(held) < 60
        leaves = {file_of(root, i).parent for i in held}
        assert len(shard_folders(root)) > 3 * len(leaves)  # the churn's: more than held
        with anyio.fail_after(30):
            await tier._persistence._walk_once()  # as the owner's next walk
        assert shard_folders(root) == leaves | {leaf.parent for leaf in leaves}
        assert [await read(tier, i) for i in held] == [data(i) for i in held]
        assert tier.statistics().catalog_walk_failures == 0


async def test_a_store_whose_shard_folder_a_walk_removed_makes_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk removes an empty shard folder between a store's open of it and the write of
    the block's file there (as ``rmdir`` can: the folder is empty until the file is made):
    the store makes the folder again and the block lands whole."""
    root = tmp_path / "c"
    removed: list[Path] = []
    real = _write.open_shard  # type: ignore[attr-defined]  # the seam a store opens through

    def opened_then_removed(*args: Any, **kwargs: Any) -> int:
        fd = real(*args, **kwargs)
        folder = file_of(root, 1).parent
        if not removed and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # as the walk's prune would, in its own thread
            removed.append(folder)
        return fd

    async with FSTier(root, shared=False) as tier:
        monkeypatch.setattr(_write, "open_shard", opened_then_removed)
        await stored(tier, 1)
        assert removed == [file_of(root, 1).parent]
        assert tier.lookup(key(1)) is HIT
        assert await read(tier, 1) == data(1)
        assert tier.statistics().stores == 1


def shard_folders(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_dir()}


async def churn(tier: FSTier, lane: int) -> None:
    """Stores of fresh blocks past the capacity, every third one deleted again."""
    for i in range(lane * 1000, lane * 1000 + 150):
        await tier.store(key(i), memoryview(data(i)))
        if i % 3 == 0:
            await tier.delete(key(i))


async def test_the_walk_drops_a_known_name_that_is_no_longer_a_file(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        await stored(tier, 0, 1, 2, 3)
    file_of(root, 1).unlink()
    file_of(root, 1).mkdir()  # a folder by a known name
    file_of(root, 2).unlink()
    file_of(root, 2).symlink_to(file_of(root, 0))  # a link to a good block, by a known name
    file_of(root, 3).unlink()
    os.mkfifo(file_of(root, 3))  # neither a file nor a folder: never opened
    async with FSTier(root, shared=False) as tier:
        tier.events.drain()
        await tier._persistence.walked()
        told = {(k, e.reason) for e in tier.events.drain() for k in e.keys}
        assert told == {(key(i), "not_found") for i in (1, 2, 3)}
        assert [tier.lookup(key(i)) for i in range(4)] == [HIT, MISS, MISS, MISS]
        assert tier.statistics().blocks == 1
        assert await read(tier, 0) == data(0)
    # Not kvtier's: left where they are.
    assert file_of(root, 1).is_dir() and file_of(root, 2).is_symlink()
    assert file_of(root, 3).is_fifo()


async def test_what_happens_during_the_walk_is_not_undone(tmp_path: Path, held: HeldWalk) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        await stored(tier, 0, 1, 2)
    file_of(root, 2).unlink()  # gone while closed: the walk drops it ...
    async with FSTier(root, shared=False) as tier:
        await held.wait_listed()  # the walk has listed the folder
        await tier.delete(key(0))  # listed, then deleted
        await stored(tier, 5)  # not listed, stored
        await stored(tier, 2)  # ... unless it is stored again meanwhile
        tier.events.drain()
        held.release()
        await tier._persistence.walked()
        assert tier.events.drain() == []  # nothing the walk saw is news
        assert [tier.lookup(key(i)) for i in (0, 1, 2, 5)] == [MISS, HIT, HIT, HIT]
        assert tier.statistics().blocks == 3


async def test_the_lru_order_survives_a_clean_close(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        await stored(tier, *range(8))
        for i in (5, 2, 7, 0):
            await read(tier, i)
        before = tier._catalog.names()
        capacity = tier.statistics().bytes_stored  # full: each new block evicts one
    async with FSTier(root, shared=False, capacity_bytes=capacity) as tier:
        assert tier._catalog.names() == before
        await tier._persistence.walked()
        assert tier._catalog.names() == before  # the walk found nothing new
        tier.events.drain()
        evicted: list[bytes] = []
        for i in range(100, 108):
            await stored(tier, i)
            evicted += [k for e in tier.events.drain() if e.reason == "evicted" for k in e.keys]
    assert [k.hex() for k in evicted] == before


@pytest.mark.parametrize("damage", ["flipped", "truncated", "old_version"])
async def test_a_damaged_checkpoint_falls_back_to_the_walk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        await stored(tier, 0, 1)
    path = root / CHECKPOINT_NAME
    raw = bytearray(path.read_bytes())
    if damage == "flipped":
        raw[60] ^= 0x20
    elif damage == "truncated":
        del raw[-5:]
    else:
        raw[8] = 0
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.fs"):
        async with FSTier(root, shared=False) as tier:
            s = tier.statistics()
            assert (s.catalog_from_checkpoint, s.catalog_complete, s.blocks) == (False, True, 2)
            assert tier.lookup(key(1)) is HIT
    said = [r for r in caplog.records if "walking the folder" in r.getMessage()]
    assert len(said) == 1


async def test_a_shared_tier_keeps_no_catalog(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=True) as tier:
        await stored(tier, 0)
        assert tier.statistics().catalog_checkpoints == 0
    assert not (root / CHECKPOINT_NAME).exists()


# -- kill -9 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [*STEPS, "log_append"])
async def test_kill_9_at_each_step_of_the_writes_serves_every_block(
    tmp_path: Path, step: str
) -> None:
    root = tmp_path / "c"
    ns = f"kill-{step}"
    with anyio.fail_after(120):
        done = await anyio.run_process(
            [sys.executable, "-m", "tests.tiers.fs.catalog_worker", str(root), ns, step],
            cwd=REPO,
            check=False,
        )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    report = json.loads(done.stdout.decode().splitlines()[-1])
    worker_key, worker_data = key_and_data(ns, catalog_worker.BLOCK)
    on_disk = {
        i
        for i in range(catalog_worker.FIRST + catalog_worker.MORE)
        if path_of(root, worker_key(i).hex()).exists()
    }
    assert set(report["stored"]) <= on_disk  # what a store returned is on the disk
    dst = bytearray(catalog_worker.BLOCK)
    async with FSTier(root, shared=False) as tier:
        for i in sorted(on_disk):  # nothing the folder holds is lost, no byte is wrong
            assert await resolve_lookup(tier, worker_key(i)) is HIT, i
            await tier.load(worker_key(i), memoryview(dst))
            assert bytes(dst) == worker_data(i)
        for i in range(1000, 1020):  # no false HIT
            assert await resolve_lookup(tier, worker_key(i)) is MISS
        for i in report["deleted"]:  # a stale entry is a miss with a reason, never bytes
            with pytest.raises(BlockNotFoundError):
                await tier.load(worker_key(i), memoryview(dst))
        await tier._persistence.walked()
        s = tier.statistics()
        assert s.catalog_complete and s.blocks == len(on_disk)
        for i in report["deleted"]:
            assert tier.lookup(worker_key(i)) is MISS
    assert not [p for p in root.iterdir() if p.name.startswith(".kvtier-fs-catalog-tmp")]
    assert (root / CHECKPOINT_NAME).exists()
