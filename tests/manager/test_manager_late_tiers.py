"""A tier that cannot open does not stop the manager: it opens with the tiers that open, the
others are ``unavailable`` (lookups skip them, writes to them are dropped) and are opened again
in the background until they join, without a restart. ``require_all_tiers`` fails the open
instead. Real parts only: a real SeaweedFS stopped and started, a real socket that never
answers, real FS tiers."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from devtools.silent_endpoint import silent_endpoint
from devtools.weed_server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, WeedServer, ensure_bucket
from kvtier import (
    FSTier,
    HostPool,
    InvalidArgumentError,
    LookupResult,
    MemoryTier,
    MissReason,
    S3Tier,
    TieringManager,
    TierUnavailableError,
)
from kvtier.tiers.fs._persistence import CatalogPersistence
from tests.support import fresh_keys, s3_tier

BLOCK = 4096
UNAVAILABLE = MissReason.UNAVAILABLE.value
# An S3 tier that gives up on a dead endpoint quickly: one attempt per request, short
# timeouts, existence checks on the request path (so a block another node stored is found
# whenever the tier joins, without waiting for a journal refresh).
FAILS_FAST: dict[str, Any] = {
    "connect_timeout": 0.5,
    "read_timeout": 2.0,
    "max_attempts": 1,
    "lookup_mode": "ask",
    "lookup_timeout": 5.0,
}


class WatchedS3Tier(S3Tier):
    """The real S3 tier, with an event set when an open succeeds (the manager marks the
    tier joined in the same step, before the test runs again)."""

    def __init__(self, bucket: str, **settings: Any) -> None:
        super().__init__(bucket, **settings)
        self.opened = anyio.Event()

    async def open(self) -> None:
        await super().open()
        self.opened.set()


def watched_s3(endpoint_url: str, prefix: str, **overrides: Any) -> WatchedS3Tier:
    settings: dict[str, Any] = {
        "prefix": prefix,
        "endpoint_url": endpoint_url,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }
    return WatchedS3Tier(BUCKET, **(settings | overrides))


def blocks(n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(os.urandom(n * BLOCK), dtype=np.uint8).reshape(n, BLOCK)


async def fs_holding(root: Path, key: bytes, block: bytes) -> None:
    """Store ``block`` under ``key`` in the FS folder at ``root`` (as an earlier run did)."""
    async with FSTier(root, fsync="never") as fs:
        await fs.store(key, memoryview(block))


def tasks_left() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


@asynccontextmanager
async def entering(manager: TieringManager) -> AsyncIterator[anyio.Event]:
    """Enter ``manager`` in a task of its own while the block runs: the event is set once it
    has entered; the manager is left when the block ends."""
    entered, leave = anyio.Event(), anyio.Event()

    async def run() -> None:
        async with manager:
            entered.set()
            await leave.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            yield entered
        finally:
            leave.set()


class OpensWhenAllowed(MemoryTier):
    """A MemoryTier whose open fails (``TierUnavailableError``) until ``allow`` is set: a
    tier whose endpoint is down at start and comes back. ``failed`` counts the failed opens
    and is set each time (``attempted``); ``joined`` is set once an open succeeds."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.allowed = False
        self.failed = 0
        self.attempted = anyio.Event()
        self.joined = anyio.Event()

    async def open(self) -> None:
        await anyio.lowlevel.checkpoint()
        if not self.allowed:
            self.failed += 1
            self.attempted.set()
            raise TierUnavailableError("endpoint refused", tier=self.name, operation="open")
        await super().open()
        self.joined.set()


