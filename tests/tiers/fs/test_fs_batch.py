"""FSTier's batch calls (``load_many``/``store_many``): partial failures, a corrupt block in
the middle, capacity, deadlines (pinned and not), and the promises ``load``/``store`` keep.

Real files; where a test needs a hung or failing syscall it replaces ``_fs_write``'s single
boundary (``_preadv``/``_writev``), released by an event, never a sleep.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from kvtier import (
    BlockNotFoundError,
    CorruptBlockError,
    InvalidArgumentError,
    LookupResult,
    TierNoSpaceError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvtier.common._format import header_size
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _geometry as _fs_geometry
from kvtier.tiers.fs import _read as _fs_read
from kvtier.tiers.fs import _write as _fs_write
from tests.support import Hang, block_files, tmp_files
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 4096
FILE = header_size(16) + BLOCK
FAILSAFE = 15.0


key, data = key_and_data("b", BLOCK)


def views(n: int) -> tuple[bytearray, list[memoryview]]:
    buf = bytearray(n * BLOCK)
    return buf, [memoryview(buf)[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


@pytest.mark.parametrize("pinned", [False, True])
async def test_round_trip_over_many_threads(tmp_path: Path, pinned: bool) -> None:
    n = 37  # more blocks than threads, not a multiple of them
    async with FSTier(tmp_path / "c", max_concurrency=4, max_write_concurrency=3) as tier:
        got = await tier.store_many(
            [key(i) for i in range(n)], [memoryview(data(i)) for i in range(n)], pinned=pinned
        )
        assert got == [None] * n
        assert len(block_files(tmp_path / "c")) == n and not tmp_files(tmp_path / "c")
        s = tier.statistics()
        assert (s.stores, s.blocks, s.bytes_stored) == (n, n, n * FILE)
        buf, dsts = views(n)
        assert await tier.load_many([key(i) for i in range(n)], dsts, pinned=pinned) == [None] * n
        assert bytes(buf) == b"".join(data(i) for i in range(n))
        assert tier.statistics().loads == n
        assert await resolve_lookup(tier, key(n - 1)) is LookupResult.HIT


@pytest.mark.parametrize("pinned", [False, True])
async def test_corrupt_and_missing_blocks_in_the_middle_of_a_batch(
    tmp_path: Path, pinned: bool
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, max_concurrency=2) as tier:
        assert (
            await tier.store_many(
                [key(i) for i in range(6)], [memoryview(data(i)) for i in range(6)]
            )
            == [None] * 6
        )
        (bad,) = [p for p in block_files(root) if p.name == key(2).hex()]
        raw = bytearray(bad.read_bytes())
        raw[-1] ^= 0xFF  # a payload bit flipped: only the checksum can tell
        bad.write_bytes(bytes(raw))
        (root / key(4).hex()[-4:-2] / key(4).hex()[-2:] / key(4).hex()).unlink()
        _buf, dsts = views(6)
        got = await tier.load_many([key(i) for i in range(6)], dsts, pinned=pinned)
        assert [type(e) for e in got] == [
            type(None),
            type(None),
            CorruptBlockError,
            type(None),
            BlockNotFoundError,
            type(None),
        ]
        for i in (0, 1, 3, 5):
            assert dsts[i] == data(i), f"block {i} next to a bad one was not loaded whole"
        assert got[2] is not None and got[2].key == key(2)
        assert not bad.exists(), "a corrupt block must be removed"
        s = tier.statistics()
        assert s.failures_by_reason == {"corrupt": 1, "not_found": 1}
        assert s.blocks == 4 and s.bytes_stored == 4 * FILE
        assert tier.lookup(key(2)) is LookupResult.MISS


async def test_a_wrong_destination_size_raises_and_keeps_the_block(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c") as tier:
        await tier.store_many([key(0), key(1)], [memoryview(data(0)), memoryview(data(1))])
        small = memoryview(bytearray(BLOCK - 1))
        with pytest.raises(InvalidArgumentError, match=f"is {BLOCK} bytes"):
            await tier.load_many([key(0), key(1)], [memoryview(bytearray(BLOCK)), small])
        _buf, dsts = views(2)
        assert await tier.load_many([key(0), key(1)], dsts) == [None, None]
        with pytest.raises(InvalidArgumentError, match="2 keys but 1"):
            await tier.store_many([key(0), key(1)], [memoryview(data(0))])
        with pytest.raises(InvalidArgumentError, match="bytes"):
            await tier.load_many(["nope"], [memoryview(bytearray(BLOCK))])  # type: ignore[list-item]


async def test_capacity_is_kept_block_by_block(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c", capacity_bytes=4 * FILE, max_write_concurrency=2) as tier:
        got = await tier.store_many(
            [key(i) for i in range(6)], [memoryview(data(i)) for i in range(6)]
        )
        assert got == [None] * 6
        s = tier.statistics()
        assert s.blocks == 4 and s.bytes_stored == 4 * FILE and s.evictions == 2
        assert len(block_files(tmp_path / "c")) == 4
        assert tier._catalog.reserved == 0
    async with FSTier(tmp_path / "d", capacity_bytes=FILE - 1) as tier:
        got = await tier.store_many([key(0)], [memoryview(data(0))])
        assert isinstance(got[0], TierNoSpaceError)
        assert tier._catalog.reserved == 0


async def test_a_failing_write_fails_only_its_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _fs_write._writev

    def flaky(fd: int, buffers: Any) -> int:
        if key(1).hex() in os.readlink(f"/proc/self/fd/{fd}"):  # key 1's temporary file
            raise OSError(5, "Input/output error")
        return real(fd, buffers)

    monkeypatch.setattr(_fs_write, "_writev", flaky)
    root = tmp_path / "c"
    async with FSTier(root, max_write_concurrency=1) as tier:
        got = await tier.store_many(
            [key(i) for i in range(3)], [memoryview(data(i)) for i in range(3)], pinned=True
        )
        assert got[0] is None and got[2] is None
        assert isinstance(got[1], TierUnavailableError) and got[1].key == key(1)
        assert not tmp_files(root)
        s = tier.statistics()
        assert s.blocks == 2 and s.failures_by_reason == {"unavailable": 1}
        assert tier._catalog.reserved == 0


async def test_the_same_key_twice_and_a_store_in_flight(tmp_path: Path) -> None:
    async with FSTier(tmp_path / "c") as tier:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.store, key(0), memoryview(data(0)))
            got = await tier.store_many(
                [key(0), key(1), key(1)],
                [memoryview(data(0)), memoryview(data(1)), memoryview(data(1))],
            )
        assert got == [None, None, None]
        assert tier.statistics().blocks == 2 and not tier._catalog.storing


async def test_unpinned_load_deadline_walks_away_from_a_hung_read(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, max_concurrency=1) as tier:
        await tier.store_many([key(0), key(1)], [memoryview(data(0)), memoryview(data(1))])
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        buf, dsts = views(2)
        with anyio.fail_after(FAILSAFE / 2):  # the 0.2 s timeout holds while the read hangs
            got = await tier.load_many([key(0), key(1)], dsts, timeout=0.2)
        assert all(isinstance(e, TierTimeoutError) for e in got)
        buf[:] = b"\xab" * len(buf)  # the slots are reused at once
        hang.release.set()
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        assert buf == b"\xab" * len(buf), "an abandoned read wrote into the caller's memory"
        assert tier.statistics().failures_by_reason == {"timeout": 2}


async def test_pinned_store_deadline_waits_for_io_and_stops_the_rest(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, max_write_concurrency=1) as tier:
        monkeypatch.setattr(_fs_write, "_writev", hang.wrap(os.writev))
        result: list[Any] = []

        async def store() -> None:
            result.extend(
                await tier.store_many(
                    [key(0), key(1)],
                    [memoryview(data(0)), memoryview(data(1))],
                    timeout=0.2,
                    pinned=True,
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(store)
            await hang.wait_entered()
            # Let the 0.2 s deadline pass while the write hangs (time must pass; nothing is
            # ordered by it): a pinned batch keeps waiting for the write it started.
            await anyio.sleep(0.3)
            assert not result
            hang.release.set()
        assert result[0] is None, "the block whose write was under way completes"
        assert isinstance(result[1], TierTimeoutError), "no block starts after the deadline"
        s = tier.statistics()
        assert s.blocks == 1 and tier._catalog.reserved == 0 and not tier._catalog.storing
        assert tier._files.calls.stuck == 0


async def test_unpinned_store_deadline_settles_the_write_it_left(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, max_write_concurrency=1, capacity_bytes=10 * FILE) as tier:
        monkeypatch.setattr(_fs_write, "_writev", hang.wrap(os.writev))
        with anyio.fail_after(FAILSAFE / 2):
            got = await tier.store_many(
                [key(0), key(1)], [memoryview(data(0)), memoryview(data(1))], timeout=0.2
            )
        assert all(isinstance(e, TierTimeoutError) for e in got)
        assert tier._catalog.reserved == FILE, "the write left running still holds its room"
        hang.release.set()
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        s = tier.statistics()  # runs the late settlement
        assert tier._catalog.reserved == 0
        assert s.blocks == 1 and len(block_files(root)) == 1 and not tmp_files(root)
        out = bytearray(BLOCK)
        await tier.load(key(0), memoryview(out))
        assert out == data(0)


# -- O_DIRECT ------------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [100, 4096 - header_size(16), 4096, 20_000])
async def test_direct_and_buffered_write_the_same_files(
    tmp_path: Path, payload: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files written with O_DIRECT are byte for byte those written through the page cache
    (the format is unchanged), whatever the size's alignment, and each mode reads the
    other's. Small direct pieces make a 20000-byte block take several reads."""
    monkeypatch.setattr(_fs_geometry, "DIRECT_CHUNK", 8192)
    blocks = {i: os.urandom(payload) for i in range(4)}
    direct, buffered = tmp_path / "direct", tmp_path / "buffered"
    async with FSTier(direct, direct_io=True) as tier:
        if not tier._files.direct:
            pytest.skip("this file system refuses O_DIRECT")
        await tier.store_many([key(0), key(1)], [memoryview(blocks[0]), memoryview(blocks[1])])
        await tier.store(key(2), memoryview(blocks[2]))
    async with FSTier(buffered, direct_io=False) as tier:
        assert not tier._files.direct, "direct_io=False keeps the page cache"
        for i in range(3):
            await tier.store(key(i), memoryview(blocks[i]))
    for name in (key(i).hex() for i in range(3)):
        shard = f"{name[-4:-2]}/{name[-2:]}/{name}"
        assert (direct / shard).read_bytes() == (buffered / shard).read_bytes()
        assert (direct / shard).stat().st_size == header_size(16) + payload
    for root, other in ((direct, False), (buffered, True)):  # each reads the other's files
        async with FSTier(root, direct_io=other) as tier:
            dsts = [bytearray(payload) for _ in range(3)]
            got = await tier.load_many([key(i) for i in range(3)], [memoryview(d) for d in dsts])
            assert got == [None] * 3 and dsts == [blocks[i] for i in range(3)]
            for pinned in (False, True):
                out = bytearray(payload)
                await tier.load(key(1), memoryview(out))
                assert out == blocks[1]
                assert await tier.load_many([key(2)], [memoryview(out)], pinned=pinned) == [None]
                assert out == blocks[2]


async def test_a_corrupt_block_is_caught_by_direct_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fs_geometry, "DIRECT_CHUNK", 8192)
    root = tmp_path / "c"
    async with FSTier(root, direct_io=True) as tier:
        if not tier._files.direct:
            pytest.skip("this file system refuses O_DIRECT")
        payload = os.urandom(20_000)
        await tier.store(key(0), memoryview(payload))
        (path,) = block_files(root)
        raw = bytearray(path.read_bytes())
        raw[header_size(16) + 12_000] ^= 1  # in the second direct piece
        path.write_bytes(bytes(raw))
        got = await tier.load_many([key(0)], [memoryview(bytearray(20_000))], pinned=True)
        assert isinstance(got[0], CorruptBlockError) and not path.exists()
