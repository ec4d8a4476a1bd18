"""The blocking half of ``FSTier`` that writes: plain functions that run in worker threads.

Each operation (open a root, store one block, stat a batch, remove a block) is one
function, so an ``FSTier`` call costs one thread hop and a cancelled caller can never abandon a
file half-written: the thread runs the whole operation (including cleanup of its temporary
file) to the end, then the caller looks at the outcome. Reading a block back and verifying it
is ``_read``'s; where files live and how they are named is ``_layout``'s; making a root and
probing it is ``_root``'s.

Every OS call that moves bytes goes through the module-level names ``_writev`` (here) and
``_preadv`` (in ``_read``), and every existence check through ``_stat``: that is the single
boundary where a test injects ENOSPC or EIO (when the machine cannot give it a real full or
failing filesystem) or a hang (standing in for a hung network mount).

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
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import (
    ALIGNED_FORMAT_VERSION,
    FORMAT_VERSION,
    PAYLOAD_ALIGN,
    IntegrityKey,
    encode_header,
    payload_offset,
)
from kvtier.tiers.fs._layout import (
    FILE_MODE,
    MARKER,
    O_CLOEXEC,
    O_NOFOLLOW,
    Entry,
    Kind,
    open_shard,
    path_of,
    remove_made,
    tmp_name,
    walk,
)
from kvtier.tiers.fs._marker import check_marker
from kvtier.tiers.fs._root import O_DIRECT, make_root, remove_if_stale

__all__ = [
    "ALIGN",
    "O_DIRECT",
    "Corrupt",
    "ReadOutcome",
    "UnusableRootError",
    "WriteOutcome",
    "WrongSize",
    "aligned",
    "block_region",
    "copy_bytes",
    "file_version",
    "open_maybe_direct",
    "prepare_root",
    "region_size",
    "remove_block",
    "staging_size",
    "stat_many",
    "write_block",
]

# O_DIRECT needs file offsets, lengths and memory aligned to the device's logical block; 4096
# covers every common one. Buffers from ``BufferPool`` are page-aligned (mmap).
ALIGN = PAYLOAD_ALIGN

# The OS calls that write and that check existence, named once so tests can inject a fault at
# exactly this boundary.
logger = logging.getLogger("kvtier.tiers.fs")

_writev = os.writev
_stat = os.stat


class Corrupt(Exception):
    """The file failed verification; it has been removed."""


class WrongSize(Exception):
    """The block is intact but the caller's buffer has another size."""

    def __init__(self, stored: int) -> None:
        super().__init__(stored)
        self.stored = stored


class WriteOutcome(enum.Enum):
    WRITTEN = "written"
    EXISTS = "exists"


class ReadOutcome(enum.Enum):
    LOADED = "loaded"
    MISSING = "missing"


# -- opening a root ---------------------------------------------------------------------------


class UnusableRootError(InvalidArgumentError, OSError):
    """An FS tier's root cannot be created or written when the tier opens: a configuration
    error, raised at open with the path and the reason (an ``OSError`` too, as vLLM's own fs
    tier raises). A root that goes away later (a mount lost) is a runtime fault instead: the
    tier's operations fail as ``unavailable`` and lookups miss."""

    def __init__(self, path: Path, exc: OSError) -> None:
        code = errno.errorcode.get(exc.errno or 0, "")
        reason = f"{code}: {exc.strerror}" if code and exc.strerror else str(exc)
        self.message = (
            f"cannot use {str(path)!r} as an FS tier's root: {reason}; give a folder "
            "that this process can create and write"
        )
        InvalidArgumentError.__init__(self, self.message)
        self.path = path
        self.reason = reason
        self.errno = exc.errno
        self.strerror = exc.strerror
        self.filename = str(path)

    def __str__(self) -> str:  # OSError's would show only the errno and the path
        return self.message


def prepare_root(root: Path, marker: dict[str, object] | None = None) -> list[Entry]:
    """Make ``root`` usable and list its blocks, oldest first.

    Creates the root and its missing parents (``make_root``), checks or writes the format
    marker, removes temporary files whose writer is gone, and lists every block file.
    """
    make_root(root)
    check_marker(root, MARKER if marker is None else marker)
    entries: list[Entry] = []
    now = time.time()
    for item in walk(root):
        if item.kind is Kind.BLOCK:
            entries.append(Entry(item.parts[-1], item.size, item.mtime))
        elif item.kind is Kind.TEMPORARY:
            remove_if_stale(item.folder, item.parts[-1], now)
    entries.sort(key=lambda e: e.mtime)
    return entries


