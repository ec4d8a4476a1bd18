"""The FS tier's block files: version 2 (payload aligned for O_DIRECT) for whole-page payloads,
the compact version 1 for others, older version 1 files and folders still read, and O_DIRECT
moving an aligned payload straight into (and out of) the caller's buffer."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.common import drop_cache
from kvtier import CorruptBlockError, IntegrityKey
from kvtier.common._format import FORMAT_VERSION, encode_header, header_size
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _geometry as fs_geometry
from kvtier.tiers.fs import _read as fs_read
from kvtier.tiers.fs import _write as fs_write
from kvtier.tiers.fs._geometry import ALIGN
from kvtier.tiers.fs._layout import MARKER_NAME, O_DIRECT
from tests.support import block_file, fresh_keys, run_cli

LARGE = 256 << 10  # a whole number of pages, written in version 2
SMALL = 100  # written in version 1
REGION = 4096  # a version 2 header padded to one page
SECRET = b"block-format-test-secret-0123456789"


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def aligned_buffer(n: int) -> memoryview:
    """A page-aligned buffer (an anonymous mapping), as a pool slot is."""
    return memoryview(mmap.mmap(-1, n))


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


@pytest.fixture
def preadv_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Every read the FS tier makes: (address, length) of each buffer it reads into."""
    calls: list[list[tuple[int, int]]] = []
    real = fs_read._preadv

    def recording(fd: int, views: list[memoryview], offset: int, *flags: int) -> int:
        calls.append([(address(v), v.nbytes) for v in views])
        return real(fd, views, offset, *flags)

    monkeypatch.setattr(fs_read, "_preadv", recording)
    return calls


@pytest.mark.parametrize("signed", [False, True])
async def test_whole_page_payloads_are_version_2_and_others_version_1(
    tmp_path: Path, signed: bool
) -> None:
    ikey = IntegrityKey(SECRET) if signed else None
    large_key, small_key, odd_key = fresh_keys(3)
    blocks = {large_key: payload(LARGE, 1), small_key: payload(SMALL, 2)}
    blocks[odd_key] = payload(LARGE + 1, 3)  # not a whole number of pages
    async with FSTier(tmp_path / "c", integrity_key=ikey) as tier:
        for key, data in blocks.items():
            await tier.store(key, memoryview(data))
        stored = tier.statistics().bytes_stored
    assert stored == sum(block_file(tmp_path / "c", k).stat().st_size for k in blocks)
    hlen = header_size(16, integrity_key=ikey)
    raw = block_file(tmp_path / "c", large_key).read_bytes()
    assert struct.unpack_from("<H", raw, 4)[0] == 2
    assert len(raw) == REGION + LARGE
    assert raw[hlen:REGION] == bytes(REGION - hlen)  # zero padding up to the payload
    assert raw[REGION:] == blocks[large_key]
    for key in (small_key, odd_key):
        raw = block_file(tmp_path / "c", key).read_bytes()
        assert struct.unpack_from("<H", raw, 4)[0] == 1
        assert raw[hlen:] == blocks[key]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
async def test_version_2_round_trips_in_every_mode(
    tmp_path: Path, direct: bool, pinned: bool, signed: bool
) -> None:
    ikey = IntegrityKey(SECRET) if signed else None
    keys = fresh_keys(3)
    blocks = [payload(LARGE, i) for i in range(3)]
    async with FSTier(tmp_path / "c", direct_io=direct, integrity_key=ikey) as tier:
        srcs = [aligned_buffer(LARGE) for _ in keys]
        for src, data in zip(srcs, blocks, strict=True):
            src[:] = data
        assert await tier.store_many(keys, srcs, pinned=pinned) == [None] * 3
        aligned = [aligned_buffer(LARGE) for _ in keys]
        unaligned = [memoryview(bytearray(LARGE + 1))[1:] for _ in keys]
        for dsts in (aligned, unaligned):
            assert await tier.load_many(keys, dsts, pinned=pinned) == [None] * 3
            assert [bytes(d) for d in dsts] == blocks


