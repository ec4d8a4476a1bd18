"""Who writes an FS tier's folder: a tier alone on its folder owns it and answers lookups from
its index (no stat); a second opener joins as a shared writer or, with ``shared=False``, is
refused; the lock dies with its process, kill -9 included."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.streams.buffered
import pytest

from kvtier import CacheIdentity, InvalidArgumentError, LookupResult
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier, _ownership, _upkeep
from kvtier.tiers.fs import _exists as fs_exists
from kvtier.tiers.fs._catalog_files import CHECKPOINT_NAME as CATALOG_PREFIX
from kvtier.tiers.fs._layout import IDENTITY_NAME, MARKER_NAME
from kvtier.tiers.fs._ownership import LOCK_NAME
from tests.support import fresh_keys, run_cli
from tests.tiers.fs.fs_worker import key_of as worker_key
from tests.tiers.fs.fs_worker import served

BLOCK = 4096

HOLDER = """
import sys, anyio
from kvtier.tiers.fs import FSTier

async def main() -> None:
    async with FSTier(sys.argv[1]) as tier:
        print(f"owner {tier.owner}", flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every existence check the FS tier makes on the disk."""
    calls: list[Any] = []
    real = fs_exists._stat

    def counted(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fs_exists, "_stat", counted)
    return calls


async def test_a_tier_alone_owns_its_folder_and_never_stats(
    tmp_path: Path, stats: list[Any]
) -> None:
    stored, unknown = fresh_keys(2)
    async with FSTier(tmp_path / "c") as tier:
        assert tier.owner is True and tier.shared == "auto"
        await tier.store(stored, memoryview(bytes(BLOCK)))
        assert tier.lookup(stored) is LookupResult.HIT
        assert tier.lookup(unknown) is LookupResult.MISS  # at once, never RETRY
    assert stats == []
    assert tier.owner is None  # let go at close


async def test_a_second_opener_joins_as_a_shared_writer_or_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "c"
    first_key, second_key, unknown = fresh_keys(3)
    async with FSTier(root) as first:
        await first.store(first_key, memoryview(bytes(BLOCK)))
        with pytest.raises(InvalidArgumentError, match=f"{root} is in use by another process"):
            await FSTier(root, shared=False).open()
        async with FSTier(root) as second:
            assert second.owner is False
            assert second.lookup(unknown) is LookupResult.RETRY  # it checks the disk
            assert await resolve_lookup(second, first_key) is LookupResult.HIT
            await second.store(second_key, memoryview(bytes(BLOCK)))
            await first._check_folder()  # as it does periodically: it finds the second
            assert first.owner is False
            assert await resolve_lookup(first, second_key) is LookupResult.HIT
    async with FSTier(root, shared=False) as third:  # the folder is free again
        assert third.owner is True
        assert third.lookup(second_key) is LookupResult.HIT  # rebuilt from the files


async def test_shared_true_always_checks_and_keeps_others_from_owning(tmp_path: Path) -> None:
    root = tmp_path / "c"
    (unknown,) = fresh_keys(1)
    async with FSTier(root, shared=True) as shared:
        assert shared.owner is False
        assert shared.lookup(unknown) is LookupResult.RETRY
        async with FSTier(root) as auto:
            assert auto.owner is False
        with pytest.raises(InvalidArgumentError, match="shared=False needs the folder"):
            await FSTier(root, shared=False).open()


async def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with await anyio.open_process(
        [sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE
    ) as holder:
        assert holder.stdout is not None
        lines = anyio.streams.buffered.BufferedByteReceiveStream(holder.stdout)
        with anyio.fail_after(60):
            assert await lines.receive_until(b"\n", 100) == b"owner True"
        async with FSTier(root) as tier:
            assert tier.owner is False
        holder.send_signal(signal.SIGKILL)
        assert await holder.wait() == -signal.SIGKILL
    async with FSTier(root, shared=False) as tier:
        assert tier.owner is True


async def test_a_root_with_missing_parents_is_created_and_owned_at_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "mount" / "c"  # neither the root nor its parent is there yet
    (key,) = fresh_keys(1)
    async with FSTier(root) as tier:
        assert tier.owner is True
        await tier.store(key, memoryview(bytes(BLOCK)))
        assert tier.lookup(key) is LookupResult.HIT
    assert f"missing parent folder(s) {tmp_path / 'mount'}" in caplog.text


async def test_the_lock_file_is_neither_a_block_nor_foreign(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as tier:
        await tier.store(fresh_keys(1)[0], memoryview(bytes(BLOCK)))
    assert (root / LOCK_NAME).exists()
    async with FSTier(root) as tier:
        assert tier.statistics().blocks == 1
    code, out, err = run_cli("verify", str(root))
    assert code == 0, out + err
    code, out, err = run_cli("inspect", "--json", str(root))
    assert code == 0 and '"blocks": 1' in out, out + err


# -- every user of a folder is seen by the others ------------------------------------------------


async def test_a_writer_that_joined_an_owned_folder_keeps_the_next_opener_from_owning_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    async with served(root, "auto") as first:
        assert await first.line() == "opened owner=True"
        async with served(root, "auto") as second:
            assert await second.line() == "opened owner=False"
            await first.quit()  # the owner goes; the second still writes
            async with FSTier(root) as third:
                assert third.owner is False  # the second is there: nobody owns the folder
                assert await second.ask("store 1") == "stored 1"
                assert await resolve_lookup(third, worker_key("w", 1)) is LookupResult.HIT
            await second.quit()


async def test_an_owner_that_finds_a_writer_appear_checks_the_disk(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as owner:
        assert owner.owner is True
        async with served(root, "auto") as writer:
            assert await writer.line() == "opened owner=False"
            assert await writer.ask("store 1") == "stored 1"
            await owner._check_folder()
            assert owner.owner is False
            assert await resolve_lookup(owner, worker_key("w", 1)) is LookupResult.HIT
            await writer.quit()


async def test_a_deleted_lock_file_does_not_let_a_second_process_own_the_folder(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    async with FSTier(root) as owner:
        assert owner.owner is True
        (root / LOCK_NAME).unlink()
        async with served(root, "auto") as second:
            assert await second.line() == "opened owner=False"
            await second.quit()


@pytest.mark.parametrize("first_check", ["owner", "newcomer"])
async def test_a_lock_file_deleted_where_folders_take_no_lock_is_locked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_check: str
) -> None:
    """Where only the lock file is locked (NFS), a check finds it gone or replaced and locks
    the new one: whichever process checks first, both then see each other and neither owns."""

    def refused(root: Path) -> Any:
        raise OSError(errno.ENOLCK, "no locks on folders here")

    monkeypatch.setattr(_ownership, "_lock_folder", refused)
    monkeypatch.setattr(_upkeep, "CHECK_SECONDS", 3600.0)  # the test says when to check
    root = tmp_path / "c"
    async with FSTier(root) as owner:
        assert owner.owner is True
        (root / LOCK_NAME).unlink()
        if first_check == "owner":
            await owner._check_folder()
            assert (root / LOCK_NAME).exists() and owner.owner is True
        async with served(root, "auto", "--no-folder-lock") as second:
            opened = await second.line()
            if first_check == "owner":
                assert opened == "opened owner=False"
            else:  # the deleted file hid the owner until its next check
                assert opened == "opened owner=True"
            await owner._check_folder()
            assert owner.owner is False
            assert await second.ask("check") == "owner False"
            await second.quit()


# -- a folder emptied while in use ---------------------------------------------------------------


def _empty(root: Path) -> None:
    """``rm -rf root/*``, dot files included: blocks, marker, manifest and lock file."""
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


IDENTITY = CacheIdentity(model="m", kv_dtype="bfloat16", block_size=16)


async def test_a_folder_emptied_while_in_use_is_marked_again_by_the_next_store(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    first, second = fresh_keys(2)
    async with FSTier(root, identity=IDENTITY) as tier:
        await tier.store(first, memoryview(bytes(BLOCK)))
        _empty(root)
        await tier.store(second, memoryview(bytes(BLOCK)))  # into a missing shard
        assert (root / MARKER_NAME).exists() and (root / IDENTITY_NAME).exists()
        assert (root / LOCK_NAME).exists()
    async with FSTier(root, identity=IDENTITY) as again:  # the folder opens again
        await again._persistence.walked()  # the catalog kept at close still held the first
        assert again.statistics().blocks == 1
        assert again.lookup(second) is LookupResult.HIT


async def test_a_folder_emptied_while_in_use_is_marked_again_by_the_next_check(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    async with FSTier(root, identity=IDENTITY) as tier:
        await tier.store(fresh_keys(1)[0], memoryview(bytes(BLOCK)))
        _empty(root)
        await tier._check_folder()
        kept = sorted(p.name for p in root.iterdir() if not p.name.startswith(CATALOG_PREFIX))
        assert kept == [IDENTITY_NAME, LOCK_NAME, MARKER_NAME]
        async with served(root, "auto") as second:  # seen by the next opener, too
            assert await second.line() == "opened owner=False"
            await second.quit()
    async with FSTier(root, identity=IDENTITY):
        pass