# -- blocks ------------------------------------------------------------------------------------


def stat_many(root: Path, names: Sequence[str]) -> list[int | None]:
    """The size of each block file, or None where there is none."""
    sizes: list[int | None] = []
    for name in names:
        try:
            st = _stat(path_of(root, name), follow_symlinks=False)
        except FileNotFoundError:
            sizes.append(None)
        else:
            sizes.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
    return sizes


# Payloads of whole pages from this size on are written in version 2 (aligned, so O_DIRECT
# moves them without a copy); smaller or odd-sized ones in the compact version 1, where the
# padded header would cost more room than the copy it saves.
ALIGNED_MIN_PAYLOAD = 64 << 10


def file_version(payload_bytes: int) -> int:
    """The block format a payload of ``payload_bytes`` is written in."""
    if payload_bytes >= ALIGNED_MIN_PAYLOAD and payload_bytes % ALIGN == 0:
        return ALIGNED_FORMAT_VERSION
    return FORMAT_VERSION


def region_size(header_bytes: int, payload_bytes: int) -> int:
    """Bytes before the payload in the file of a block: its header, padded in version 2."""
    return payload_offset(header_bytes, file_version(payload_bytes))


def block_region(key: bytes, payload: memoryview, integrity_key: IntegrityKey | None) -> bytes:
    """The start of a block file: its header, zero-padded to where the payload starts."""
    version = file_version(payload.nbytes)
    header = encode_header(key, payload, integrity_key=integrity_key, version=version)
    return header.ljust(payload_offset(len(header), version), b"\0")


def aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move ``view``'s bytes as they are: an ``ALIGN``-aligned address
    and a whole number of ``ALIGN`` pieces."""
    if view.nbytes % ALIGN or not view.c_contiguous:
        return False
    return int(np.frombuffer(view, np.uint8).ctypes.data) % ALIGN == 0


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
    store made (if nothing else was put in them). ``new_shard`` is called when a shard folder
    had to be made, which is also how a folder emptied under the tier is noticed.

    A shard folder removed while the block was being written in it (an empty one, by a store
    beside this one that failed) is made again, and the block written again, a few times.
    """
    for attempt in range(1, _ATTEMPTS + 1):
        made: list[int] = []
        try:
            # One walk to the shard serves the check and the write; a level that is missing
            # (so is the block) is made on the way, rather than found missing and walked to.
            dir_fd = open_shard(root, name, create=True, made=made)
            try:
                if made and new_shard is not None:
                    new_shard()
                return _publish(
                    dir_fd, root, name, key, payload, fsync, victims, integrity_key, staging, region
                )
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


# How many times a store makes its shard folder again when it was removed under it.
_ATTEMPTS = 3


def _publish(
    dir_fd: int,
    root: Path,
    name: str,
    key: bytes,
    payload: memoryview,
    fsync: str,
    victims: Sequence[str],
    integrity_key: IntegrityKey | None,
    staging: memoryview | None,
    region: memoryview | None,
) -> tuple[WriteOutcome, int]:
    """``write_block`` in the shard folder open as ``dir_fd``."""
    size = _size_in(dir_fd, name)
    if size is not None:
        return WriteOutcome.EXISTS, size
    for victim in victims:
        remove_block(root, victim)
    header = block_region(key, payload, integrity_key)
    total = len(header) + payload.nbytes
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
    return WriteOutcome.WRITTEN, total


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


def staging_size(header_bytes: int, payload_bytes: int) -> int:
    """Bytes of an aligned buffer that holds a header and payload for an O_DIRECT write."""
    return -(-(header_bytes + payload_bytes) // ALIGN) * ALIGN


def open_maybe_direct(opener: Callable[[int], int], flags: int, direct: bool) -> tuple[int, bool]:
    """``opener(flags)`` with O_DIRECT when asked and the file system takes it (EINVAL: it
    does not); the descriptor and whether it has O_DIRECT."""
    if direct and O_DIRECT:
        try:
            return opener(flags | O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return opener(flags), False


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


def copy_bytes(dst: memoryview, src: memoryview | bytearray) -> None:
    """memcpy without holding the GIL (numpy releases it), so copying threads run in parallel."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def remove_block(root: Path, name: str) -> bool:
    """Unlink the block file ``name``; False when there was none (a shard folder that is a
    link holds nothing of this tier's: it is left alone)."""
    try:
        dir_fd = open_shard(root, name)
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