async def test_direct_pinned_loads_and_stores_move_no_copy(
    tmp_path: Path, preadv_calls: list[list[tuple[int, int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[list[tuple[int, int]]] = []
    real_writev = fs_write._writev

    def recording(fd: int, views: list[memoryview]) -> int:
        writes.append([(address(v), v.nbytes) for v in views])
        return real_writev(fd, views)

    monkeypatch.setattr(fs_write, "_writev", recording)
    key, data = fresh_keys(1)[0], payload(LARGE, 7)
    async with FSTier(tmp_path / "c", direct_io=True) as tier:
        if not tier._files.direct:
            pytest.skip(f"{tmp_path} does not take O_DIRECT")
        src = aligned_buffer(LARGE)
        src[:] = data
        assert await tier.store_many([key], [src], pinned=True) == [None]
        dst = aligned_buffer(LARGE)
        assert await tier.load_many([key], [dst], pinned=True) == [None]
        assert bytes(dst) == data
    # One write and one read: the header's page and the payload, straight from the source and
    # into the destination (the read with a page more, which catches a longer file).
    assert writes == [[(writes[0][0][0], REGION), (address(src), LARGE)]]
    ((head, dest, tail),) = preadv_calls
    assert head[1] == REGION and dest == (address(dst), LARGE) and tail[1] == ALIGN


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "cold"])
async def test_a_file_the_page_cache_holds_is_read_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """O_DIRECT would read a cached file from the device again: a zero-copy read of a file
    the cache holds whole goes through the cache; any other by O_DIRECT. (In a worker
    thread: the tier here reads nothing on the loop.)"""
    key, data = fresh_keys(1)[0], payload(LARGE, 9)
    direct_reads: list[bool] = []
    real = fs_read._preadv

    def recording(fd: int, views: list[memoryview], offset: int, *flags: int) -> int:
        direct_reads.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT))
        return real(fd, views, offset, *flags)

    async with FSTier(tmp_path / "c", direct_io=True, loop_read_bytes=0) as tier:
        if not tier._files.direct:
            pytest.skip(f"{tmp_path} does not take O_DIRECT")
        await tier.store(key, memoryview(data))
        path = block_file(tmp_path / "c", key)
        drop_cache([path])
        if cached:
            path.read_bytes()
            fd = os.open(path, os.O_RDONLY)
            try:
                known = fs_read.all_cached(fd, len(data) + REGION)
            finally:
                os.close(fd)
            if not known:
                pytest.skip("this kernel cannot tell what the page cache holds (cachestat)")
        monkeypatch.setattr(fs_read, "_preadv", recording)
        dst = aligned_buffer(LARGE)
        assert await tier.load_many([key], [dst], pinned=True) == [None]
        assert bytes(dst) == data
    assert direct_reads == [not cached]


async def test_unpinned_loads_never_read_into_the_destination(
    tmp_path: Path, preadv_calls: list[list[tuple[int, int]]]
) -> None:
    """A deadline may walk away from an unpinned load, so its reads land in the tier's own
    buffer, never in the caller's (which may hold another block by then)."""
    key, data = fresh_keys(1)[0], payload(LARGE, 8)
    async with FSTier(tmp_path / "c", direct_io=True) as tier:
        await tier.store(key, memoryview(data))
        dst = aligned_buffer(LARGE)
        await tier.load(key, dst)
        assert bytes(dst) == data
    start, end = address(dst), address(dst) + LARGE
    for call in preadv_calls:
        for where, length in call:
            assert where + length <= start or where >= end


def write_version_1(root: Path, key: bytes, data: bytes, ikey: IntegrityKey | None) -> None:
    """A block file as a kvtier before version 2 wrote it."""
    head = encode_header(key, data, integrity_key=ikey, version=FORMAT_VERSION)
    path = block_file(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + data)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