async def test_s3_refusing_then_started_joins_without_a_restart(tmp_path: Path) -> None:
    """FS + S3 with S3's endpoint refusing connections: the manager opens at once and serves
    from FS, S3 is ``unavailable``; a real SeaweedFS then starts on that endpoint and the
    same S3 tier joins: stores reach it and a block another node stored there is a HIT."""
    server = WeedServer(hold_ports=True)  # its ports are chosen and held: connections refused
    prefix = f"t/{uuid.uuid4().hex}"
    keys = fresh_keys(4)
    on_disk, only_in_s3, stored_down, stored_up = keys
    data = blocks(4)
    await fs_holding(tmp_path / "fs", on_disk, data[0].tobytes())
    s3 = watched_s3(server.endpoint_url, prefix, name="s3", **FAILS_FAST)
    fs = FSTier(tmp_path / "fs", fsync="never", name="fs")
    manager = TieringManager(HostPool(8, BLOCK), [fs, s3], store_timeout=20.0)
    try:
        async with manager:  # opens without S3: its first attempt was refused
            opens = manager.statistics().opens
            assert opens.unavailable == ("s3",) and opens.unavailable_tiers == 1
            assert opens.open_failures >= 1
            # FS serves; a key no open tier holds is an ``unavailable`` miss
            assert await manager.wait_settled(on_disk, timeout=30) is LookupResult.HIT
            assert manager.lookup(only_in_s3) is LookupResult.MISS
            assert manager.last_miss_reason == UNAVAILABLE
            assert manager.statistics().lookups.misses_by_reason[UNAVAILABLE] >= 1
            # a store reaches FS; S3's write is dropped, counted by its admission
            assert await manager.store([stored_down], data[2:3]) == 1
            await manager.wait_idle()
            assert fs.lookup(stored_down) is LookupResult.HIT
            (s3_admission,) = (a for a in manager.statistics().admission if a.name == "s3")
            assert s3_admission.dropped_by_cause.get(UNAVAILABLE, 0) >= 1

            # The endpoint comes up; another node stores a block there.
            await server.astart()
            await ensure_bucket(server.endpoint_url, BUCKET)
            async with s3_tier(server, prefix, name="other") as other:
                await other.store(only_in_s3, memoryview(data[1].tobytes()))
                with anyio.fail_after(60):  # the next attempt, after its backoff
                    await s3.opened.wait()
                opens = manager.statistics().opens
                assert opens.unavailable_tiers == 0 and opens.joined_late == 1
                # the same tier instance serves now, without a restart
                assert await manager.wait_settled(only_in_s3, timeout=30) is LookupResult.HIT
                out = np.zeros((1, BLOCK), np.uint8)
                assert await manager.load([only_in_s3], out) == 1
                assert out.tobytes() == data[1].tobytes()
                assert await manager.store([stored_up], data[3:4]) == 1
                await manager.wait_idle()
                assert await other.contains_many([stored_up]) == [True]
        assert manager.statistics().opens.unavailable == ()  # closed: nothing is retried
        assert not s3.is_open
        assert not tasks_left()
    finally:
        await anyio.to_thread.run_sync(server.close)


