"""Bad input across the public API: each call raises a ValueError that says what to fix, and
nothing already stored changes (pool bytes, tier files)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import FSTier, HostPool, MemoryTier, OffloadScheduler, TieringManager

BB = 1024


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


BAD_CALLS: list[tuple[str, Callable[[TieringManager, list[bytes]], Any], str]] = [
    ("store str key", lambda m, k: m.store(["a"], np.zeros((1, BB), np.uint8)), "must be bytes"),  # type: ignore[list-item]
    ("store empty key", lambda m, k: m.store([b""], np.zeros((1, BB), np.uint8)), "1 to 255"),
    ("store one key", lambda m, k: m.store(k[0], np.zeros((1, BB), np.uint8)), "not one key"),  # type: ignore[arg-type]
    ("store count", lambda m, k: m.store(k[:2], np.zeros((3, BB), np.uint8)), "3 blocks"),
    ("store size", lambda m, k: m.store(k[:1], np.zeros((1, BB - 8), np.uint8)), "1016 bytes"),
    ("store shape", lambda m, k: m.store(k[:1], np.zeros((), np.uint8)), "leading block axis"),
    ("store dtype", lambda m, k: m.store(k[:1], np.zeros((1, BB), object)), "numeric dtype"),
    ("store type", lambda m, k: m.store(k[:1], {"a": 1}), "leading block axis"),
    ("load size", lambda m, k: m.load(k[:1], np.zeros((1, BB * 2), np.uint8)), "2048 bytes"),
    ("load list", lambda m, k: m.load(k[:2], [np.zeros(BB, np.uint8)]), "1 blocks but 2 keys"),
    (
        "load strided",
        lambda m, k: m.load(k[:1], np.zeros((1, BB * 2), np.uint8)[:, ::2]),
        "contiguous",
    ),
    ("window 0", lambda m, k: OffloadScheduler(m).lookup(k, sliding_window_size=0), "positive int"),
    ("timeout str", lambda m, k: OffloadScheduler(m).lookup(k, timeout="1"), "non-negative"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "call", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
async def test_bad_calls_change_nothing(
    tmp_path: Path, name: str, call: Callable[[TieringManager, list[bytes]], Any], message: str
) -> None:
    keys = kvtier.block_keys(list(range(8)), 1, namespace=b"bad-input")
    data = np.random.default_rng(1).integers(0, 256, (4, BB), dtype=np.uint8)
    pool = HostPool(8, BB)
    manager = TieringManager(pool, [MemoryTier(), FSTier(tmp_path, fsync="never")])
    async with manager:
        await manager.store(keys[:4], data)
        await manager.wait_idle()
        files = snapshot(tmp_path)
        before = manager.statistics()
        with pytest.raises(ValueError, match=message):
            await call(manager, keys)
        out = np.zeros((4, BB), np.uint8)
        assert await manager.load(keys[:4], out) == 4
        assert (out == data).all()
        after = manager.statistics()
        assert after.pool.ready == before.pool.ready
        assert after.stores.stored == before.stores.stored
        await manager.wait_idle()
        assert snapshot(tmp_path) == files


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda tmp: HostPool(0, BB), "num_blocks must be a positive int"),
        (lambda tmp: HostPool(4, -1), "block_bytes must be a positive int"),
        (lambda tmp: HostPool(4, BB, policy="fifo"), "unknown eviction policy"),
        (lambda tmp: MemoryTier(capacity_bytes=-5), "capacity_bytes"),
        (lambda tmp: FSTier(tmp, fsync="sometimes"), "fsync must be one of"),
        (lambda tmp: FSTier(tmp, capacity_bytes=0), "capacity_bytes"),
        (lambda tmp: FSTier(""), "root must be a folder path"),
        (lambda tmp: kvtier.S3Tier(""), "bucket"),
        (lambda tmp: kvtier.S3Tier("bucket", endpoint_url="ftp://x"), "endpoint_url"),
        (lambda tmp: kvtier.S3Tier("bucket", endpoint_url="not a url"), "endpoint_url"),
        (lambda tmp: TieringManager(HostPool(2, BB), store_timeout=-1), "store_timeout"),
        (lambda tmp: TieringManager(HostPool(2, BB), max_in_flight_bytes=0), "max_in_flight"),
        (lambda tmp: OffloadScheduler(object()), "lookup"),  # type: ignore[arg-type]
        (lambda tmp: OffloadScheduler(TieringManager(HostPool(2, BB)), max_wait=0), "max_wait"),
        (lambda tmp: kvtier.block_keys([1, 2], 0), "block_size"),
        (lambda tmp: kvtier.AsyncLookupManager(None, batch_size=0), "batch_size"),  # type: ignore[arg-type]
    ],
)
def test_bad_construction_says_what_to_fix(
    tmp_path: Path, build: Callable[[Path], object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build(tmp_path)
