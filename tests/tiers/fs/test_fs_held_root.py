"""The root's held descriptor (``_held``): every file operation starts from it, and it never
serves a folder that was swapped under it for longer than its recheck bound.

The swaps are real: a folder renamed away and another renamed into its place, a folder
removed. The unit tests drive the bound with a clock of their own; the tier's tests show that
a failure a swap explains (a block not found) is looked for again in the folder the path names
now, and that what follows runs there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvtier import BlockNotFoundError
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._held import HeldRoot
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 64 << 10
key, data = key_and_data("held", BLOCK)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def folder_of(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def folder_at(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def swap(root: Path, other: Path) -> Path:
    """Rename ``root`` away and ``other`` into its place; where ``root`` went."""
    away = root.with_name(root.name + ".old")
    os.rename(root, away)
    os.rename(other, root)
    return away


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    root, other = tmp_path / "root", tmp_path / "other"
    root.mkdir()
    other.mkdir()
    return root, other


def test_the_descriptor_is_held_and_checked_at_the_bound(
    folders: tuple[Path, Path], clock: Clock
) -> None:
    root, other = folders
    held = HeldRoot(root, recheck_seconds=1.0, clock=clock)
    fd = held.fd()
    assert folder_of(fd) == folder_at(root)
    assert held.fd() == fd and held.fresh() == fd
    new = folder_at(other)
    away = swap(root, other)
    clock.now += 0.5  # within the bound: still the folder it holds
    assert held.fd() == fd and folder_of(fd) == folder_at(away)
    clock.now += 0.6  # past it: the path is looked at again
    assert held.fresh() == -1  # the loop never waits for that check
    swapped = held.fd()
    assert swapped != fd and folder_of(swapped) == new == folder_at(root)
    assert not closed(fd)  # a thread may still use the one it replaced
    held.close()
    assert closed(fd) and closed(swapped)


def test_a_failure_checks_at_once(folders: tuple[Path, Path], clock: Clock) -> None:
    root, other = folders
    held = HeldRoot(root, recheck_seconds=1.0, clock=clock)
    fd = held.fd()
    assert not held.moved(fd)  # the same folder: the failure stands
    assert held.fd() == fd
    swap(root, other)
    assert held.moved(fd)  # within the bound, but a failure looks now
    assert folder_of(held.fd()) == folder_at(root)
    # Another thread whose operation failed on the old folder too: it runs again as well.
    assert held.moved(fd) and not held.moved(held.fd())
    held.close()


def test_a_removed_root_is_not_served(folders: tuple[Path, Path], clock: Clock) -> None:
    root, _ = folders
    held = HeldRoot(root, recheck_seconds=1.0, clock=clock)
    fd = held.fd()
    root.rmdir()
    assert not held.moved(fd)  # nothing to move to: the failure stands
    clock.now += 2
    with pytest.raises(FileNotFoundError):
        held.fd()
    root.mkdir()  # made again: another folder at the path
    assert folder_of(held.fd()) == folder_at(root) != folder_of(fd)
    held.close()


def test_detach_leaves_descriptors_open_for_their_caller(
    folders: tuple[Path, Path], clock: Clock
) -> None:
    root, _ = folders
    held = HeldRoot(root, clock=clock)
    fd = held.fd()
    assert held.detach() == [fd]
    assert not closed(fd)
    os.close(fd)
    again = held.fd()  # opened again after a close
    assert folder_of(again) == folder_at(root)
    held.close()
    assert closed(again)


async def test_the_tier_reads_the_folder_swapped_in(tmp_path: Path) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    async with FSTier(other) as tier:  # the folder swapped in holds block 2 only
        await tier.store(key(2), memoryview(data(2)))
    async with FSTier(root, shared=True) as tier:
        await tier.store(key(1), memoryview(data(1)))
        dst = memoryview(bytearray(BLOCK))
        await tier.load(key(1), dst)  # the root's descriptor is held from here on
        away = swap(root, other)
        await tier.load(key(2), dst)  # not in the old folder: found in the new one
        assert dst == data(2)
        with pytest.raises(BlockNotFoundError):
            await tier.load(key(1), dst)  # only the old folder had it: never served
        await tier.store(key(3), memoryview(data(3)))
    assert (root / "kvtier-fs.json").exists()
    stored = {p.name for p in root.rglob("*") if p.is_file() and len(p.name) > 30}
    assert key(3).hex() in stored and key(1).hex() not in stored
    assert key(3).hex() not in {p.name for p in away.rglob("*")}


async def test_the_tier_writes_again_into_a_root_made_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with FSTier(root, shared=True) as tier:
        await tier.store(key(1), memoryview(data(1)))
        shutil.rmtree(root)  # removed and made again: the held folder is gone
        root.mkdir()
        await tier.store(key(2), memoryview(data(2)))  # no shard can be made there: again
        dst = memoryview(bytearray(BLOCK))
        await tier.load(key(2), dst)
        assert dst == data(2)
    assert any(p.name == key(2).hex() for p in root.rglob("*"))


def test_a_descriptor_opened_after_the_close_goes_to_its_closer(
    folders: tuple[Path, Path], clock: Clock
) -> None:
    """A thread abandoned at its deadline and still running at the tier's close may open the
    root again: that descriptor is closed with the rest once the thread is out, unless the
    tier opened again meanwhile (then it is the tier's)."""
    root, _ = folders
    held = HeldRoot(root, clock=clock)
    first = held.fd()
    assert held.shut() == [first]
    os.close(first)
    late = held.fd()  # the abandoned thread, after the close
    assert held.detach_if_shut() == [late]
    os.close(late)
    assert held.detach_if_shut() == []
    held.reopened()
    own = held.fd()
    assert held.detach_if_shut() == []  # the reopened tier's: left open
    assert not closed(own)
    held.close()
    assert closed(own)
