"""FSTier with ``shared=False``: a folder only this process writes answers from its index.

No stat on the request path: a key the index does not hold is a MISS
(``not_found``) at once, never RETRY. Real files; the stat seam counts calls to prove none run.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvtier import HostPool, InvalidArgumentError, LookupResult, MissReason, OffloadScheduler
from kvtier.manager import TieringManager
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _blocks as _fs_blocks
from kvtier.tiers.fs import _exists as _fs_exists
from kvtier.tiers.fs import _tier as _fs_tier
from kvtier.tiers.fs._layout import name_of, path_of
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 4096


key, data = key_and_data("x", BLOCK)


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []

    def counted(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        calls.append(path)
        return os.stat(path, *args, **kwargs)

    monkeypatch.setattr(_fs_exists, "_stat", counted)
    return calls


def test_shared_must_be_auto_or_a_bool(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match='shared must be "auto"'):
        FSTier(tmp_path, shared="no")  # type: ignore[arg-type]


async def test_answers_from_the_index_without_a_stat(tmp_path: Path, stats: list[Any]) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        assert tier.lookup(key(1)) is LookupResult.MISS  # unknown: a miss at once
        await tier.store(key(1), memoryview(data(1)))
        assert tier.lookup(key(1)) is LookupResult.HIT
        await tier.delete(key(1))
        assert tier.lookup(key(1)) is LookupResult.MISS
        await tier.store(key(2), memoryview(data(2)))
    async with FSTier(root, shared=False) as tier:  # the index is read back, then checked
        await tier._persistence.walked()
        assert tier.lookup(key(2)) is LookupResult.HIT
        assert tier.lookup(key(3)) is LookupResult.MISS
        s = tier.statistics().lookups
        assert (s.hits, s.misses, s.retries) == (1, 1, 0)
        assert s.misses_by_reason == {"not_found": 1}
    assert stats == []
    closed = FSTier(root, shared=False)
    assert closed.lookup(key(2)) is LookupResult.MISS  # not open: nothing is known
    assert closed.statistics().lookups.misses_by_reason == {"unavailable": 1}


async def test_a_failed_load_is_remembered(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c", shared=False, miss_ttl=60) as tier:
        await tier.store(key(1), memoryview(data(1)))
        tier.record_miss(key(1), MissReason.TIMEOUT)
        assert tier.lookup(key(1)) is LookupResult.MISS
        assert tier.statistics().lookups.misses_by_reason == {"timeout": 1}
        await tier.store(key(1), memoryview(data(1)))  # a store that lands clears it
        assert tier.lookup(key(1)) is LookupResult.HIT


async def test_scheduler_never_waits_on_unknown_keys(tmp_path: Path, stats: list[Any]) -> None:
    root = tmp_path / "c"
    async with FSTier(root, shared=False) as tier:
        for i in range(4):
            await tier.store(key(i), memoryview(data(i)))
    pool = HostPool(16, BLOCK)
    fs = FSTier(root, shared=False)
    async with TieringManager(pool, [fs]) as manager:
        await fs._persistence.walked()  # until then a key the catalog lacks is checked
        scheduler = OffloadScheduler(manager)
        keys = [key(i) for i in range(8)]
        # Key 4 is a miss at once, so only the promotions of the four held keys defer.
        assert await scheduler.lookup(keys, timeout=30) == 4
        assert manager.statistics().lookups.retry <= 4
        assert manager.statistics().tiers[0].lookups.retries == 0
    assert stats == []


async def test_a_store_that_lands_while_the_folder_is_read_again_stays_a_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root that became unusable is read again by the next store; stores that land while
    that read runs (it listed their shard before their file was there) stay in the index."""
    async with FSTier(tmp_path / "c", shared=False) as tier:
        await tier.store(key(1), memoryview(data(1)))
        keeper = tier._keeper
        real = keeper.prepare
        listed, resume = threading.Event(), threading.Event()

        def slow_prepare(*args: Any) -> Any:
            ready = real(*args)  # the folder is listed now: key 2 is not in it
            listed.set()
            resume.wait(30)
            return ready

        monkeypatch.setattr(keeper, "prepare", slow_prepare)
        tier._catalog.ready = False  # as after a check found the root unusable
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.store, key(3), memoryview(data(3)))  # reads the folder again
            await anyio.to_thread.run_sync(listed.wait, 30)
            monkeypatch.setattr(keeper, "prepare", real)
            tier._catalog.ready = True  # let key 2's store go ahead while the read is held
            await tier.store(key(2), memoryview(data(2)))
            tier._catalog.ready = False
            resume.set()
        for i in (1, 2, 3):
            assert tier.lookup(key(i)) is LookupResult.HIT, i


@pytest.mark.parametrize("first", ["delete", "store"])
async def test_a_store_and_a_delete_of_one_key_run_one_after_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """A store and a delete of one key, the first held in its worker thread when the second
    comes: the second waits for it, so the outcome is the later one's, and the owner's index
    agrees with the folder (run together, a delete's removal could take the block a store had
    just acknowledged, or its drop forget a file that is there: a miss until the next open)."""
    root = tmp_path / "c"
    entered, release = threading.Event(), threading.Event()
    real_remove = _fs_tier.remove_block  # type: ignore[attr-defined]  # the seam delete calls
    real_write = _fs_blocks.write_from_slot

    def held_remove(*args: Any) -> bool:
        entered.set()
        release.wait(30)
        return real_remove(*args)

    def held_write(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(30)
        return real_write(*args, **kwargs)

    async with FSTier(root, shared=False) as tier:
        await tier.store(key(1), memoryview(data(1)))
        if first == "delete":
            monkeypatch.setattr(_fs_tier, "remove_block", held_remove)
        else:
            monkeypatch.setattr(_fs_blocks, "write_from_slot", held_write)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one_op, tier, first)
                await anyio.to_thread.run_sync(entered.wait, 30)
                second_done = anyio.Event()

                async def second() -> None:
                    await one_op(tier, "store" if first == "delete" else "delete")
                    second_done.set()

                tg.start_soon(second)
                await anyio.wait_all_tasks_blocked()
                assert not second_done.is_set()  # it waits for the first
                monkeypatch.undo()
                release.set()
        on_disk = fs_path(root, key(1)).exists()
        if first == "delete":  # then the store: the block is there, and a hit
            assert on_disk and tier.lookup(key(1)) is LookupResult.HIT
            dst = bytearray(BLOCK)
            await tier.load(key(1), memoryview(dst))
            assert bytes(dst) == data(1)
        else:  # then the delete: gone from both
            assert not on_disk and tier.lookup(key(1)) is LookupResult.MISS


def fs_path(root: Path, k: bytes) -> Path:
    return path_of(root, name_of(k))


async def one_op(tier: FSTier, op: str) -> None:
    if op == "delete":
        await tier.delete(key(1))
    else:
        await tier.store(key(1), memoryview(data(1)))
