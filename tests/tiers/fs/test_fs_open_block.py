"""A block file is opened from the root in one ``openat2`` call, or by the walk without it.

Both ways must hold the same posture (``_layout``): the file opens when it is there, a missing
file or shard is ``FileNotFoundError`` (a miss), and a link anywhere below the root, or a file
where a shard folder should be, is refused (ELOOP) without touching what it points to. A kernel
that refuses ``openat2`` turns it off for the process and every open walks instead; the tier's
loads work the same either way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

import pytest

from kvtier import TierUnavailableError
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _layout as fs_layout
from kvtier.tiers.fs._beneath import Openat2
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 4096
key, data = key_and_data("o", BLOCK)
NAME = fs_layout.name_of(key(1))


class RefusingOpenat2(Openat2):
    """``openat2`` as a kernel before 5.6 (or a seccomp filter) answers it: ENOSYS."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def open(self, dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
        self.calls += 1
        ctypes.set_errno(errno.ENOSYS)
        return -1


@pytest.fixture(params=["openat2", "walk"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every open of a block file through ``openat2``, or through the walk."""
    openat2 = Openat2()
    if request.param == "openat2" and not openat2.on:
        pytest.skip("no openat2 on this platform")
    if request.param == "walk":
        openat2.off()
    monkeypatch.setattr(fs_layout, "_OPENAT2", openat2)
    return str(request.param)


def block(root: Path, content: bytes = b"block bytes") -> Path:
    path = fs_layout.path_of(root, NAME)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return path


def read(root: Path) -> bytes:
    fd = fs_layout.open_block(root, NAME, fs_layout.READ_FLAGS)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def assert_refused(root: Path) -> None:
    with pytest.raises(OSError) as refused:
        read(root)
    assert refused.value.errno == errno.ELOOP


def test_a_block_file_opens(tmp_path: Path, opener: str) -> None:
    block(tmp_path)
    assert read(tmp_path) == b"block bytes"


def test_a_missing_file_or_shard_is_not_found(tmp_path: Path, opener: str) -> None:
    with pytest.raises(FileNotFoundError):
        read(tmp_path)  # no shard folder
    block(tmp_path).unlink()
    with pytest.raises(FileNotFoundError):
        read(tmp_path)  # the shard is there, the file not


def test_a_linked_shard_folder_is_refused(tmp_path: Path, opener: str) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    shard = block(root).parent
    outside.mkdir()
    (outside / NAME).write_bytes(b"outside the cache")
    for f in shard.iterdir():
        f.unlink()
    shard.rmdir()
    os.symlink(outside, shard)
    assert_refused(root)


def test_a_linked_block_file_is_refused(tmp_path: Path, opener: str) -> None:
    path = block(tmp_path)
    target = tmp_path / "outside"
    target.write_bytes(b"outside the cache")
    path.unlink()
    os.symlink(target, path)
    assert_refused(tmp_path)


def test_a_file_where_a_shard_folder_should_be_is_refused(tmp_path: Path, opener: str) -> None:
    first = block(tmp_path).parent.parent
    shutil.rmtree(first)
    first.write_bytes(b"not a folder")
    assert_refused(tmp_path)


def test_a_kernel_that_refuses_openat2_turns_it_off_and_walks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = RefusingOpenat2()
    monkeypatch.setattr(fs_layout, "_OPENAT2", refusing)
    block(tmp_path)
    assert read(tmp_path) == b"block bytes"
    assert read(tmp_path) == b"block bytes"
    assert refusing.calls == 1  # asked once, then off for the process
    assert not refusing.on


async def test_the_tier_loads_and_refuses_links_either_way(tmp_path: Path, opener: str) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    async with FSTier(root) as tier:
        await tier.store(key(1), memoryview(data(1)))
        await tier.store(key(2), memoryview(data(2)))
        dst = memoryview(bytearray(BLOCK))
        await tier.load(key(1), dst)
        assert dst == data(1)
        shard = fs_layout.path_of(root, fs_layout.name_of(key(2))).parent
        outside.mkdir()
        for f in shard.iterdir():
            os.rename(f, outside / f.name)
        moved = sorted(p.name for p in outside.iterdir())
        shard.rmdir()
        os.symlink(outside, shard)
        with pytest.raises(TierUnavailableError, match="ELOOP"):
            await tier.load(key(2), memoryview(bytearray(BLOCK)))
        assert moved and sorted(p.name for p in outside.iterdir()) == moved  # none removed
