"""FSTier: conformance, layout, crash safety, corruption, capacity, faults, sharing.

Real files throughout. Disk-full and read-only faults use a real small tmpfs where this
machine lets root mount one; otherwise ENOSPC is injected at ``_fs_write``'s single write call.
A guard fixture fails any test in which a file-system call runs on the event loop thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.streams.buffered
import numpy as np
import pytest

from kvtier import (
    BlockNotFoundError,
    CorruptBlockError,
    HostPool,
    InvalidArgumentError,
    LookupResult,
    OffloadScheduler,
    TierNoSpaceError,
    TierUnavailableError,
    UnusableRootError,
)
from kvtier.common._format import header_size
from kvtier.manager import TieringManager
from kvtier.testing import CHECKS, resolve_lookup
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _blocks as _fs_block
from kvtier.tiers.fs import _layout as _fs_layout
from kvtier.tiers.fs import _read as _fs_read
from kvtier.tiers.fs import _write as _fs_write
from tests.support import BlockingCallError, block_files, tmp_files
from tests.tiers.fs.fs_worker import key_of, payload_of

WORKER = str(Path(__file__).parent / "fs_worker.py")
BLOCK = 4096
FILE = header_size(16) + BLOCK

# -- a guard against blocking calls on the event loop ------------------------------------------


async def test_guard_catches_a_blocking_call(no_blocking: list[str], tmp_path: Path) -> None:
    with pytest.raises(BlockingCallError):
        os.stat(tmp_path)
    assert no_blocking == ["os.stat"]
    no_blocking.clear()
    await anyio.to_thread.run_sync(os.stat, tmp_path)  # off the loop: allowed


# -- helpers --------------------------------------------------------------------------------------


def data(i: int, n: int = BLOCK, ns: str = "t") -> bytes:
    return payload_of(ns, i, n)


def key(i: int, ns: str = "t") -> bytes:
    return key_of(ns, i)


async def load(tier: FSTier, k: bytes, n: int = BLOCK) -> bytes:
    dst = bytearray(n)
    await tier.load(k, memoryview(dst))
    return bytes(dst)


# -- conformance ----------------------------------------------------------------------------------


async def test_conformance_with_capacity(tmp_path: Path, no_blocking: list[str]) -> None:
    for check in CHECKS.values():
        await check(lambda: FSTier(tmp_path / "cache", capacity_bytes=64 * FILE), BLOCK)


# -- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"root": ""}, "root must be a folder path"),
        ({"root": 3}, "root must be a folder path"),
        ({"root": b"/tmp/x"}, "root must be a folder path"),
        ({"name": ""}, "name must be a non-empty str"),
        ({"capacity_bytes": 0}, "capacity_bytes must be a positive int"),
        ({"capacity_bytes": 1.5}, "capacity_bytes must be a positive int"),
        ({"capacity_bytes": True}, "capacity_bytes must be a positive int"),
        ({"fsync": "sometimes"}, "fsync must be one of ('never', 'data', 'always')"),
        ({"miss_ttl": 0}, "miss_ttl must be a positive number"),
        ({"lookup_batch_size": 0}, "lookup_batch_size must be a positive int"),
        ({"lookup_timeout": -1}, "lookup_timeout must be a positive number"),
        ({"max_concurrency": 0}, "max_concurrency must be a positive int"),
    ],
)
def test_bad_arguments_say_what_to_fix(kwargs: dict[str, Any], words: str) -> None:
    kwargs.setdefault("root", "/tmp/kvtier-never-created")
    with pytest.raises(InvalidArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        FSTier(**kwargs)


async def test_bad_keys_and_buffers(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c") as tier:
        with pytest.raises(InvalidArgumentError, match="key must be bytes"):
            await tier.store("abc", memoryview(data(0)))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="1 to 255 bytes"):
            await tier.store(b"", memoryview(data(0)))
        await tier.store(key(0), memoryview(data(0)))
        with pytest.raises(InvalidArgumentError, match="writable"):
            await tier.load(key(0), memoryview(bytes(BLOCK)))
        with pytest.raises(InvalidArgumentError, match="memoryview"):
            await tier.load(key(0), bytearray(BLOCK))  # type: ignore[arg-type]


# -- layout ----------------------------------------------------------------------------------------


async def test_layout_marker_and_permissions(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        await tier.store(key(0), memoryview(data(0)))
    hexkey = key(0).hex()
    path = root / hexkey[-4:-2] / hexkey[-2:] / hexkey
    assert block_files(root) == [path]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (root, path.parent, path.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    marker = json.loads((root / "kvtier-fs.json").read_text())
    assert marker == {"format": "kvtier-fs", "layout": 1, "block_format": 2}
    raw = path.read_bytes()
    assert raw[:4] == b"KVTB"
    assert raw[-BLOCK:] == data(0)


async def test_keys_never_name_paths_outside_root(tmp_path: Path) -> None:
    root = tmp_path / "c"
    nasty = [b"../../etc/passwd", b"/abs", b"\x00", b"a" * 255]
    async with FSTier(root) as tier:
        for i, k in enumerate(nasty):
            await tier.store(k, memoryview(data(i)))
            assert await load(tier, k) == data(i)
    files = block_files(root)
    assert len(files) == len(nasty)
    for f in files:
        assert f.resolve().is_relative_to(root.resolve())
        assert len(f.name) <= 255


async def test_refuses_incompatible_format(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "kvtier-fs.json").write_text(
        json.dumps({"format": "kvtier-fs", "layout": 2, "block_format": 1})
    )
    tier = FSTier(root)
    with pytest.raises(InvalidArgumentError, match=r"another format.*another folder"):
        await tier.open()
    await tier.aclose()


async def test_refuses_a_foreign_nonempty_folder(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="not a kvtier folder"):
        async with FSTier(tmp_path):
            pass
    assert (tmp_path / "precious.txt").read_text() == "mine"
    assert not (tmp_path / "kvtier-fs.json").exists()


# -- restart, lookups ---------------------------------------------------------------------------


async def test_restart_serves_every_block(tmp_path: Path, no_blocking: list[str]) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        for i in range(20):
            await tier.store(key(i), memoryview(data(i)))
    async with FSTier(root) as again:
        s = again.statistics()
        assert (s.blocks, s.bytes_stored) == (20, 20 * FILE)
        for i in range(20):
            assert await resolve_lookup(again, key(i)) is LookupResult.HIT
            assert await load(again, key(i)) == data(i)


async def test_lookup_retries_then_caches_and_misses_expire(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root, miss_ttl=0.05) as writer, FSTier(root, miss_ttl=0.05) as reader:
        assert reader.lookup(key(0)) is LookupResult.RETRY
        assert await resolve_lookup(reader, key(0)) is LookupResult.MISS
        await writer.store(key(0), memoryview(data(0)))  # another "process" writes it
        assert reader.lookup(key(0)) is LookupResult.MISS  # cached miss, for a short while
        await anyio.sleep(0.1)  # let the miss expire: the TTL is the thing under test
        assert await resolve_lookup(reader, key(0)) is LookupResult.HIT
        assert reader.statistics().blocks == 1  # learnt about it from the existence check


class HeldWrites:
    """Holds every block write of the tier in its worker thread (wrapping ``_fs_block``'s
    ``write_from_slot``, which ``store`` and ``store_many`` both call) until released; ``fail``
    makes the released writes fail as an I/O error would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held = threading.Event()
        self.released = threading.Event()
        self.fail = False
        write_block = _fs_block.write_from_slot

        def held(*args: Any, **kwargs: Any) -> tuple[_fs_write.WriteOutcome, int]:
            self.held.set()
            self.released.wait(30)
            if self.fail:
                raise OSError(errno.EIO, "injected")
            return write_block(*args, **kwargs)

        monkeypatch.setattr(_fs_block, "write_from_slot", held)

    async def wait_held(self) -> None:
        assert await anyio.to_thread.run_sync(self.held.wait, 10)


