"""Promotions read straight into their pool slot, and a read left running keeps its slot.

The manager lends a host pool's reserved slots to the tier (``kvtier.common._lending``): the FS tier
reads into them directly and verifies the checksum where the bytes landed. A deadline or a
cancellation still walks away from a read in flight (a hung mount must not hold the
manager), and the slot that read may still write stays out of the pool, unpublished, until
the thread returns. The hang is an event injected at the one OS call that reads
(``_read._preadv``), released by the test; nothing here waits on time.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from kvtier import CorruptBlockError, HostPool, LookupResult, OffloadScheduler, TierTimeoutError
from kvtier.common._lending import Release
from kvtier.manager import TieringManager
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _read as _fs_read
from tests.support import Hang, block_file, fresh_keys, given_back
from tests.tiers.fs.test_fs_block_format import aligned_buffer, payload

LARGE = 256 << 10  # written in version 2: the read lands in the slot with no copy
DEADLINE = 0.2  # the promotion timeout under test
FAILSAFE = 15.0


class RecordingLender:
    """A lender that records what a tier keeps and what it gives back, and from where."""

    def __init__(self) -> None:
        self.kept: list[int] = []
        self.released: list[int] = []
        self.released_event = threading.Event()

    def keep(self, index: int) -> Release:
        self.kept.append(index)

        def release() -> None:
            self.released.append(index)
            self.released_event.set()

        return release


async def stored(root: Path, blocks: dict[bytes, bytes]) -> None:
    async with FSTier(root) as tier:
        for key, data in blocks.items():
            await tier.store(key, memoryview(data))


async def test_a_promotion_past_its_deadline_keeps_its_slot_until_the_read_returns(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    (key, other), data = fresh_keys(2), payload(LARGE, 1)
    await stored(tmp_path / "c", {key: data})
    pool, tier = HostPool(1, LARGE), FSTier(tmp_path / "c")
    async with TieringManager(pool, [tier], promotion_timeout=DEADLINE) as manager:
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        with anyio.fail_after(FAILSAFE):
            assert await OffloadScheduler(manager).lookup([key], timeout=FAILSAFE) == 0
        assert manager.statistics().promotions.failed_by_reason == {"timeout": 1}
        # The key is gone, but its slot is still lent to the hung read: not reusable.
        assert pool.lookup(key) is LookupResult.MISS
        assert pool.table.lent == 1 and pool.statistics().free == 0
        assert pool.try_reserve(other) is None
        pool.table.check_invariants()
        hang.release.set()  # the read goes on, into the slot
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        await given_back(pool)
        pool.table.check_invariants()
        # Landed or not, the block was never published; the slot is the pool's again.
        assert pool.statistics().free == 1 and pool.statistics().ready == 0
        assert manager.lookup(key) is LookupResult.MISS
        slot = pool.try_reserve(other)
        assert slot is not None
        pool.abort(slot)


async def test_a_cancelled_lent_load_keeps_only_the_buffer_in_flight(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, blocks = fresh_keys(2), [payload(LARGE, 2), payload(LARGE, 3)]
    await stored(tmp_path / "c", dict(zip(keys, blocks, strict=True)))
    dsts = [aligned_buffer(LARGE) for _ in keys]
    lender = RecordingLender()
    async with FSTier(tmp_path / "c", max_concurrency=1) as tier:  # one run reads both
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        results: list[object] = []

        async def load() -> None:
            results.extend(await tier.load_many(keys, dsts, lender=lender))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await hang.wait_entered()
            tg.cancel_scope.cancel()
        assert results == []  # cancelled
        assert lender.kept == [0] and lender.released == []  # the first read is in flight
        hang.release.set()
        assert await anyio.to_thread.run_sync(lender.released_event.wait, FAILSAFE)
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        assert lender.released == [0]
        assert hang.calls == 1, "the run went on to the next block after its caller left"
        assert bytes(dsts[1]) == bytes(LARGE)  # never touched


async def test_a_lent_load_that_finishes_in_time_keeps_nothing(tmp_path: Path) -> None:
    keys, blocks = fresh_keys(2), [payload(LARGE, 4), payload(LARGE, 5)]
    await stored(tmp_path / "c", dict(zip(keys, blocks, strict=True)))
    dsts = [aligned_buffer(LARGE) for _ in keys]
    lender = RecordingLender()
    async with FSTier(tmp_path / "c") as tier:
        assert await tier.load_many(keys, dsts, lender=lender) == [None, None]
    assert [bytes(d) for d in dsts] == blocks
    assert lender.kept == []


async def test_a_lent_load_past_its_timeout_is_a_timeout(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    (key,), data = fresh_keys(1), payload(LARGE, 6)
    await stored(tmp_path / "c", {key: data})
    dst = aligned_buffer(LARGE)
    lender = RecordingLender()
    async with FSTier(tmp_path / "c") as tier:
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        (result,) = await tier.load_many([key], [dst], lender=lender, timeout=DEADLINE)
        assert isinstance(result, TierTimeoutError)
        assert lender.kept == [0]
        hang.release.set()
        assert await anyio.to_thread.run_sync(lender.released_event.wait, FAILSAFE)
        assert bytes(dst) == data  # what the kept buffer was kept for: the late read landed


async def test_a_checksum_failure_in_the_slot_is_a_corrupt_miss_and_frees_it(
    tmp_path: Path,
) -> None:
    (key,), data = fresh_keys(1), payload(LARGE, 7)
    root = tmp_path / "c"
    await stored(root, {key: data})
    path = block_file(root, key)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # a payload byte: the header is fine, the checksum is not
    path.write_bytes(raw)
    pool = HostPool(1, LARGE)
    async with TieringManager(pool, [FSTier(root)]) as manager:
        with anyio.fail_after(FAILSAFE):
            assert await OffloadScheduler(manager).lookup([key], timeout=FAILSAFE) == 0
        assert manager.statistics().promotions.failed_by_reason == {"corrupt": 1}
        assert manager.lookup(key) is LookupResult.MISS
        assert pool.table.lent == 0 and pool.statistics().free == 1
        pool.table.check_invariants()
    assert not path.exists()


async def test_a_lent_load_of_a_corrupt_block_keeps_nothing(tmp_path: Path) -> None:
    (key,), data = fresh_keys(1), payload(LARGE, 8)
    root = tmp_path / "c"
    await stored(root, {key: data})
    path = block_file(root, key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(raw)
    lender = RecordingLender()
    async with FSTier(root) as tier:
        (result,) = await tier.load_many([key], [aligned_buffer(LARGE)], lender=lender)
    assert isinstance(result, CorruptBlockError)
    assert lender.kept == []