async def test_s3_endpoint_that_never_answers_does_not_hold_the_open_or_the_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An endpoint that accepts connections and never answers: the manager opens promptly
    (not after the S3 tier's read timeout or open_timeout) and serves from FS; closing it
    cancels the open still in progress and leaves nothing running."""
    keys = fresh_keys(2)
    data = blocks(1)
    await fs_holding(tmp_path / "fs", keys[0], data[0].tobytes())
    async with silent_endpoint() as url:
        # Left alone, one attempt would wait 60 s for the bucket's answer.
        s3 = s3_tier(url, f"t/{uuid.uuid4().hex}", name="s3", read_timeout=60.0, max_attempts=1)
        fs = FSTier(tmp_path / "fs", fsync="never", name="fs")
        # The default tier_answer_wait holds the open, whatever tier_open_wait allows a tier
        # that answered; bounded well below the 60 s one attempt would wait: neither the open
        # nor the close may wait for the silent endpoint.
        manager = TieringManager(HostPool(8, BLOCK), [fs, s3], tier_open_wait=600.0)
        with anyio.fail_after(30):
            async with manager:
                assert manager.statistics().opens.unavailable == ("s3",)
                assert "tier s3 has not answered within tier_answer_wait" in caplog.text
                assert await manager.wait_settled(keys[0], timeout=10) is LookupResult.HIT
                assert manager.lookup(keys[1]) is LookupResult.MISS
                assert manager.last_miss_reason == UNAVAILABLE
        assert not s3.is_open
    assert not tasks_left()


class HeldFSTier(FSTier):
    """The real FS tier whose open waits for ``go`` first, with an event set when it has
    opened (as ``HeldS3Tier``)."""

    def __init__(self, root: Path, **settings: Any) -> None:
        super().__init__(root, **settings)
        self.go, self.opened = anyio.Event(), anyio.Event()

    async def open(self) -> None:
        await self.go.wait()
        await super().open()
        self.opened.set()


class HeldS3Tier(S3Tier):
    """The real S3 tier on a healthy endpoint whose open waits for ``go`` first (a slow
    start: a loaded machine, a cold credential chain): ``opening`` once it has begun."""

    def __init__(self, bucket: str, **settings: Any) -> None:
        super().__init__(bucket, **settings)
        self.opening, self.go, self.opened = anyio.Event(), anyio.Event(), anyio.Event()

    async def open(self) -> None:
        self.opening.set()
        await self.go.wait()
        await super().open()
        self.opened.set()


@pytest.mark.parametrize("deferred", [False, True], ids=["write-through", "deferred"])
async def test_a_healthy_tier_still_opening_joins_late_and_says_what_it_missed(
    tmp_path: Path,
    weed_server: WeedServer,
    caplog: pytest.LogCaptureFixture,
    deferred: bool,
) -> None:
    """A healthy S3 tier whose open outlasts the waits (held before its endpoint answered;
    ``tier_open_wait`` 0, and the FS tier held until the manager has opened, so that no tier
    is in at the open and nothing races the clock: a loaded machine once let the FS open end
    while the S3 tier warmed up) does not hold the manager, and joins when its open ends.
    What it missed is said: a warning
    names it at the open, and each write it could not take is counted as ``unavailable``; a
    tier named in ``deferred`` gets those writes once it joins."""
    keys = fresh_keys(2)
    data = blocks(2)
    s3 = HeldS3Tier(BUCKET, **_s3_settings(weed_server.endpoint_url), name="s3")
    fs = HeldFSTier(tmp_path / "fs", fsync="never", name="fs")
    manager = TieringManager(
        HostPool(8, BLOCK), [fs, s3], tier_open_wait=0.0, deferred=("s3",) if deferred else ()
    )
    with anyio.fail_after(60):
        async with manager:
            await s3.opening.wait()
            assert manager.statistics().opens.unavailable == ("fs", "s3")
            fs.go.set()
            await fs.opened.wait()  # joined in the same step
            assert manager.statistics().opens.unavailable == ("s3",)
            assert "tier s3 has not answered within tier_answer_wait" in caplog.text
            assert await manager.store([keys[0]], data[0:1]) == 1  # while S3 opens
            await manager.wait_idle()
            assert fs.lookup(keys[0]) is LookupResult.HIT
            (admitted,) = (a for a in manager.statistics().admission if a.name == "s3")
            if deferred:  # kept for when it joins
                assert manager.statistics().writes.deferred_pending == 1
            else:
                assert admitted.dropped_by_cause == {UNAVAILABLE: 1}
            s3.go.set()
            await s3.opened.wait()
            opens = manager.statistics().opens
            assert opens.unavailable == () and opens.joined_late == 2  # FS, then S3
            assert opens.open_failures == 0  # slow, not failed
            assert await manager.store([keys[1]], data[1:2]) == 1  # drains the deferred one
            await manager.wait_idle()
            assert manager.statistics().writes.deferred_written == int(deferred)
            held = await s3.contains_many(keys)
            assert held == [deferred, True]  # the first only if deferred
    assert not tasks_left()


class SlowAfterAnswering(S3Tier):
    """The real S3 tier whose open, once the bucket has answered, waits for ``go`` (an S3
    tier listing a large prefix inside its open): ``probed`` once the bucket answered,
    ``opened`` once the open succeeded."""

    def __init__(self, bucket: str, **settings: Any) -> None:
        super().__init__(bucket, **settings)
        self.probed, self.go, self.opened = anyio.Event(), anyio.Event(), anyio.Event()

    async def _probe(self) -> None:
        await super()._probe()
        self.probed.set()
        await self.go.wait()

    async def open(self) -> None:
        await super().open()
        self.opened.set()


@pytest.mark.parametrize("open_wait", [600.0, 0.0], ids=["waited-for", "joins-late"])
async def test_a_tier_that_answered_is_waited_for_up_to_the_open_wait(
    weed_server: WeedServer, caplog: pytest.LogCaptureFixture, open_wait: float
) -> None:
    """An S3 tier whose endpoint answered and whose open then takes its time is a healthy
    tier: the manager waits for it past ``tier_answer_wait`` (0 here), up to
    ``tier_open_wait``, and opens with it; past ``tier_open_wait`` (0) it opens without it,
    says the tier is still opening, and the tier joins late. The waits begin once every tier
    has warmed up: a second tier's warm-up holds them until the S3 tier has answered."""
    s3 = SlowAfterAnswering(BUCKET, **_s3_settings(weed_server.endpoint_url), name="s3")
    warming = WarmsUpSlowly("memory")
    manager = TieringManager(
        HostPool(8, BLOCK), [warming, s3], tier_answer_wait=0.0, tier_open_wait=open_wait
    )
    with anyio.fail_after(60):
        async with entering(manager) as entered:
            await s3.probed.wait()
            warming.go.set()  # the waits begin: the S3 tier has answered
            await anyio.wait_all_tasks_blocked()
            if open_wait:
                assert not entered.is_set()  # waited for
            else:
                await entered.wait()
                assert manager.statistics().opens.unavailable == ("s3",)
                assert "tier s3 is still opening after tier_open_wait" in caplog.text
            s3.go.set()
            await entered.wait()
            await s3.opened.wait()  # joined in the same step
    assert manager.statistics().opens.joined_late == (0 if open_wait else 1)
    assert "has not answered" not in caplog.text
    assert not tasks_left()


async def test_an_fs_tier_reading_its_catalog_is_waited_for_whatever_the_answer_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FS tier does not say when its disk answered (``tells_answer`` False): its open, a
    large catalog read included, is waited for up to ``tier_open_wait`` whatever
    ``tier_answer_wait`` (0 here; the waits begin once the other tier has warmed up, while
    the FS tier reads its catalog)."""
    key, block = fresh_keys(1)[0], blocks(1)[0].tobytes()
    await fs_holding(tmp_path / "fs", key, block)  # a catalog to read at the next open
    reading, go = threading.Event(), threading.Event()
    real = CatalogPersistence.load

    def held(self: CatalogPersistence) -> bool:  # in the open's worker thread
        reading.set()
        go.wait(30)
        return real(self)

    monkeypatch.setattr(CatalogPersistence, "load", held)
    fs = FSTier(tmp_path / "fs", fsync="never", name="fs")
    warming = WarmsUpSlowly("memory")
    manager = TieringManager(
        HostPool(8, BLOCK), [warming, fs], tier_answer_wait=0.0, tier_open_wait=600.0
    )
    with anyio.fail_after(60):
        async with entering(manager) as entered:
            await anyio.to_thread.run_sync(reading.wait, 30)
            warming.go.set()
            await anyio.wait_all_tasks_blocked()
            assert not entered.is_set()  # waited for
            go.set()
            await entered.wait()
            assert manager.statistics().opens.unavailable == ()
    assert manager.statistics().opens.joined_late == 0
    assert not tasks_left()


def _s3_settings(endpoint_url: str) -> dict[str, Any]:
    return {
        "prefix": f"t/{uuid.uuid4().hex}",
        "endpoint_url": endpoint_url,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }


async def test_require_all_tiers_fails_the_open_and_leaves_nothing_open(tmp_path: Path) -> None:
    """``require_all_tiers``: a refused endpoint fails the open as before, naming the tier,
    and the FS tier opened meanwhile is closed again (its folder is free for another)."""
    server = WeedServer(hold_ports=True)  # its ports are held, not listening: refused
    s3 = s3_tier(server, f"t/{uuid.uuid4().hex}", name="s3", **FAILS_FAST)
    fs = FSTier(tmp_path / "fs", fsync="never", name="fs")
    manager = TieringManager(HostPool(8, BLOCK), [fs, s3], require_all_tiers=True)
    try:
        with anyio.fail_after(30), pytest.raises(TierUnavailableError) as caught:
            async with manager:
                pytest.fail("entered although the S3 endpoint refused")
        assert caught.value.tier == "s3" and caught.value.operation == "open"
        assert not s3.is_open
        assert not tasks_left()
        async with FSTier(tmp_path / "fs", fsync="never", shared=False) as alone:
            assert alone.owner  # nothing of the failed open still holds the folder
    finally:
        await anyio.to_thread.run_sync(server.close)


async def test_a_tier_that_fails_to_open_joins_when_it_recovers() -> None:
    """A tier whose open fails: its lookups are ``unavailable`` misses and its writes are
    dropped (counted) until it recovers; then it joins, its blocks are hits and stores reach
    it; closing leaves no task behind."""
    keys = fresh_keys(4)
    data = blocks(4)
    late = OpensWhenAllowed("late")
    await late.store(keys[0], memoryview(data[0].tobytes()))  # held before the manager
    first = MemoryTier("first")
    manager = TieringManager(HostPool(8, BLOCK), [first, late])
    with anyio.fail_after(60):
        async with manager:
            assert late.failed >= 1  # its first attempt ended before the manager opened
            assert manager.statistics().opens.unavailable == ("late",)
            assert manager.lookup(keys[0]) is LookupResult.MISS
            assert manager.last_miss_reason == UNAVAILABLE
            assert manager.lookup(keys[0]) is LookupResult.MISS
            misses = manager.statistics().lookups.misses_by_reason
            assert misses == {UNAVAILABLE: 2}
            assert await manager.store([keys[1]], data[1:2]) == 1
            await manager.wait_idle()
            assert first.lookup(keys[1]) is LookupResult.HIT
            assert late.lookup(keys[1]) is LookupResult.MISS  # dropped, not written
            # it is tried again in the background, and fails again meanwhile
            failed = late.failed
            late.attempted = anyio.Event()
            await late.attempted.wait()
            assert late.failed > failed
            assert manager.statistics().opens.unavailable == ("late",)

            late.allowed = True
            await late.joined.wait()
            opens = manager.statistics().opens
            assert opens.unavailable == () and opens.joined_late == 1
            assert opens.open_failures == late.failed
            assert await manager.wait_settled(keys[0], timeout=10) is LookupResult.HIT
            assert await manager.store([keys[2]], data[2:3]) == 1
            await manager.wait_idle()
            assert late.lookup(keys[2]) is LookupResult.HIT  # written through now
            assert manager.lookup(keys[3]) is LookupResult.MISS
            assert manager.last_miss_reason == MissReason.NOT_FOUND.value
    assert not tasks_left()
    assert manager.statistics().opens.unavailable == ()


async def test_a_tier_that_opens_in_time_is_there_at_once() -> None:
    """The open waits for the tiers that answer: a tier that opens within
    ``tier_open_wait`` is in from the first lookup, and nothing is unavailable."""
    tier = MemoryTier("disk")
    keys = fresh_keys(1)
    await tier.store(keys[0], memoryview(blocks(1)[0].tobytes()))
    async with TieringManager(HostPool(4, BLOCK), [tier]) as manager:
        assert manager.statistics().opens.unavailable == ()
        assert manager.lookup(keys[0]) is LookupResult.RETRY  # its promotion started
        assert await manager.wait_settled(keys[0], timeout=10) is LookupResult.HIT
    assert manager.statistics().opens.joined_late == 0


class WarmsUpSlowly(MemoryTier):
    """A tier whose local preparation (``warm_up``: the S3 tier parses botocore's model)
    waits for ``go``: a fresh process on a busy machine."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.warming, self.go = anyio.Event(), anyio.Event()

    async def warm_up(self) -> None:
        self.warming.set()
        await self.go.wait()


async def test_the_open_wait_starts_once_the_tiers_have_warmed_up() -> None:
    """``tier_open_wait`` bounds how long a tier takes to answer, not how long its process
    takes to prepare: with a wait of 0 s the manager's open still waits for the warm-up, and
    returns once it ended (a tier that fails or hangs after it is not waited for)."""
    tier = WarmsUpSlowly("slow")
    manager = TieringManager(HostPool(4, BLOCK), [tier], tier_open_wait=0.0)
    with anyio.fail_after(30):
        async with entering(manager) as entered:
            await tier.warming.wait()
            await anyio.wait_all_tasks_blocked()
            assert not entered.is_set()  # the 0 s wait has not begun
            tier.go.set()
            await entered.wait()
    assert not tasks_left()


async def test_entered_again_a_tier_that_no_longer_opens_is_unavailable() -> None:
    """Each entry starts afresh: a tier that opened last time but cannot now is not asked."""
    tier = OpensWhenAllowed("again")
    tier.allowed = True
    key = fresh_keys(1)[0]
    await tier.store(key, memoryview(blocks(1)[0].tobytes()))
    manager = TieringManager(HostPool(4, BLOCK), [tier])
    with anyio.fail_after(30):
        async with manager:
            assert manager.statistics().opens.unavailable == ()
        tier.allowed = False
        async with manager:
            assert manager.statistics().opens.unavailable == ("again",)
            assert manager.lookup(key) is LookupResult.MISS
            assert manager.last_miss_reason == UNAVAILABLE
    assert not tasks_left()


class WrongIdentity(MemoryTier):
    """A tier whose open finds a configuration error: retrying cannot fix it."""

    async def open(self) -> None:
        raise InvalidArgumentError("the folder holds another cache identity")


async def test_a_configuration_error_still_fails_the_open() -> None:
    """A configuration error (``InvalidArgumentError``) is not a tier that is down: the open
    fails with it, and the tiers that did open are closed again."""
    first = OpensWhenAllowed("first")
    first.allowed = True
    manager = TieringManager(HostPool(4, BLOCK), [first, WrongIdentity("wrong")])
    with anyio.fail_after(30), pytest.raises(InvalidArgumentError, match="cache identity"):
        async with manager:
            pytest.fail("entered although a tier is misconfigured")
    assert first._listeners == [], "the manager still listens to a tier it closed"
    assert not tasks_left()


async def test_a_failed_fs_open_can_be_opened_again(tmp_path: Path) -> None:
    """An FS tier whose open failed (its root is a file) opens once the root is usable: a
    failed open leaves nothing that blocks the next one."""
    root = tmp_path / "fs"
    root.write_bytes(b"not a folder")
    tier = FSTier(root, fsync="never")
    with pytest.raises(InvalidArgumentError):
        await tier.open()
    await tier.aclose()
    root.unlink()
    async with tier:
        key = fresh_keys(1)[0]
        await tier.store(key, memoryview(blocks(1)[0].tobytes()))
        assert tier.lookup(key) is LookupResult.HIT
    assert not tasks_left()


def test_the_settings_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="tier_answer_wait"):
        TieringManager(HostPool(4, BLOCK), [MemoryTier()], tier_answer_wait=-1.0)
    with pytest.raises(InvalidArgumentError, match="tier_open_wait"):
        TieringManager(HostPool(4, BLOCK), [MemoryTier()], tier_open_wait=-1.0)
    with pytest.raises(InvalidArgumentError, match="require_all_tiers"):
        TieringManager(HostPool(4, BLOCK), [MemoryTier()], require_all_tiers="yes")  # type: ignore[arg-type]