async def test_version_1_files_in_an_older_folder_still_load(
    tmp_path: Path, direct: bool, pinned: bool
) -> None:
    root = tmp_path / "c"
    async with FSTier(root):
        pass
    marker = json.loads((root / MARKER_NAME).read_text())
    (root / MARKER_NAME).write_text(json.dumps({**marker, "block_format": 1}))
    keys = fresh_keys(2)
    blocks = {keys[0]: payload(LARGE, 10), keys[1]: payload(SMALL, 11)}
    for key, data in blocks.items():
        write_version_1(root, key, data, None)
    async with FSTier(root, direct_io=direct) as tier:
        await tier._persistence.walked()  # the catalog kept at close did not hold them
        assert json.loads((root / MARKER_NAME).read_text())["block_format"] == 2
        assert tier.statistics().blocks == 2
        dsts = [aligned_buffer(len(d)) for d in blocks.values()]
        assert await tier.load_many(list(blocks), dsts, pinned=pinned) == [None, None]
        assert [bytes(d) for d in dsts] == list(blocks.values())
    code, out, err = run_cli("verify", str(root))
    assert code == 0, out + err


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize(
    "damage", ["payload", "header", "truncated", "grown", "grown-a-byte"], ids=lambda d: str(d)
)
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "cold"])
async def test_a_damaged_version_2_file_is_a_corrupt_miss_and_removed(
    tmp_path: Path, direct: bool, pinned: bool, damage: str, cached: bool
) -> None:
    key, data = fresh_keys(1)[0], payload(LARGE, 12)
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        await tier.store(key, memoryview(data))
    path = block_file(root, key)
    raw = bytearray(path.read_bytes())
    if damage == "payload":
        raw[REGION + 1000] ^= 0x40
    elif damage == "header":
        raw[30] ^= 0x01
    elif damage == "truncated":
        del raw[-REGION:]
    elif damage == "grown":
        raw += bytes(REGION)
    else:
        raw += b"x"
    path.write_bytes(raw)
    if not cached:  # read from the device (by O_DIRECT where the tier uses it)
        drop_cache([path])
    code, out, _ = run_cli("verify", str(root))
    assert code != 0 and path.name in out
    async with FSTier(root, direct_io=direct) as tier:
        dst = aligned_buffer(LARGE)
        if pinned:
            (error,) = await tier.load_many([key], [dst], pinned=True)
            assert isinstance(error, CorruptBlockError)
        else:
            with pytest.raises(CorruptBlockError):
                await tier.load(key, dst)
        assert tier.statistics().failures_by_reason == {"corrupt": 1}
    assert not path.exists()


async def test_a_version_2_file_an_older_reader_sees_is_refused_not_misread(
    tmp_path: Path,
) -> None:
    """The S3 tier's codec (and any reader of version 1 only) refuses a version 2 header."""
    key, data = fresh_keys(1)[0], payload(LARGE, 13)
    async with FSTier(tmp_path / "c") as tier:
        await tier.store(key, memoryview(data))
    raw = block_file(tmp_path / "c", key).read_bytes()
    from kvtier.common._format import HeaderError, decode_header

    with pytest.raises(HeaderError, match="format version 2"):
        decode_header(raw[: header_size(16)])
    assert fs_geometry.file_version(LARGE) == 2 and fs_geometry.file_version(SMALL) == 1


async def test_a_file_system_that_refuses_o_direct_falls_back_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Some file systems (some FUSE and network ones, tmpfs before Linux 6.6) refuse O_DIRECT
    with EINVAL: the tier says so once and goes through the page cache."""
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    key, data = fresh_keys(1)[0], payload(LARGE, 14)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.fs"):
        async with FSTier(tmp_path / "c") as tier:
            assert tier.direct_io and not tier._files.direct
            await tier.store(key, memoryview(data))
            dst = aligned_buffer(LARGE)
            assert await tier.load_many([key], [dst], pinned=True) == [None]
            assert bytes(dst) == data
    assert "O_DIRECT failed: Invalid argument; through the page cache instead" in caplog.text
