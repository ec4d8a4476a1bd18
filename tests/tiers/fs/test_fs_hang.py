"""FSTier on a hung mount: every deadline holds; and stale existence checks.

A real FSTier on real files; the one blocking OS call of the operation under test
(``_fs_exists._stat``, ``_fs_read._preadv`` or ``_fs_write._writev``) is replaced by a call that
blocks until the test releases it, standing in for a syscall on a dead NFS server. The
release happens at teardown (the ``hang`` fixture's failsafe timer releases it after
``HUNG_FAILSAFE`` seconds, so a regression fails an assertion instead of hanging the run).
Deadlines are asserted only with generous bounds: a 0.2 s deadline must answer within ``BOUND``
seconds, while the hang lasts until released.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from kvtier import HostPool, LookupResult, OffloadScheduler
from kvtier.common._format import header_size
from kvtier.manager import TieringManager
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _exists as _fs_exists
from kvtier.tiers.fs import _read as _fs_read
from kvtier.tiers.fs import _write as _fs_write
from tests.support import Hang, block_file, given_back
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 4096
FILE = header_size(16) + BLOCK
DEADLINE = 0.2
BOUND = 2.0  # a 0.2 s deadline must answer well within this, even on a loaded machine
FAILSAFE = 15.0


key, data = key_and_data("h", BLOCK)


async def stored(root: Path, *indices: int) -> None:
    async with FSTier(root) as tier:
        for i in indices:
            await tier.store(key(i), memoryview(data(i)))


# -- existence checks ----------------------------------------------------------------------------


async def test_existence_check_misses_by_its_deadline(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FSTier(tmp_path / "c", lookup_timeout=DEADLINE, shared=True) as tier:
        monkeypatch.setattr(_fs_exists, "_stat", hang.wrap(os.stat))
        assert tier.lookup(key(1)) is LookupResult.RETRY
        started = time.perf_counter()
        with anyio.fail_after(BOUND):
            assert await resolve_lookup(tier, key(1), timeout=BOUND) is LookupResult.MISS
        assert time.perf_counter() - started < BOUND
        assert not hang.release.is_set(), "answered only because the hang was released"
        assert tier.statistics().lookups.misses_by_reason.get("timeout") == 1


async def test_stuck_threads_are_bounded_then_checks_fail_at_once(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = FSTier(
        tmp_path / "c",
        lookup_timeout=DEADLINE,
        lookup_batch_size=1,
        max_stuck_threads=2,
        shared=True,
    )
    async with tier:
        monkeypatch.setattr(_fs_exists, "_stat", hang.wrap(os.stat))
        for i in range(2):  # each check times out and leaves its thread in the hung call
            assert await resolve_lookup(tier, key(i), timeout=BOUND) is LookupResult.MISS
        assert hang.calls == 2
        with anyio.fail_after(BOUND):
            assert await resolve_lookup(tier, key(9), timeout=BOUND) is LookupResult.MISS
        assert hang.calls == 2, "a third thread was sent into the hung mount"
        reasons = tier.statistics().lookups.misses_by_reason
        assert reasons.get("timeout") == 2 and reasons.get("unavailable") == 1
        assert "stuck_threads=2" in repr(tier)
        hang.release.set()  # the mount comes back: the tier recovers by itself
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        await tier.store(key(20), memoryview(data(20)))
        assert await resolve_lookup(tier, key(21), timeout=BOUND) is LookupResult.MISS
        assert tier.statistics().lookups.misses_by_reason.get("not_found") == 1


# -- promotion ------------------------------------------------------------------------------------


async def test_promotion_fails_by_its_deadline(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    await stored(root, 1)
    pool, tier = HostPool(4, BLOCK), FSTier(root)
    async with TieringManager(pool, [tier], promotion_timeout=DEADLINE) as manager:
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        scheduler = OffloadScheduler(manager)
        started = time.perf_counter()
        with anyio.fail_after(BOUND):
            assert await scheduler.lookup([key(1)], timeout=30) == 0
        assert time.perf_counter() - started < BOUND
        assert hang.calls == 1 and not hang.release.is_set()
        assert manager.lookup(key(1)) is LookupResult.MISS
        assert manager.statistics().promotions.failed_by_reason == {"timeout": 1}
        # The hung read was lent the slot and may still write into it: not reusable yet.
        assert pool.table.lent == 1 and pool.statistics().writing == 1
        hang.release.set()
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        await given_back(pool)
        assert pool.statistics().free == 4 and manager.lookup(key(1)) is LookupResult.MISS


async def test_an_abandoned_read_never_writes_into_the_callers_buffer(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    await stored(root, 1)
    async with FSTier(root) as tier:
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        dst = bytearray(BLOCK)
        with anyio.move_on_after(DEADLINE):
            await tier.load(key(1), memoryview(dst))
        dst[:] = b"\xab" * BLOCK  # the slot now holds another block
        hang.release.set()
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        assert dst == b"\xab" * BLOCK
        assert tier.statistics().blocks == 1  # the block itself is fine
        out = bytearray(BLOCK)
        await tier.load(key(1), memoryview(out))
        assert out == data(1)


# -- write-through and close ----------------------------------------------------------------------


async def test_store_deadline_unpins_and_frees_in_flight_bytes(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = HostPool(8, BLOCK)
    tier = FSTier(tmp_path / "c", capacity_bytes=16 * FILE)
    manager = TieringManager(pool, [tier], store_timeout=DEADLINE, max_in_flight_bytes=2 * BLOCK)
    async with manager:
        monkeypatch.setattr(_fs_write, "_writev", hang.wrap(os.writev))
        assert await manager.store([key(1)], [memoryview(data(1))]) == 1
        await hang.wait_entered()
        with anyio.fail_after(BOUND):
            await manager.wait_idle()
        assert not hang.release.is_set()
        s = manager.statistics()
        assert s.pool.pinned == 0 and s.writes.in_flight_bytes == 0
        assert s.writes.failures_by_reason == {"timeout": 1}
        # Write-through to the tier goes on: the stuck write holds no in-flight bytes.
        for i in (2, 3, 4):
            assert await manager.store([key(i)], [memoryview(data(i))]) == 1
            with anyio.fail_after(BOUND):
                await manager.wait_idle()
        s = manager.statistics()
        assert s.writes.started == 4 and s.writes.skipped == 0
        # The mount comes back: the abandoned write lands and is accounted for, once.
        hang.release.set()
        assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
        t = tier.statistics()
        on_disk = sorted(p for p in (tmp_path / "c").glob("??/??/*") if p.name[0] != ".")
        assert t.blocks == len(on_disk) == 4 and t.bytes_stored == 4 * FILE
        assert tier._catalog.reserved == 0


async def test_close_honours_close_timeout(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = HostPool(4, BLOCK)
    manager = TieringManager(pool, [FSTier(tmp_path / "c")], close_timeout=DEADLINE)
    await manager.__aenter__()
    monkeypatch.setattr(_fs_write, "_writev", hang.wrap(os.writev))
    assert await manager.store([key(1)], [memoryview(data(1))]) == 1
    await hang.wait_entered()
    started = time.perf_counter()
    await manager.aclose()
    assert time.perf_counter() - started < BOUND
    assert not hang.release.is_set(), "closed only because the hang was released"
    s = manager.statistics()
    assert s.writes.cancelled == 1 and s.pool.pinned == 0 and s.writes.in_flight_bytes == 0


# -- a stale existence check (the FSTier half) ---------------------------------------------------


async def test_a_stale_check_does_not_drop_a_newer_store(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    target = str(block_file(root, key(1)))

    def stale_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        """Look now, answer after the release: the answer is stale by then."""
        try:
            result, error = os.stat(path, *args, **kwargs), None
        except OSError as exc:
            result, error = None, exc
        hang.entered.set()
        hang.release.wait()
        if error is not None:
            raise error
        assert result is not None
        return result

    async with FSTier(root, capacity_bytes=2 * FILE, lookup_timeout=30, shared=True) as tier:
        monkeypatch.setattr(
            _fs_exists,
            "_stat",
            lambda p, *a, **k: stale_stat(p, *a, **k) if str(p) == target else os.stat(p, *a, **k),
        )
        checked = anyio.Event()
        tier.add_listener(lambda k: checked.set() if k == key(1) else None)
        assert tier.lookup(key(1)) is LookupResult.RETRY
        await hang.wait_entered()  # the check has looked: no file yet
        await tier.store(key(1), memoryview(data(1)))
        hang.release.set()
        with anyio.fail_after(BOUND):
            await checked.wait()
        s = tier.statistics()
        assert s.blocks == 1 and s.bytes_stored == FILE
        for i in (2, 3):  # past capacity: the LRU block (key 1) makes room, as counted
            await tier.store(key(i), memoryview(data(i)))
        on_disk = [p for p in root.glob("??/??/*") if p.name[0] != "."]
        assert len(on_disk) == 2 and tier.statistics().bytes_stored == 2 * FILE


def _open_on(folder: Path) -> int:
    """How many of this process's descriptors are open on ``folder`` itself."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == str(folder)
        except OSError:
            continue  # the listing's own descriptor, closed already
    return count


async def test_a_close_under_a_hung_read_lets_go_of_the_root_once_the_read_returns(
    tmp_path: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "c"
    await stored(root, 1)
    assert _open_on(root) == 0
    tier = FSTier(root)
    async with tier:
        monkeypatch.setattr(_fs_read, "_preadv", hang.wrap(os.preadv))
        with anyio.move_on_after(DEADLINE):
            await tier.load(key(1), memoryview(bytearray(BLOCK)))
        assert tier._files.calls.stuck == 1
    assert _open_on(root) == 1  # the hung read may still use the root's descriptor
    hang.release.set()
    assert await anyio.to_thread.run_sync(tier._files.calls.wait_unstuck, FAILSAFE)
    assert _open_on(root) == 0  # closed by the read's thread as it returned
