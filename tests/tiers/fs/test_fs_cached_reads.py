"""FSTier reads a block whose file the page cache holds on the event loop (``_cached``).

What these pin: such a block is served with no worker thread (the tests break the thread's
read, so only the loop's can serve it), and everything else still goes to a worker thread: a
file the cache does not hold, a version 1 file, blocks past ``loop_read_bytes``, a file that
does not verify (the thread's read reports it and removes it), a block reached through a link,
and a batch larger than ``loop_read_bytes`` (all of it goes to a thread).
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import drop_cache
from kvtier import CorruptBlockError, FSConfig, InvalidArgumentError, TierError
from kvtier.testing import CHECKS
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _cached as fs_cached
from kvtier.tiers.fs import _read as fs_read
from kvtier.tiers.fs._beneath import AT_FDCWD
from tests.support import block_file, fresh_keys

LARGE = 256 << 10  # a whole number of pages: a version 2 file
SMALL = 4000  # not one: a version 1 file


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def slot(n: int) -> memoryview:
    """A page-aligned buffer, as a host pool's slot is."""
    return memoryview(mmap.mmap(-1, n))


@pytest.fixture
def reads_cache(tmp_path: Path) -> None:
    """Skip where the kernel cannot serve a read from the caches alone."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        fs_read.all_cached(fd, 4096)
    finally:
        os.close(fd)
    if not fs_read.knows_cache():
        pytest.skip("this kernel cannot tell what the page cache holds (cachestat: Linux 6.5)")
    reads = fs_cached.CachedReads(str(tmp_path), 4096, None)
    fd = reads._open(AT_FDCWD, os.fsencode(probe), os.O_RDONLY, 0)
    if fd >= 0:
        os.close(fd)
    if not reads.on:
        pytest.skip("this kernel has no openat2 with RESOLVE_CACHED (Linux 5.12)")


@pytest.fixture
def no_thread_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read a worker thread makes fails: what loads is what the loop read."""

    def failing(fd: int, views: list[memoryview], offset: int, *flags: int) -> int:
        raise OSError(5, "the worker thread's read is broken in this test")

    monkeypatch.setattr(fs_read, "_preadv", failing)


def in_a_thread(outcomes: Sequence[BaseException | None]) -> bool:
    """Whether every block of a load went to a worker thread (whose read fails here)."""
    return all(isinstance(o, TierError) and "broken in this test" in str(o) for o in outcomes)


async def stored(tier: FSTier, root: Path, n: int, size: int, *, cached: bool) -> list[bytes]:
    """``n`` blocks of ``size`` bytes stored under fresh keys, their files in the page cache
    or not; the keys."""
    keys = fresh_keys(n)
    for i, key in enumerate(keys):
        await tier.store(key, memoryview(payload(size, i)))
        path = block_file(root, key)
        drop_cache([path])
        if cached:
            path.read_bytes()
    return keys


async def test_a_page_cached_block_is_read_on_the_loop(
    tmp_path: Path, no_thread_reads: None, reads_cache: None
) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        keys = await stored(tier, root, 2, LARGE, cached=True)
        pinned, lent = slot(LARGE), slot(LARGE)
        assert await tier.load_many(keys[:1], [pinned], pinned=True) == [None]
        assert await tier.load_many(keys[1:], [lent]) == [None]  # not pinned: the same
        assert bytes(pinned) == payload(LARGE, 0) and bytes(lent) == payload(LARGE, 1)
        stats = tier.statistics()
        assert stats.loads == 2 and stats.loads_on_loop == 2


async def test_blocks_the_cache_does_not_hold_go_to_a_worker_thread(
    tmp_path: Path, no_thread_reads: None
) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        (cold,) = await stored(tier, root, 1, LARGE, cached=False)
        (old,) = await stored(tier, root, 1, SMALL, cached=True)  # version 1: never on the loop
        assert in_a_thread(await tier.load_many([cold], [slot(LARGE)], pinned=True))
        small = memoryview(bytearray(SMALL))
        assert in_a_thread(await tier.load_many([old], [small], pinned=True))