@pytest.mark.parametrize("batch", [False, True], ids=["store", "store_many"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "exclusive"])
async def test_a_key_being_written_answers_retry_until_its_write_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool, batch: bool
) -> None:
    """A block whose file is still being written is not a miss: a slower tier's deferred
    write that copies it from here waits for it (woken when the write ends) instead of
    giving the block up. In a shared folder this holds even after a check found no file."""
    writes = HeldWrites(monkeypatch)
    heard: list[bytes] = []
    async with FSTier(tmp_path / "c", shared=shared) as tier:
        if shared:  # a check before the store: "no such file", remembered for miss_ttl
            assert await resolve_lookup(tier, key(0)) is LookupResult.MISS
        tier.add_listener(heard.append)
        try:
            async with anyio.create_task_group() as tg:
                if batch:
                    tg.start_soon(tier.store_many, [key(0)], [memoryview(data(0))])
                else:
                    tg.start_soon(tier.store, key(0), memoryview(data(0)))
                await writes.wait_held()
                assert tier.lookup(key(0)) is LookupResult.RETRY
                assert tier.lookup(key(1)) is not LookupResult.HIT  # only the key written
                assert key(0) not in heard
                writes.released.set()
        finally:
            writes.released.set()
        assert key(0) in heard  # the write ended: whoever waits asks again
        assert tier.lookup(key(0)) is LookupResult.HIT
        assert tier.statistics().lookups.retries >= 1


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "exclusive"])
async def test_a_failed_write_ends_the_retry_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    writes = HeldWrites(monkeypatch)
    writes.fail = True
    heard: list[bytes] = []
    async with FSTier(tmp_path / "c", shared=shared) as tier:
        tier.add_listener(heard.append)

        async def store() -> None:
            with pytest.raises(TierUnavailableError):
                await tier.store(key(0), memoryview(data(0)))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(store)
                await writes.wait_held()
                assert tier.lookup(key(0)) is LookupResult.RETRY
                writes.released.set()
        finally:
            writes.released.set()
        assert key(0) in heard
        assert await resolve_lookup(tier, key(0)) is LookupResult.MISS


