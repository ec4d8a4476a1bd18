"""A folder that lost its ``kvtier-fs.json`` marker but holds only kvtier's files opens again:
a new opener waits for the process that uses the folder to write the marker back, and when
nobody uses it adopts it itself, but only once the blocks it reads were written with its own
settings; a folder with anything foreign in it is still refused."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import anyio
import pytest

from kvtier import CacheIdentity, InvalidArgumentError, LookupResult
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier, _keeper, _ownership
from kvtier.tiers.fs._layout import IDENTITY_NAME, MARKER_NAME
from kvtier.tiers.fs._marker import marker_for
from tests.support import block_files
from tests.tiers.fs.fs_worker import key_and_data, served
from tests.tiers.fs.fs_worker import key_of as worker_key

BLOCK = 4096
SECRET = "correct horse battery staple 0123456789"
OTHER = "another secret, also long enough"
IDENTITY = CacheIdentity(model="m", kv_dtype="bfloat16", block_size=16)
ADOPTED = "adopted"  # what the opener's warning says when it wrote the marker itself

key, data = key_and_data("m", BLOCK)


async def _fill(root: Path, secret: str | None, identity: CacheIdentity | None = None) -> None:
    """Six blocks written by a tier with ``secret`` (None: unsigned), then closed."""
    async with FSTier(root, integrity_key=secret, identity=identity) as tier:
        for i in range(6):
            await tier.store(key(i), memoryview(data(i)))


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by its path below the root, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# -- a live user writes the marker back ---------------------------------------------------------


async def test_an_opener_waits_for_the_user_of_a_folder_to_write_its_marker_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "c"
    caplog.set_level(logging.WARNING, "kvtier.tiers.fs")
    async with served(root, "auto") as user:
        assert await user.line() == "opened owner=True"
        assert await user.ask("store 1") == "stored 1"
        (root / MARKER_NAME).unlink()
        async with FSTier(root) as tier:  # opens once the user's check wrote the marker back
            assert tier.owner is False
            assert await resolve_lookup(tier, worker_key("w", 1)) is LookupResult.HIT
        assert json.loads((root / MARKER_NAME).read_text()) == marker_for(None)
        await user.quit()
    assert ADOPTED not in caplog.text  # the user's marker was the one checked


async def test_an_opener_checks_the_marker_its_user_wrote_back_and_refuses_a_mismatch(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    async with served(root, "auto", "--key", SECRET) as user:
        assert await user.line() == "opened owner=True"
        assert await user.ask("store 1") == "stored 1"
        (root / MARKER_NAME).unlink()
        tier = FSTier(root, integrity_key=OTHER)
        with pytest.raises(InvalidArgumentError, match="signed with another integrity key"):
            await tier.open()
        await tier.aclose()
        assert await user.ask("store 2") == "stored 2"  # the user was never disturbed
        await user.quit()


# -- nobody uses it: the opener adopts it -------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_an_idle_folder_that_lost_its_marker_is_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, secret: str | None
) -> None:
    root = tmp_path / "c"
    caplog.set_level(logging.WARNING, "kvtier.tiers.fs")
    await _fill(root, secret, identity=IDENTITY)
    (root / MARKER_NAME).unlink()  # `rm kvtier-fs.json` on a folder nobody uses
    (root / IDENTITY_NAME).unlink()
    async with FSTier(root, integrity_key=secret, identity=IDENTITY) as tier:
        assert tier.owner is True and tier.statistics().blocks == 6
        for i in range(6):
            assert await resolve_lookup(tier, key(i)) is LookupResult.HIT
    assert json.loads((root / MARKER_NAME).read_text()) == marker_for(tier.integrity_key)
    assert (root / IDENTITY_NAME).exists()
    assert f"{ADOPTED} {root}" in caplog.text and "no other process uses it" in caplog.text
    assert f"wrote {IDENTITY_NAME} and {MARKER_NAME}" in caplog.text


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_a_folder_that_lost_its_marker_with_damaged_blocks_among_its_own_is_adopted(
    tmp_path: Path, secret: str | None
) -> None:
    root = tmp_path / "c"
    await _fill(root, secret)
    (root / MARKER_NAME).unlink()
    files = sorted(block_files(root))
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    files[1].write_bytes(files[2].read_bytes())  # another key's block
    damaged = bytearray(files[3].read_bytes())
    damaged[-1] ^= 0xFF  # a flipped bit in the payload
    files[3].write_bytes(damaged)
    async with FSTier(root, integrity_key=secret) as tier:  # damage is not another setting
        intact = [i for i in range(6) if await resolve_lookup(tier, key(i)) is LookupResult.HIT]
        assert len(intact) >= 2
    assert (root / MARKER_NAME).exists()


async def test_a_user_that_never_writes_the_marker_back_delays_an_open_only_so_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "c"
    caplog.set_level(logging.WARNING, "kvtier.tiers.fs")
    await _fill(root, None)
    (root / MARKER_NAME).unlink()
    monkeypatch.setattr(_keeper, "MARKER_WAIT_SECONDS", 0.2)
    hung = _ownership.claim(root, True)  # holds the folder's locks, never checks the folder
    try:
        with anyio.fail_after(30):
            async with FSTier(root) as tier:
                assert tier.owner is False  # the hung user is still seen
                assert tier.statistics().blocks == 6
    finally:
        hung.release()
    assert "did not write the marker back in time" in caplog.text
    assert json.loads((root / MARKER_NAME).read_text()) == marker_for(None)


async def test_a_folder_whose_users_all_crashed_is_adopted(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with served(root, "auto") as user:
        assert await user.line() == "opened owner=True"
        assert await user.ask("store 1") == "stored 1"
        (root / MARKER_NAME).unlink()
        user.process.send_signal(signal.SIGKILL)  # its locks go with it
        assert await user.process.wait() == -signal.SIGKILL
    async with FSTier(root) as tier:
        assert tier.owner is True
        assert await resolve_lookup(tier, worker_key("w", 1)) is LookupResult.HIT
    assert (root / MARKER_NAME).exists()


# -- never adopted by another configuration, never foreign --------------------------------------


@pytest.mark.parametrize(
    ("written", "opener", "why"),
    [
        (SECRET, None, "this reader has none"),
        (None, SECRET, "not signed"),
        (SECRET, OTHER, "not signed with this tier's key"),
    ],
    ids=["signed-opened-unsigned", "unsigned-opened-signed", "another-key"],
)
async def test_a_folder_that_lost_its_marker_is_never_adopted_by_another_configuration(
    tmp_path: Path, written: str | None, opener: str | None, why: str
) -> None:
    """Adopted by a tier of another configuration, every block would be corrupt to it and
    removed: it refuses instead, says what to do, and leaves every file as it was."""
    root = tmp_path / "c"
    await _fill(root, written)
    (root / MARKER_NAME).unlink()
    before = _files(root)
    tier = FSTier(root, integrity_key=opener)
    with pytest.raises(InvalidArgumentError, match=f"lost its {MARKER_NAME} marker") as refused:
        await tier.open()
    await tier.aclose()
    assert why in str(refused.value) and "not adopting" in str(refused.value)
    assert "integrity key (or none) its blocks were written with" in str(refused.value)
    assert _files(root) == before  # no marker written, no block removed
    async with FSTier(root, integrity_key=written) as right:  # the right settings adopt it
        assert right.statistics().blocks == 6
        assert await resolve_lookup(right, key(5)) is LookupResult.HIT


async def test_a_folder_with_foreign_files_and_no_marker_is_still_refused(tmp_path: Path) -> None:
    root = tmp_path / "c"
    await _fill(root, None)
    (root / MARKER_NAME).unlink()
    (root / "precious.txt").write_text("mine")
    before = _files(root)
    tier = FSTier(root)
    with pytest.raises(InvalidArgumentError, match=r"is not empty and has no .* not a kvtier"):
        await tier.open()
    await tier.aclose()
    assert _files(root) == before