async def test_a_load_is_read_on_the_loop_whole_within_loop_read_bytes_or_not_at_all(
    tmp_path: Path, no_thread_reads: None, reads_cache: None
) -> None:
    """A batch that needs a thread anyway is no sooner done for blocks read on the loop."""
    root = tmp_path / "c"
    async with FSTier(root, loop_read_bytes=2 * LARGE) as tier:
        keys = await stored(tier, root, 3, LARGE, cached=True)
        two = await tier.load_many(keys[:2], [slot(LARGE) for _ in keys[:2]], pinned=True)
        assert two == [None, None]
        assert in_a_thread(await tier.load_many(keys, [slot(LARGE) for _ in keys], pinned=True))
        assert tier.statistics().loads_on_loop == 2
    async with FSTier(root, loop_read_bytes=0) as tier:
        assert in_a_thread(await tier.load_many(keys[:1], [slot(LARGE)], pinned=True))


async def test_a_load_the_cache_does_not_hold_asks_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads_cache: None
) -> None:
    """Each block tried on the loop costs it a few calls: a batch from the device stops
    trying at its first block, and one larger than the budget is not tried at all."""
    asked: list[int] = []
    real = fs_read.all_cached

    def counting(fd: int, size: int) -> bool:
        asked.append(size)
        return real(fd, size)

    monkeypatch.setattr(fs_cached, "all_cached", counting)
    root = tmp_path / "c"
    async with FSTier(root, loop_read_bytes=2 * LARGE) as tier:
        keys = await stored(tier, root, 3, LARGE, cached=False)
        assert await tier.load_many(keys[:2], [slot(LARGE), slot(LARGE)], pinned=True) == [None] * 2
        assert len(asked) == 1
        assert await tier.load_many(keys, [slot(LARGE) for _ in keys], pinned=True) == [None] * 3
        assert len(asked) == 1
        assert tier.statistics().loads_on_loop == 0  # all five read in a worker thread


async def test_a_cached_file_that_does_not_verify_is_reported_by_the_thread_read(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        (key,) = await stored(tier, root, 1, LARGE, cached=True)
        path = block_file(root, key)
        end = path.stat().st_size - 1
        with path.open("r+b") as f:  # through the page cache: the file stays cached
            f.seek(end)
            last = f.read(1)[0]
            f.seek(end)
            f.write(bytes([last ^ 0xFF]))
        (outcome,) = await tier.load_many([key], [slot(LARGE)], pinned=True)
        assert isinstance(outcome, CorruptBlockError)
        assert not path.exists()
        assert tier.statistics().failures_by_reason == {"corrupt": 1}


async def test_a_linked_shard_folder_is_not_read_through_on_the_loop(
    tmp_path: Path, no_thread_reads: None
) -> None:
    root, outside = tmp_path / "c", tmp_path / "outside"
    async with FSTier(root) as tier:
        (key,) = await stored(tier, root, 1, LARGE, cached=True)
        shard = block_file(root, key).parent
        shard.rename(outside)  # the same, valid file, now outside the root
        os.symlink(outside, shard)
        (outside / block_file(root, key).name).read_bytes()  # and in the page cache
        dst = slot(LARGE)
        (outcome,) = await tier.load_many([key], [dst], pinned=True)
        assert isinstance(outcome, TierError) and bytes(dst) != payload(LARGE, 0)


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A folder on tmpfs (``/dev/shm``), removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    root = shm / f"kvtier-test-{os.getpid()}-{os.urandom(4).hex()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_a_tmpfs_folder_is_read_on_the_loop(
    shm_root: Path, no_thread_reads: None, reads_cache: None
) -> None:
    """tmpfs refuses reads that must not wait (RWF_NOWAIT); its pages are in memory."""
    async with FSTier(shm_root) as tier:
        keys = fresh_keys(1)
        await tier.store(keys[0], memoryview(payload(LARGE, 3)))
        dst = slot(LARGE)
        assert await tier.load_many(keys, [dst], pinned=True) == [None]
        assert bytes(dst) == payload(LARGE, 3)


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_conformance_with_page_cached_loads(
    check: str, tmp_path: Path, reads_cache: None
) -> None:
    """The conformance kit on a tier whose files stay in the page cache (written through it),
    with blocks of a version 2 file: its batch loads are read on the loop."""
    await CHECKS[check](lambda: FSTier(tmp_path / "c", direct_io=False), 64 << 10)


def test_loop_read_bytes_takes_a_size_and_refuses_a_negative() -> None:
    assert FSConfig(root="x", loop_read_bytes="2MiB").loop_read_bytes == 2 << 20  # type: ignore[arg-type]
    assert FSConfig(root="x", loop_read_bytes=0).loop_read_bytes == 0
    with pytest.raises(InvalidArgumentError, match="loop_read_bytes"):
        FSConfig(root="x", loop_read_bytes=-1)
