"""FSTier never follows a link out of its root (the tier's side; the CLI's is in test_cli).

Whoever can write to a shared folder can replace a shard folder with a symbolic link. The tier
must then never delete, write or read through it: evictions and deletes of blocks whose shard
became a link leave the link's target alone, and a store into such a shard fails (a miss,
``unavailable``) instead of writing elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier import TierUnavailableError
from kvtier.common._format import header_size
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _layout as _fs_layout
from tests.tiers.fs.fs_worker import key_and_data

BLOCK = 4096
FILE = header_size(16) + BLOCK


key, data = key_and_data("l", BLOCK)


def swap_for_link(shard: Path, outside: Path) -> None:
    """Replace the shard folder with a link to ``outside`` holding same-named files."""
    outside.mkdir(exist_ok=True)
    for f in shard.iterdir():
        (outside / f.name).write_bytes(b"precious, and outside the cache")
        f.unlink()
    shard.rmdir()
    os.symlink(outside, shard)


async def test_evictions_and_deletes_never_follow_a_shard_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "c", tmp_path / "outside"
    async with FSTier(root, capacity_bytes=2 * FILE) as tier:
        await tier.store(key(1), memoryview(data(1)))
        await tier.store(key(2), memoryview(data(2)))
        first = _fs_layout.path_of(root, _fs_layout.name_of(key(1)))
        swap_for_link(first.parent, outside)
        await tier.store(key(3), memoryview(data(3)))  # evicts key 1, the least recent
        await tier.delete(key(1))
        with pytest.raises(TierUnavailableError):  # never read through the link
            await tier.load(key(1), memoryview(bytearray(BLOCK)))
        assert (outside / first.name).read_bytes() == b"precious, and outside the cache"


async def test_a_store_into_a_linked_shard_writes_nothing_outside(tmp_path: Path) -> None:
    root, outside = tmp_path / "c", tmp_path / "outside"
    async with FSTier(root) as tier:
        await tier.store(key(1), memoryview(data(1)))
        path = _fs_layout.path_of(root, _fs_layout.name_of(key(1)))
        await tier.delete(key(1))
        swap_for_link(path.parent, outside)
        before = sorted(p.name for p in outside.iterdir())
        with pytest.raises(TierUnavailableError, match="ELOOP"):
            await tier.store(key(1), memoryview(data(1)))
        assert sorted(p.name for p in outside.iterdir()) == before
        assert tier.statistics().failures_by_reason == {"unavailable": 1}