# -- corruption ---------------------------------------------------------------------------------


def _flip_payload_byte(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 0x01
    p.write_bytes(raw)


def _truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size - 1)


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(FILE))


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _flip_header_byte(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0x40
    p.write_bytes(raw)


def _append(p: Path) -> None:
    with p.open("ab") as f:
        f.write(b"x")


@pytest.mark.parametrize(
    "damage",
    [_flip_payload_byte, _truncate, _garbage, _empty, _flip_header_byte, _append],
    ids=lambda f: f.__name__.strip("_"),
)
async def test_corrupt_file_is_a_miss_and_removed(
    damage: Callable[[Path], None], tmp_path: Path
) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        await tier.store(key(0), memoryview(data(0)))
        await tier.store(key(1), memoryview(data(1)))
        assert await resolve_lookup(tier, key(0)) is LookupResult.HIT
        (path,) = [p for p in block_files(root) if p.name == key(0).hex()]
        damage(path)
        with pytest.raises(CorruptBlockError):
            await load(tier, key(0))
        assert not path.exists()
        assert tier.lookup(key(0)) is LookupResult.MISS
        s = tier.statistics()
        assert s.failures_by_reason == {"corrupt": 1}
        assert s.lookups.misses_by_reason.get("corrupt") == 1
        assert s.blocks == 1
        assert await load(tier, key(1)) == data(1)  # the neighbour is untouched
        await tier.store(key(0), memoryview(data(0)))  # and the key can be stored again
        assert await load(tier, key(0)) == data(0)


async def test_a_block_swapped_under_another_key_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        await tier.store(key(0), memoryview(data(0)))
        await tier.store(key(1), memoryview(data(1)))
        files = {p.name: p for p in block_files(root)}
        files[key(0).hex()].replace(files[key(1).hex()])  # key 1's path now holds key 0
        with pytest.raises(CorruptBlockError, match="another key"):
            await load(tier, key(1))


async def test_wrong_destination_size_keeps_the_block(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c") as tier:
        await tier.store(key(0), memoryview(data(0)))
        with pytest.raises(InvalidArgumentError, match=f"is {BLOCK} bytes"):
            await load(tier, key(0), BLOCK - 1)
        assert await load(tier, key(0)) == data(0)


# -- crashes -----------------------------------------------------------------------------------


async def test_kill_9_mid_stores_never_serves_a_torn_block(tmp_path: Path) -> None:
    root, block = tmp_path / "c", 256 << 10
    last = -1
    async with await anyio.open_process(
        [sys.executable, WORKER, "store", str(root), "k9", str(block), "never"],
        stdout=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None
        lines = anyio.streams.buffered.BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(60):
            while last < 40:
                last = int((await lines.receive_until(b"\n", 100)).split()[1])
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
    async with FSTier(root) as tier:
        assert tmp_files(root) == []  # the dead writer's temporary file is gone
        found = 0
        for i in range(last + 64):
            k, dst = key_of("k9", i), bytearray(block)
            try:
                await tier.load(k, memoryview(dst))
            except BlockNotFoundError:
                assert i > last, f"block {i} was stored before the kill but is missing"
                continue
            assert dst == payload_of("k9", i, block)
            found += 1
        assert found >= last + 1
        assert tier.statistics().failures_by_reason.get("corrupt") is None


async def test_open_removes_only_dead_writers_temporary_files(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        await tier.store(key(0), memoryview(data(0)))
    shard = block_files(root)[0].parent
    dead = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
    dead_pid = int(dead.stdout)
    mine = shard / f".tmp-{_fs_layout.HOST_TAG}-{dead_pid}-0000-{key(5).hex()}"
    remote_fresh = shard / f".tmp-ffffffff-{os.getpid()}-0000-{key(6).hex()}"
    remote_old = shard / f".tmp-ffffffff-{os.getpid()}-0001-{key(7).hex()}"
    for p in (mine, remote_fresh, remote_old):
        p.write_bytes(b"half a block")
    old = time.time() - 2 * _fs_layout.STALE_TMP_SECONDS
    os.utime(remote_old, (old, old))
    async with FSTier(root) as tier:
        assert await load(tier, key(0)) == data(0)
        await tier._persistence.walked()  # opened from its catalog: the walk follows
    assert tmp_files(root) == [remote_fresh]  # another host may still be writing it


# -- capacity -----------------------------------------------------------------------------------


async def test_capacity_evicts_least_recently_used(tmp_path: Path, no_blocking: list[str]) -> None:
    async with FSTier(tmp_path / "c", capacity_bytes=3 * FILE) as tier:
        for i in range(3):
            await tier.store(key(i), memoryview(data(i)))
        await load(tier, key(0))  # 0 is now the most recently used; 1 the least
        await tier.store(key(0), memoryview(data(0)))  # a present key needs no room
        assert tier.statistics().evictions == 0
        await tier.store(key(3), memoryview(data(3)))
        assert await tier.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
        assert tier.lookup(key(1)) is LookupResult.MISS
        assert tier.statistics().lookups.misses_by_reason == {"evicted": 1}
        await tier.store(key(4), memoryview(data(4)))
        assert await tier.contains_many([key(i) for i in range(5)]) == [
            True,
            False,
            False,
            True,
            True,
        ]
        s = tier.statistics()
        assert (s.evictions, s.blocks, s.bytes_stored) == (2, 3, 3 * FILE)


async def test_demoted_blocks_are_evicted_first_tail_first(tmp_path: Path) -> None:
    """A prefix demoted (a session that ended) leaves before blocks used less recently,
    its tail first; keys the tier does not hold are left alone."""
    async with FSTier(tmp_path / "c", capacity_bytes=4 * FILE) as tier:
        for i in range(4):
            await tier.store(key(i), memoryview(data(i)))
        await load(tier, key(1))
        await load(tier, key(2))  # the order, oldest first: 0, 3, 1, 2
        assert tier.demote([key(1), key(2), key(9)]) == 2  # the prefix 1, 2; 9 is not held
        await tier.store(key(4), memoryview(data(4)))
        assert await tier.contains_many([key(i) for i in range(5)]) == [
            True,
            True,
            False,  # the demoted tail went first
            True,
            True,
        ]
        await tier.store(key(5), memoryview(data(5)))
        assert await tier.contains_many([key(1), key(0), key(3)]) == [False, True, True]
        assert tier.statistics().evictions == 2


async def test_usage_is_rebuilt_on_open_oldest_first(tmp_path: Path) -> None:
    """Without the catalog it kept (removed here), a tier rebuilds the LRU order from the
    files' times."""
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        for i in range(4):
            await tier.store(key(i), memoryview(data(i)))
    for kept in root.glob(".kvtier-fs-catalog*"):
        kept.unlink()
    for age, i in enumerate([2, 0, 3, 1]):  # make 1 the oldest, then 3, 0, 2
        then = time.time() - 1000 * (age + 1)
        os.utime(next(p for p in block_files(root) if p.name == key(i).hex()), (then, then))
    async with FSTier(root, capacity_bytes=4 * FILE) as tier:
        assert tier.statistics().bytes_stored == 4 * FILE
        await tier.store(key(9), memoryview(data(9)))
        await tier.store(key(8), memoryview(data(8)))
        assert await tier.contains_many([key(i) for i in (0, 1, 2, 3)]) == [
            True,
            False,
            True,
            False,
        ]
        assert len(block_files(root)) == 4


async def test_block_larger_than_capacity(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c", capacity_bytes=BLOCK) as tier:
        with pytest.raises(TierNoSpaceError, match="larger than capacity_bytes"):
            await tier.store(key(0), memoryview(data(0)))
        assert tier.statistics().failures_by_reason == {"no_space": 1}
        assert block_files(tier.root) == []


# -- faults ------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[bool]:
    """Mount a tmpfs of ``size`` at ``where``; yields False when this machine cannot."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    try:
        yield mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("batch", [False, True], ids=["store", "store_many"])
async def test_a_full_disk_evicts_the_oldest_blocks_to_make_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, batch: bool
) -> None:
    block = 64 << 10
    with small_tmpfs(tmp_path / "small", "1m") as real:
        root = tmp_path / "small" / "c"
        if not real:  # a disk with room for 8 blocks: ENOSPC at the one write call past that
            writev = _fs_write._writev

            def full(fd: int, bufs: Any) -> int:
                if len(block_files(root)) >= 8:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return writev(fd, bufs)

            monkeypatch.setattr(_fs_write, "_writev", full)
        async with FSTier(root) as tier:  # no capacity_bytes: the disk is the limit
            if batch:
                await tier.store_many(
                    [key(i) for i in range(10)], [memoryview(data(i, block)) for i in range(10)]
                )
                got = await tier.store_many(
                    [key(i) for i in range(10, 40)],
                    [memoryview(data(i, block)) for i in range(10, 40)],
                )
                assert got == [None] * 30
            else:
                for i in range(40):
                    await tier.store(key(i), memoryview(data(i, block)))
            s = tier.statistics()
            assert s.failures_by_reason == {}
            assert 3 <= s.blocks < 40 and s.evictions == 40 - s.blocks
            assert f"disk_full_evictions={s.evictions}" in repr(tier)  # counted as such
            assert tmp_files(root) == []
            kept = sorted(p.name for p in block_files(root))
            assert len(kept) == s.blocks and key(0).hex() not in kept  # the oldest went
            if not batch:  # one by one, exactly the oldest
                assert kept == sorted(key(i).hex() for i in range(40 - s.blocks, 40))
            for i in range(40):
                if key(i).hex() in kept:
                    assert await load(tier, key(i), block) == data(i, block)
            with pytest.raises(BlockNotFoundError):
                await load(tier, key(0), block)
    assert caplog.text.count("is full: evicted") == 1  # said once, not per store


async def test_a_full_disk_with_nothing_to_evict_fails_the_store_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = 64 << 10
    with small_tmpfs(tmp_path / "small", "1m") as real:
        root = tmp_path / "small" / "c"
        async with FSTier(root) as tier:
            filler = tmp_path / "small" / "filler"
            if real:  # another program fills the disk
                with contextlib.suppress(OSError), filler.open("wb") as f:
                    while True:
                        f.write(bytes(block))
            else:

                def full(fd: int, bufs: Any) -> int:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                monkeypatch.setattr(_fs_write, "_writev", full)
            with pytest.raises(TierNoSpaceError, match="ENOSPC"):
                await tier.store(key(0), memoryview(data(0, block)))
            assert tier.statistics().failures_by_reason == {"no_space": 1}
            assert await resolve_lookup(tier, key(0)) is LookupResult.MISS
            assert _shard_folders(root) == []  # nothing half-made left
            filler.unlink(missing_ok=True)
            monkeypatch.undo()
            await tier.store(key(0), memoryview(data(0, block)))  # room again: stores work
            assert await load(tier, key(0), block) == data(0, block)


def _eio(*args: Any) -> NoReturn:
    """A disk's I/O error, for a test to put in place of a read or write call."""
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _shard_folders(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob("??*") if p.is_dir())


async def test_a_failed_store_leaves_no_empty_shard_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FSTier(tmp_path / "c") as tier:
        await tier.store(key(0), memoryview(data(0)))
        kept = _shard_folders(tier.root)
        monkeypatch.setattr(_fs_write, "_writev", _eio)
        for i in range(1, 5):
            with pytest.raises(TierUnavailableError, match="EIO"):
                await tier.store(key(i), memoryview(data(i)))
        assert _shard_folders(tier.root) == kept  # those the good block needs, no more
        assert tmp_files(tier.root) == []


async def test_a_failed_store_removing_its_shard_never_fails_a_store_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that fails removes the shard folder it made, which another store may have
    just opened to write in: that one makes the folder again and lands."""
    failing, landing = (b"\x01" + os.urandom(13) + b"\xab\xcd" for _ in range(2))
    name_of = _fs_layout.name_of
    writing, beside, failed = threading.Event(), threading.Event(), threading.Event()
    now = threading.local()
    real_tmp, real_writev = _fs_layout.tmp_name, _fs_write._writev

    def tmp_name(name: str) -> str:
        now.name = name
        if name == name_of(landing):  # its shard folder is open: wait for the failure
            beside.set()
            assert failed.wait(30)
        return real_tmp(name)

    def writev(fd: int, bufs: Any) -> int:
        if getattr(now, "name", None) == name_of(failing):
            writing.set()  # in the shard folder it made
            assert beside.wait(30)
            _eio()
        return real_writev(fd, bufs)

    monkeypatch.setattr(_fs_write, "tmp_name", tmp_name)
    monkeypatch.setattr(_fs_write, "_writev", writev)
    async with FSTier(tmp_path / "c") as tier:

        async def fail() -> None:
            with pytest.raises(TierUnavailableError, match="EIO"):
                await tier.store(failing, memoryview(data(0)))
            failed.set()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fail)
                assert await anyio.to_thread.run_sync(writing.wait, 30)
                tg.start_soon(tier.store, landing, memoryview(data(1)))
        assert await load(tier, landing) == data(1)
        assert tier.statistics().failures_by_reason == {"unavailable": 1}


async def test_read_only_filesystem_serves_loads_and_refuses_stores(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "ro", "4m") as real:
        if not real:
            pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
        root = tmp_path / "ro" / "c"
        async with FSTier(root) as tier:
            await tier.store(key(0), memoryview(data(0)))
        await anyio.run_process(["mount", "-o", "remount,ro", str(tmp_path / "ro")])
        async with FSTier(root) as tier:
            assert await load(tier, key(0)) == data(0)
            with pytest.raises(TierUnavailableError, match="EROFS"):
                await tier.store(key(1), memoryview(data(1)))
            with pytest.raises(TierUnavailableError, match="EROFS"):
                await tier.delete(key(0))
            assert tier.statistics().failures_by_reason == {"unavailable": 2}
            assert await resolve_lookup(tier, key(1)) is LookupResult.MISS


async def test_missing_parents_are_created_and_an_unusable_root_raises_at_open(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "not-mounted-yet"
    async with FSTier(parent / "c") as tier:  # created, parents too, as vLLM's fs tier does
        await tier.store(key(0), memoryview(data(0)))
        assert await load(tier, key(0)) == data(0)
    (tmp_path / "file").write_bytes(b"")
    for root in (tmp_path / "file" / "c", Path("/dev/null/c")):
        with pytest.raises(UnusableRootError, match=rf"{re.escape(str(root))}.*ENOTDIR") as info:
            async with FSTier(root):
                pass
        assert isinstance(info.value, OSError) and info.value.path == root


async def test_io_error_on_load_is_a_counted_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FSTier(tmp_path / "c") as tier:
        await tier.store(key(0), memoryview(data(0)))
        monkeypatch.setattr(_fs_read, "_preadv", _eio)
        with pytest.raises(TierUnavailableError, match="EIO"):
            await load(tier, key(0))
        assert tier.lookup(key(0)) is LookupResult.MISS
        assert tier.statistics().failures_by_reason == {"unavailable": 1}
        monkeypatch.undo()
        assert await load(tier, key(0)) == data(0)  # an I/O error does not delete the block


async def test_io_error_on_store_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FSTier(tmp_path / "c") as tier:
        monkeypatch.setattr(_fs_write, "_writev", _eio)
        with pytest.raises(TierUnavailableError, match="EIO"):
            await tier.store(key(0), memoryview(data(0)))
        assert block_files(tier.root) == tmp_files(tier.root) == []
        assert tier.statistics().bytes_stored == 0


# -- sharing -----------------------------------------------------------------------------------


async def test_two_processes_share_one_folder(tmp_path: Path) -> None:
    root, block, keys, ops = tmp_path / "c", 64 << 10, 24, 300
    capacity = 8 * (header_size(16) + block)
    async with FSTier(root):
        pass  # create the folder first, so neither worker races the other to the marker

    async def worker(seed: int, out: list[dict[str, Any]]) -> None:
        args = ["mix", str(root), "shared", str(block), str(capacity), str(keys), str(ops)]
        result = await anyio.run_process([sys.executable, WORKER, *args, str(seed)])
        out.append(json.loads(result.stdout))

    results: list[dict[str, Any]] = []
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for seed in (1, 2):
                tg.start_soon(worker, seed, results)
    for r in results:
        assert (r["corrupt"], r["wrong"], r["errors"]) == (0, 0, []), r
        assert r["loaded"] > 0
        assert r["stored"] > 0
    async with FSTier(root) as tier:
        assert tmp_files(root) == []
        for p in block_files(root):
            i = next(i for i in range(keys) if key_of("shared", i).hex() == p.name)
            assert await load(tier, key_of("shared", i), block) == payload_of("shared", i, block)


# -- with the manager ---------------------------------------------------------------------------


async def test_promotion_from_fs_into_a_host_pool(tmp_path: Path, no_blocking: list[str]) -> None:
    root = tmp_path / "c"
    blocks = np.frombuffer(b"".join(data(i) for i in range(4)), np.uint8).reshape(4, BLOCK)
    keys = [key(i) for i in range(4)]
    async with TieringManager(HostPool(8, BLOCK), [FSTier(root)]) as manager:
        await manager.store(keys, blocks)
        await manager.wait_idle()
    assert len(await anyio.to_thread.run_sync(block_files, root)) == 4
    async with TieringManager(HostPool(8, BLOCK), [FSTier(root)]) as manager:
        assert manager.lookup(keys[0]) is LookupResult.RETRY  # existence check started
        assert await OffloadScheduler(manager).lookup(keys, timeout=10) == 4
        out = np.zeros((4, BLOCK), np.uint8)
        assert await manager.load(keys, out) == 4
        assert np.array_equal(out, blocks)


async def test_batches_never_block_the_loop(tmp_path: Path, no_blocking: list[str]) -> None:
    keys = [key(i) for i in range(20)]
    async with FSTier(tmp_path / "c", capacity_bytes=10 * FILE) as tier:
        for pinned in (False, True):
            got = await tier.store_many(
                keys, [memoryview(data(i)) for i in range(20)], pinned=pinned
            )
            assert got == [None] * 20
            dst = [bytearray(BLOCK) for _ in range(10)]
            got = await tier.load_many(keys[10:], [memoryview(d) for d in dst], pinned=pinned)
            assert got == [None] * 10 and dst == [data(i) for i in range(10, 20)]
