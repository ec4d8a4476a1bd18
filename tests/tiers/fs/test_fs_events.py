"""The FS tier's events: stored once a block is visible, removed when it goes, and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier import BlockNotFoundError, CorruptBlockError, EventKind, LookupResult, TierEvent
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs import _layout as _fs_layout
from tests.support import fresh_keys

BLOCK = 4096


def payload(i: int) -> memoryview:
    return memoryview(bytes([i]) * BLOCK)


def path_of(root: Path, key: bytes) -> Path:
    return _fs_layout.path_of(root, _fs_layout.name_of(key))


def removed(events: list[TierEvent]) -> list[tuple[bytes, str | None]]:
    return [(k, e.reason) for e in events if e.kind is EventKind.REMOVED for k in e.keys]


async def test_a_store_is_announced_once_its_file_is_in_place(tmp_path: Path) -> None:
    keys = fresh_keys(2)
    async with FSTier(tmp_path / "c", name="disk") as tier:
        await tier.store(keys[0], payload(0))
        assert tier.events.drain() == [TierEvent(EventKind.STORED, (keys[0],), "disk")]
        errors = await tier.store_many(keys, [payload(0), payload(1)])
        assert errors == [None, None]
        events = tier.events.drain()
        assert {e.keys[0] for e in events} <= set(keys) and all(
            e.kind is EventKind.STORED and e.medium == "STORAGE" and e.locality == "LOCAL"
            for e in events
        )
        assert keys[1] in {e.keys[0] for e in events}
        await tier.load(keys[0], memoryview(bytearray(BLOCK)))
        assert tier.events.drain() == []  # a load that finds its block says nothing


async def test_evicted_corrupt_gone_and_deleted_blocks_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "c"
    keys = fresh_keys(6)
    async with FSTier(root) as probe:
        await probe.store(keys[5], payload(5))
        file_bytes = probe.statistics().bytes_stored
    async with FSTier(root, capacity_bytes=3 * file_bytes) as tier:
        for i in range(3):
            await tier.store(keys[i], payload(i))
        tier.events.drain()
        await tier.store(keys[3], payload(3))  # over capacity: the oldest goes
        events = tier.events.drain()
        assert len(removed(events)) == 1 and removed(events)[0][1] == "evicted"
        evicted = removed(events)[0][0]
        assert events[-1] == TierEvent(EventKind.STORED, (keys[3],), tier.name)

        held = [k for k in keys[:4] if k != evicted]
        path_of(root, held[0]).write_bytes(b"not a block")
        with pytest.raises(CorruptBlockError):
            await tier.load(held[0], memoryview(bytearray(BLOCK)))
        path_of(root, held[1]).unlink()  # another process removed it
        with pytest.raises(BlockNotFoundError):
            await tier.load(held[1], memoryview(bytearray(BLOCK)))
        await tier.delete(held[2])
        await tier.delete(held[2])  # nothing left to delete: nothing to say
        assert removed(tier.events.drain()) == [
            (held[0], "corrupt"),
            (held[1], "not_found"),
            (held[2], "deleted"),
        ]


async def test_a_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    keys = fresh_keys(5)
    async with FSTier(tmp_path / "c") as tier:
        tier.events.capacity = 3
        for i, k in enumerate(keys):
            await tier.store(k, payload(i))
        assert [e.keys[0] for e in tier.events.drain()] == keys[:3]
        assert tier.events.dropped == 2 and tier.events.emitted == 3


@pytest.mark.parametrize("shared", [False, True], ids=["owner", "shared"])
async def test_a_miss_of_a_key_nobody_announced_says_nothing(tmp_path: Path, shared: bool) -> None:
    (key,) = fresh_keys(1)
    async with FSTier(tmp_path / "c", shared=shared) as tier:
        assert await resolve_lookup(tier, key) is LookupResult.MISS
        assert await tier.contains_many([key]) == [False]
        with pytest.raises(BlockNotFoundError):
            await tier.load(key, memoryview(bytearray(BLOCK)))
        await tier.delete(key)
        assert tier.events.drain() == []


async def test_a_file_another_process_removes_from_an_owned_folder(tmp_path: Path) -> None:
    """The owner's index is the truth until a load finds the file gone, or the walk after
    the next open does: each is a ``not_found`` removed event."""
    root = tmp_path / "c"
    keys = fresh_keys(2)
    async with FSTier(root, shared=False) as tier:
        for i, key in enumerate(keys):
            await tier.store(key, payload(i))
        tier.events.drain()
        path_of(root, keys[0]).unlink()
        assert tier.lookup(keys[0]) is LookupResult.HIT  # stale, as documented
        with pytest.raises(BlockNotFoundError):
            await tier.load(keys[0], memoryview(bytearray(BLOCK)))
        assert removed(tier.events.drain()) == [(keys[0], "not_found")]
        assert tier.lookup(keys[0]) is LookupResult.MISS
        await tier.aclose()
        path_of(root, keys[1]).unlink()  # while the tier is closed
        await tier.open()
        await tier._persistence.walked()
        assert removed(tier.events.drain()) == [(keys[1], "not_found")]
        assert tier.lookup(keys[1]) is LookupResult.MISS


async def test_the_walk_after_a_reopen_announces_what_changed_while_closed(
    tmp_path: Path,
) -> None:
    """An owner reopened from its kept catalog serves from it at once; the walk that follows
    tells a router both ways what the folder has that the catalog did not say: a file another
    process stored meanwhile is stored, a file removed by hand is removed (``not_found``)."""
    root = tmp_path / "c"
    keys = fresh_keys(3)
    async with FSTier(root, shared=False) as tier:
        for i, key in enumerate(keys[:2]):
            await tier.store(key, payload(i))
    async with FSTier(root, shared=True) as other:  # another process, while it is closed
        await other.store(keys[2], payload(2))
    path_of(root, keys[0]).unlink()  # by hand, while it is closed
    async with FSTier(root, shared=False, name="disk") as tier:
        assert tier.statistics().catalog_from_checkpoint
        await tier._persistence.walked()
        events = tier.events.drain()
        assert removed(events) == [(keys[0], "not_found")]
        assert [e for e in events if e.kind is EventKind.STORED] == [
            TierEvent(EventKind.STORED, (keys[2],), "disk")
        ]
        assert sorted(tier.held_keys()) == sorted(keys[1:])
        assert tier.lookup(keys[2]) is LookupResult.HIT


async def test_a_file_another_process_removes_from_a_shared_folder(tmp_path: Path) -> None:
    """A key answered present whose existence check finds it gone, or whose load does, is
    removed (``not_found``); the key another process wrote too, once this tier saw it."""
    root = tmp_path / "c"
    keys = fresh_keys(3)
    async with FSTier(root, shared=True) as tier, FSTier(root, shared=True) as other:
        for i, key in enumerate(keys[:2]):
            await tier.store(key, payload(i))
        await other.store(keys[2], payload(2))
        assert await resolve_lookup(tier, keys[2]) is LookupResult.HIT  # checked: present
        tier.events.drain()
        for key in keys:
            path_of(root, key).unlink()
        # The check the lookups run again once a verdict is gone from their cache:
        assert await tier.contains_many([keys[0], keys[2]]) == [False, False]
        assert removed(tier.events.drain()) == [(keys[0], "not_found"), (keys[2], "not_found")]
        with pytest.raises(BlockNotFoundError):
            await tier.load(keys[1], memoryview(bytearray(BLOCK)))
        assert removed(tier.events.drain()) == [(keys[1], "not_found")]
        assert await tier.contains_many(keys) == [False] * 3
        assert tier.events.drain() == []  # told once
        assert other.events.drain() == [TierEvent(EventKind.STORED, (keys[2],), other.name)]
