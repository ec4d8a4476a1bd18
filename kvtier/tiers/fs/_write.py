"""The blocking half of ``FSTier`` that writes: one block published whole, or removed.

Each operation (store one block, remove one) is one function that runs in a worker thread, so
an ``FSTier`` call costs one thread hop and a cancelled caller can never abandon a file
half-written: the thread runs the whole operation (including cleanup of its temporary file) to
the end, then the caller looks at the outcome. Reading a block back and verifying it is
``_read``'s; where the bytes sit in the file is ``_geometry``'s; where files live and how they
are named is ``_layout``'s; making a root and probing it is ``_root``'s.

Every OS call that writes bytes goes through ``_writev``: that is the single boundary where a
test injects ENOSPC or EIO (when the machine cannot give it a real full or failing filesystem)
or a hang (standing in for a hung network mount).

A write never reads from the caller's buffer while a syscall is in flight: ``FSTier`` copies
the block into a private buffer under ``Handoff.touching()`` first (see ``_calls``), so a
thread abandoned at a deadline cannot touch a pool slot. The one exception is a *pinned*
batch, whose caller waits for the thread however long it takes: it writes from the caller's
buffers directly.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.common._format import IntegrityKey, encode_header, payload_offset
from kvtier.tiers.fs._geometry import ALIGN, file_version
from kvtier.tiers.fs._layout import (
    FILE_MODE,
    O_CLOEXEC,
    O_DIRECT,
    O_NOFOLLOW,
    open_maybe_direct,
    open_shard,
    remove_made,
    tmp_name,
)

__all__ = ["WriteOutcome", "block_region", "remove_block", "write_block"]

# The OS call that writes, named once so tests can inject a fault at exactly this boundary.
_writev = os.writev

# How many times a store makes its shard folder again when it was removed under it.
_ATTEMPTS = 3


class WriteOutcome(enum.Enum):
    WRITTEN = "written"
    EXISTS = "exists"


def block_region(key: bytes, payload: memoryview, integrity_key: IntegrityKey | None) -> bytes:
    """The start of a block file: its header, zero-padded to where the payload starts."""
    version = file_version(payload.nbytes)
    header = encode_header(key, payload, integrity_key=integrity_key, version=version)
    return header.ljust(payload_offset(len(header), version), b"\0")


def write_block(
    root: Path,
    name: str,
    key: bytes,
    payload: memoryview,
    fsync: str,
    victims: Sequence[str],
    *,
    integrity_key: IntegrityKey | None = None,
    staging: memoryview | None = None,
    region: memoryview | None = None,
    new_shard: Callable[[], None] | None = None,
    root_fd: int | None = None,
) -> tuple[WriteOutcome, int]:
    """Publish one block atomically; return the outcome and the file's size.

    With ``staging`` (an ALIGN-aligned buffer of ``staging_size`` bytes holding ``payload``
    after the header region) the file is written with O_DIRECT where the file system takes
    it: no page cache, no write-back later. With ``region`` (aligned, as long as the header
    region) and an ``aligned`` payload, the same straight from ``payload``. Same file anyway.

    An existing block is not rewritten (keys name content, so it holds the same bytes). Else
    ``victims`` are removed to make room, the block goes to a uniquely named temporary file
    beside its final place, is optionally flushed, and is renamed into place. Whatever fails,
    the temporary file is gone when this returns or raises, and so are the shard folders this
    store made (if nothing else was put in them). ``new_shard`` is called when a first-level
    shard folder had to be made, which is how a folder emptied under the tier is noticed
    (``rm -rf root/*`` takes every one). ``root_fd``: a descriptor of ``root`` the shard is
    reached from (``_held``), else ``root`` is opened for it.
    """

    def publish(dir_fd: int) -> tuple[WriteOutcome, int]:
        size = _size_in(dir_fd, name)
        if size is not None:
            return WriteOutcome.EXISTS, size
        for victim in victims:
            remove_block(root, victim, root_fd=root_fd)
        header = block_region(key, payload, integrity_key)
        tmp = tmp_name(name)
        try:
            _write_tmp(dir_fd, tmp, header, payload, fsync, staging, region)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if fsync == "always":
            os.fsync(dir_fd)
        return WriteOutcome.WRITTEN, len(header) + payload.nbytes

    return _in_shard(root, name, publish, new_shard, root_fd)


def _in_shard(
    root: Path,
    name: str,
    publish: Callable[[int], tuple[WriteOutcome, int]],
    new_shard: Callable[[], None] | None,
    root_fd: int | None,
) -> tuple[WriteOutcome, int]:
    """``publish(dir_fd)`` in the shard folder of ``name``, made on the way where missing.

    A shard folder removed while the block was being written in it (an empty one, by a store
    beside this one that failed) is made again, and the block written again, a few times.
    """
    for attempt in range(1, _ATTEMPTS + 1):
        made: list[int] = []
        try:
            # One walk to the shard serves the check and the write; a level that is missing
            # (so is the block) is made on the way, rather than found missing and walked to.
            dir_fd = open_shard(root, name, create=True, made=made, root_fd=root_fd)
            try:
                if 0 in made and new_shard is not None:
                    new_shard()
                return publish(dir_fd)
            finally:
                os.close(dir_fd)
        except FileNotFoundError:
            remove_made(root, name, made)
            if attempt == _ATTEMPTS:
                raise
        except BaseException:
            remove_made(root, name, made)
            raise
    raise AssertionError("unreachable")


def _write_tmp(
    dir_fd: int,
    tmp: str,
    header: bytes,
    payload: memoryview,
    fsync: str,
    staging: memoryview | None,
    region: memoryview | None,
) -> None:
    """Create ``tmp`` in its shard and write the block into it (see ``write_block``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_NOFOLLOW
    want_direct = staging is not None or region is not None
    fd, direct = open_maybe_direct(
        lambda how: os.open(tmp, how, FILE_MODE, dir_fd=dir_fd), flags, want_direct
    )
    try:
        if not direct:
            _write_all(fd, [header, payload])
        elif staging is not None:
            _write_direct(fd, header, staging, len(header) + payload.nbytes)
        elif region is not None:
            region[:] = header
            _write_all(fd, [region, payload])
        if fsync != "never":
            os.fdatasync(fd)
    finally:
        os.close(fd)


def _write_direct(fd: int, header: bytes, staging: memoryview, total: int) -> None:
    """Header and payload side by side in one aligned buffer: the aligned bulk goes past the
    page cache, the last partial page (O_DIRECT cannot write it) through it, so the file is
    exactly ``total`` bytes with no truncate (a truncate costs more than the short write)."""
    staging[: len(header)] = header
    bulk = total - total % ALIGN
    if bulk:
        _write_all(fd, [staging[:bulk]])
    if bulk < total:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
        _write_all(fd, [staging[bulk:total]])


def _size_in(dir_fd: int, name: str) -> int | None:
    """The size of the published block file ``name`` in its shard, or None (a link is not a
    block: the rename replaces it)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = _writev(fd, views)
        if written == 0:  # a regular file never does this; guard against a spin anyway
            raise OSError(errno.EIO, "write made no progress")
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def remove_block(root: Path, name: str, *, root_fd: int | None = None) -> bool:
    """Unlink the block file ``name`` (reached from ``root_fd`` when given); False when there
    was none (a shard folder that is a link holds nothing of this tier's: it is left
    alone)."""
    try:
        dir_fd = open_shard(root, name, root_fd=root_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False
        raise
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)
    return True
