"""The blocking half of ``FSTier``: plain functions that run in worker threads, never on the loop.

Each public operation (store one block, load one block, stat a batch, prepare a root) is one
function, so an ``FSTier`` call costs one thread hop and a cancelled caller can never abandon a
file half-written: the thread runs the whole operation (including cleanup of its temporary
file) to the end, then the caller looks at the outcome.

Every OS call that moves bytes goes through the module-level names ``_writev`` and ``_preadv``,
and every existence check through ``_stat``: that is the single boundary where a test injects
ENOSPC or EIO (when the machine cannot give it a real full or failing filesystem) or a hang
(standing in for a hung network mount).

A read never lands in the caller's buffer directly, and a write never reads from it while a
syscall is in flight: ``FSTier`` passes private buffers and copies under ``Handoff.touching()``
(see ``_fs_calls``), so a thread abandoned at a deadline cannot touch a pool slot. The one
exception is a *pinned* batch, whose caller waits for the thread however long it takes: it
reads into and writes from the caller's buffers directly.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier._format import (
    FORMAT_VERSION,
    HeaderError,
    IntegrityKey,
    PayloadCheck,
    decode_header,
    encode_header,
    header_size,
)

__all__ = [
    "LAYOUT_VERSION",
    "MARKER_NAME",
    "STALE_TMP_SECONDS",
    "Corrupt",
    "Entry",
    "IncompatibleRoot",
    "ReadOutcome",
    "WriteOutcome",
    "WrongSize",
    "copy_bytes",
    "key_of",
    "marker_for",
    "name_of",
    "path_of",
    "prepare_root",
    "probe_direct",
    "read_block",
    "remove_block",
    "scratch_size",
    "staging_size",
    "stat_many",
    "write_block",
]

LAYOUT_VERSION = 1
MARKER_NAME = "kvtier-fs.json"
_MARKER = {"format": "kvtier-fs", "layout": LAYOUT_VERSION, "block_format": FORMAT_VERSION}
# A temporary file from another host (or from before a reboot) whose writer we cannot ask about
# is removed once it is this old: no store takes anywhere near an hour.
STALE_TMP_SECONDS = 3600.0
_TMP_PREFIX = ".tmp-"
_SHARD = re.compile(r"[0-9a-f]{2}")
_NAME = re.compile(r"[0-9a-f]{2,200}|h[0-9a-f]{64}")
_MAX_HEX_KEY = 100  # longer keys are named by a hash so a file name stays under NAME_MAX
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# O_DIRECT needs file offsets, lengths and memory aligned to the device's logical block; 4096
# covers every common one. Buffers from ``BufferPool`` are page-aligned (mmap).
ALIGN = 4096
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC
_DIR_FLAGS = _ROOT_FLAGS | _O_NOFOLLOW

# The byte-moving OS calls, named once so tests can inject a fault at exactly this boundary.
_writev = os.writev
_preadv = os.preadv
_stat = os.stat


def _host_tag() -> str:
    """Names this host and boot, so a new process can tell a dead local writer's temporary
    file (pid gone) from one that another machine on a shared filesystem is still writing."""
    boot = b""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()
    return hashlib.blake2b(socket.gethostname().encode() + b"/" + boot, digest_size=4).hexdigest()


HOST_TAG = _host_tag()


class IncompatibleRoot(Exception):
    """The root was written by another format, or is not a kvtier folder; never touched."""


class Corrupt(Exception):
    """The file failed verification; it has been removed."""


class WrongSize(Exception):
    """The block is intact but the caller's buffer has another size."""

    def __init__(self, stored: int) -> None:
        super().__init__(stored)
        self.stored = stored


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    size: int
    mtime: float


class WriteOutcome(enum.Enum):
    WRITTEN = "written"
    EXISTS = "exists"


class ReadOutcome(enum.Enum):
    LOADED = "loaded"
    MISSING = "missing"


# -- names and paths ---------------------------------------------------------------------------


def name_of(key: bytes) -> str:
    """File name of ``key``: its hex (only ``[0-9a-f]``, so it can never name a path outside the
    root), or ``h`` + a hash of it for keys too long for one file name."""
    if len(key) <= _MAX_HEX_KEY:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def key_of(name: str) -> bytes | None:
    """The key a file name stands for, when the name says it (hashed names do not)."""
    return None if name.startswith("h") else bytes.fromhex(name)


def _shard_of(name: str) -> str:
    if _NAME.fullmatch(name) is None:  # belt and braces: names come from name_of only
        raise AssertionError(f"refusing unsafe block file name {name!r}")
    # Shard on the last four hex digits: keys from ``block_keys`` start with their scheme
    # version byte, so the first digits would put every block under one folder.
    return name.rjust(4, "0")[-4:]


def path_of(root: Path, name: str) -> Path:
    """Where the block file ``name`` lives (for reports and existence checks; the operations
    that read, write or delete reach it through ``_open_shard`` instead)."""
    shard = _shard_of(name)
    return root / shard[0:2] / shard[2:4] / name


def _open_shard(root: Path, name: str, *, create: bool = False) -> int:
    """A descriptor of ``name``'s shard folder, reached from ``root`` one level at a time
    without following a symbolic link: whoever can write to a shared folder must not be able
    to make this process write, read or delete outside it by planting a link as a shard
    folder. A link there raises ``OSError`` (ELOOP); a missing level ``FileNotFoundError``
    unless ``create``. The caller closes the descriptor."""
    shard = _shard_of(name)
    fd = os.open(root, _ROOT_FLAGS)
    try:
        for level in (shard[0:2], shard[2:4]):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(level, _DIR_MODE, dir_fd=fd)
            try:
                inner = os.open(level, _DIR_FLAGS, dir_fd=fd)
            except NotADirectoryError as exc:
                raise OSError(errno.ELOOP, f"shard {level} is not a folder") from exc
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- opening a root ----------------------------------------------------------------------------


def marker_for(integrity_key: IntegrityKey | None) -> dict[str, object]:
    """The format marker a tier with (or without) an integrity key writes and expects. A
    signed folder names its MAC and the key's public fingerprint, so a node with no key or
    another key refuses the folder at open, instead of calling every block corrupt and
    removing the blocks its peers wrote."""
    if integrity_key is None:
        return dict(_MARKER)
    return {**_MARKER, "integrity": {"mac": "blake2b-256", "key_id": integrity_key.key_id}}


def prepare_root(root: Path, marker: dict[str, object] | None = None) -> list[Entry]:
    """Make ``root`` usable and list its blocks, oldest first.

    Creates the root (only its last component: a missing parent usually means a filesystem
    that is not mounted, and writing under it would fill the wrong disk), checks or writes the
    format marker, removes temporary files whose writer is gone, and lists every block file.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, _DIR_MODE)
    _check_marker(root, _MARKER if marker is None else marker)
    entries: list[Entry] = []
    now = time.time()
    for first in _subdirs(root):
        for second in _subdirs(first):
            with os.scandir(second) as it:
                for item in it:
                    if item.name.startswith(_TMP_PREFIX):
                        _maybe_remove_tmp(item, now)
                    elif _NAME.fullmatch(item.name) is not None:
                        with contextlib.suppress(FileNotFoundError):
                            st = item.stat(follow_symlinks=False)
                            if stat.S_ISREG(st.st_mode):
                                entries.append(Entry(item.name, st.st_size, st.st_mtime))
    entries.sort(key=lambda e: e.mtime)
    return entries


def _subdirs(folder: str | Path) -> list[str]:
    with os.scandir(folder) as it:
        return [
            e.path
            for e in it
            if _SHARD.fullmatch(e.name) is not None and e.is_dir(follow_symlinks=False)
        ]


def _check_marker(root: Path, expected: dict[str, object]) -> None:
    marker = root / MARKER_NAME
    try:
        raw = marker.read_bytes()
    except FileNotFoundError:
        foreign = [n for n in os.listdir(root) if not n.startswith(".kvtier-fs")]
        if foreign:
            raise IncompatibleRoot(
                f"{root} is not empty and has no {MARKER_NAME} marker, so it is not a kvtier "
                "folder; point FSTier at an empty folder or at one kvtier created"
            ) from None
        _write_marker(root, expected)
        return
    try:
        found = json.loads(raw)
    except ValueError:
        found = None
    if found != expected:
        if isinstance(found, dict) and {**found, "integrity": None} == {
            **expected,
            "integrity": None,
        }:
            raise IncompatibleRoot(_integrity_mismatch(root, found, expected))
        raise IncompatibleRoot(
            f"{root} holds kvtier-fs data in another format ({MARKER_NAME} says {found!r}; this "
            f"kvtier writes {expected!r}); point FSTier at another folder, or empty this one to "
            "start a fresh cache"
        )


def _integrity_mismatch(root: Path, found: dict[str, object], expected: dict[str, object]) -> str:
    have, want = found.get("integrity"), expected.get("integrity")
    if want is None:
        return (
            f"{root} holds blocks signed with an integrity key; set integrity_key "
            "(KVTIER_INTEGRITY_KEY) to the key every node sharing this folder uses"
        )
    if have is None:
        return (
            f"{root} holds unsigned blocks, and this tier has an integrity key: point it at an "
            "empty folder, or empty this one, to start a signed cache"
        )
    return (
        f"{root} is signed with another integrity key (key id {have!r}, this tier's "
        f"{want!r}); every node sharing a folder must set the same key"
    )


def _write_marker(root: Path, marker: dict[str, object]) -> None:
    tmp = root / f".kvtier-fs.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, _FILE_MODE)
    try:
        os.write(fd, json.dumps(marker).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, root / MARKER_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(root)


def _maybe_remove_tmp(item: os.DirEntry[str], now: float) -> None:
    """Remove a temporary file left by a writer that is gone: one on this host whose process
    is dead, or any older than ``STALE_TMP_SECONDS``."""
    parts = item.name.split("-")  # .tmp-<host>-<pid>-<random>-<name>
    stale = False
    if len(parts) >= 5 and parts[1] == HOST_TAG and parts[2].isdigit():
        pid = int(parts[2])
        stale = pid != os.getpid() and not _pid_alive(pid)
    if not stale:
        with contextlib.suppress(OSError):
            stale = now - item.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS
    if stale:
        with contextlib.suppress(OSError):
            os.unlink(item.path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
) -> tuple[WriteOutcome, int]:
    """Publish one block atomically; return the outcome and the file's size.

    With ``staging`` (an ALIGN-aligned buffer of ``staging_size`` bytes whose bytes from
    the header's length on are ``payload``) the file is written with O_DIRECT where the file
    system takes it: no copy into the page cache, no write-back later. Same file either way.

    An existing block is not rewritten (keys name content, so it holds the same bytes). Else
    ``victims`` are removed to make room, the block goes to a uniquely named temporary file
    beside its final place, is optionally flushed, and is renamed into place. Whatever fails,
    the temporary file is gone when this returns or raises.
    """
    size = _existing_size(root, name)
    if size is not None:
        return WriteOutcome.EXISTS, size
    for victim in victims:
        remove_block(root, victim)
    header = encode_header(key, payload, integrity_key=integrity_key)
    total = len(header) + payload.nbytes
    dir_fd = _open_shard(root, name, create=True)
    try:
        tmp = f"{_TMP_PREFIX}{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}-{name}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW
        fd, direct = _open_maybe_direct(tmp, flags, staging is not None, dir_fd)
        try:
            try:
                if direct and staging is not None:
                    # Header and payload side by side in one aligned buffer: the aligned
                    # bulk goes past the page cache, the last partial page (O_DIRECT cannot
                    # write it) through it, so the file is exactly ``total`` bytes with no
                    # truncate (measured: a truncate costs more than the short write).
                    staging[: len(header)] = header
                    bulk = total - total % ALIGN
                    if bulk:
                        _write_all(fd, [staging[:bulk]])
                    if bulk < total:
                        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
                        _write_all(fd, [staging[bulk:total]])
                else:
                    _write_all(fd, [header, payload])
                if fsync != "never":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if fsync == "always":
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return WriteOutcome.WRITTEN, total


def staging_size(header_bytes: int, payload_bytes: int) -> int:
    """Bytes of an aligned buffer that holds a header and payload for an O_DIRECT write."""
    return -(-(header_bytes + payload_bytes) // ALIGN) * ALIGN


def _open_maybe_direct(path: str, flags: int, direct: bool, dir_fd: int) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and the file system takes it (EINVAL: it does not)."""
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, _FILE_MODE, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, _FILE_MODE, dir_fd=dir_fd), False


def probe_direct(root: Path) -> bool:
    """Whether files under ``root`` take O_DIRECT writes of ``ALIGN`` bytes (tmpfs before
    Linux 6.6, some FUSE and network file systems refuse them)."""
    if not _O_DIRECT:
        return False
    probe = root / f".kvtier-fs-probe-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW
    try:
        fd = os.open(probe, flags | _O_DIRECT, _FILE_MODE)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, ALIGN) as page:
            os.write(fd, page)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _existing_size(root: Path, name: str) -> int | None:
    """The size of the published block file ``name``, or None (a link is not a block: the
    rename replaces it)."""
    try:
        dir_fd = _open_shard(root, name)
    except FileNotFoundError:
        return None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)
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


READ_CHUNK = 256 << 10  # small enough to stay in a core's cache between read, hash and copy
# O_DIRECT reads are synchronous device requests: small ones cost more CPU per byte than the
# cache misses they save (256 KiB pieces measured ~2.5x the CPU of one 2 MiB read here), so
# a block is read whole, up to this size.
DIRECT_CHUNK = 4 << 20


def scratch_size(direct: bool, header_bytes: int, payload_bytes: int) -> int:
    """The private buffer a read of one block goes through (see ``read_block``)."""
    if not direct:
        return READ_CHUNK
    return min(staging_size(header_bytes, payload_bytes), DIRECT_CHUNK)


def read_block(
    root: Path,
    name: str,
    key: bytes,
    dst: memoryview,
    scratch: memoryview | None,
    touching: Callable[[], AbstractContextManager[None]],
    *,
    integrity_key: IntegrityKey | None = None,
    direct: bool = False,
) -> ReadOutcome:
    """Read the block of ``key`` into ``dst`` and verify it before it counts as loaded.

    The file is read piece by piece into ``scratch`` (a private buffer, ``READ_CHUNK`` bytes
    is plenty), each piece is hashed while it is in the cache and then copied into ``dst``
    inside ``touching()``: a read that hangs hangs on ``scratch``, never on ``dst``, and a
    caller that gave up is never written to (``touching`` raises). Raises ``Corrupt`` (after
    removing the file) when the header, key, length or checksum (or MAC) is wrong, and
    ``WrongSize`` when the block is intact but ``dst`` has another size; ``dst`` may hold
    part of the block then.

    With ``scratch=None`` the pieces are read straight into ``dst`` (no copy): only for a
    caller that waits for this call to return, whatever happens (``FSTier``'s pinned batches).
    With ``direct`` (and an ALIGN-aligned ``scratch`` of a multiple of ALIGN bytes) the file
    is read with O_DIRECT where the file system takes it: past the page cache, whole aligned
    pieces from the start of the file, each hashed and copied out while it is in the cache.
    """
    try:
        dir_fd = _open_shard(root, name)
    except FileNotFoundError:
        return ReadOutcome.MISSING
    try:
        flags = os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW
        try:
            fd, direct = _open_maybe_direct(name, flags, direct and scratch is not None, dir_fd)
        except FileNotFoundError:
            return ReadOutcome.MISSING
        try:
            if direct and scratch is not None:
                _read_verified_direct(fd, key, dst, scratch, touching, integrity_key)
            else:
                _read_verified(fd, key, dst, scratch, touching, integrity_key)
        except HeaderError as exc:
            _remove_if_same(dir_fd, name, fd)
            raise Corrupt(str(exc)) from exc
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return ReadOutcome.LOADED


def _read_verified(
    fd: int,
    key: bytes,
    dst: memoryview,
    scratch: memoryview | None,
    touching: Callable[[], AbstractContextManager[None]],
    integrity_key: IntegrityKey | None,
) -> None:
    size = os.fstat(fd).st_size
    header_buf = bytearray(header_size(len(key), integrity_key=integrity_key))
    got = _read_all(fd, [memoryview(header_buf)], 0)
    if got < len(header_buf):
        raise HeaderError(f"file is {size} bytes, shorter than its header")
    header = decode_header(header_buf, integrity_key=integrity_key)
    if header.key != key:
        raise HeaderError("block belongs to another key")
    expected = len(header_buf) + header.payload_length
    if size != expected:
        raise HeaderError(f"file is {size} bytes, header says {expected}")
    if header.payload_length != dst.nbytes:
        raise WrongSize(header.payload_length)
    check = PayloadCheck(key, header, integrity_key=integrity_key)
    done = 0
    chunk = READ_CHUNK if scratch is None else scratch.nbytes
    while done < dst.nbytes:
        n = min(chunk, dst.nbytes - done)
        piece = dst[done : done + n] if scratch is None else scratch[:n]
        got = _read_all(fd, [piece], len(header_buf) + done)
        if got != n:
            raise HeaderError(f"read {len(header_buf) + done + got} bytes of {expected}")
        check.update(piece)
        if scratch is not None:
            with touching():
                copy_bytes(dst[done : done + n], piece)
        done += n
    check.finish()


def _read_verified_direct(
    fd: int,
    key: bytes,
    dst: memoryview,
    scratch: memoryview,
    touching: Callable[[], AbstractContextManager[None]],
    integrity_key: IntegrityKey | None,
) -> None:
    """``_read_verified`` for a file opened with O_DIRECT: reads start at aligned offsets,
    so the header arrives with the first piece of the payload."""
    size = os.fstat(fd).st_size
    hlen = header_size(len(key), integrity_key=integrity_key)
    chunk = scratch.nbytes
    got = _read_aligned(fd, scratch, 0)
    if got < hlen:
        raise HeaderError(f"file is {size} bytes, shorter than its header")
    header = decode_header(scratch[:hlen], integrity_key=integrity_key)
    if header.key != key:
        raise HeaderError("block belongs to another key")
    expected = hlen + header.payload_length
    if size != expected:
        raise HeaderError(f"file is {size} bytes, header says {expected}")
    if header.payload_length != dst.nbytes:
        raise WrongSize(header.payload_length)
    check = PayloadCheck(key, header, integrity_key=integrity_key)
    offset = 0  # of scratch[0] in the file
    while True:
        valid = min(got, size - offset)
        start = max(hlen - offset, 0)
        if valid > start:
            piece = scratch[start:valid]
            check.update(piece)
            with touching():
                copy_bytes(dst[offset + start - hlen : offset + valid - hlen], piece)
        offset += got
        if offset >= size:
            break
        if got != chunk:
            raise HeaderError(f"read {offset} bytes of {expected}")
        got = _read_aligned(fd, scratch, offset)
    check.finish()


def _read_aligned(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from the aligned ``offset``; fewer bytes only at the end of the file."""
    total = 0
    while total < view.nbytes:
        got = _preadv(fd, [view[total:]], offset + total)
        total += got
        if got == 0 or total % ALIGN:
            break  # the end of the file
    return total


def copy_bytes(dst: memoryview, src: memoryview | bytearray) -> None:
    """memcpy without holding the GIL (numpy releases it), so copying threads run in parallel."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _read_all(fd: int, views: list[memoryview], offset: int) -> int:
    total = 0
    while views:
        got = _preadv(fd, views, offset)
        if got == 0:
            break  # end of file: a short (truncated) file
        total += got
        offset += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views.pop(0)
        if got:
            views[0] = views[0][got:]
    return total


def _remove_if_same(dir_fd: int, name: str, fd: int) -> None:
    """Unlink ``name`` only if it is still the file we read, so a good block another process
    published there in the meantime survives."""
    with contextlib.suppress(OSError):
        mine = os.fstat(fd)
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(name, dir_fd=dir_fd)


def remove_block(root: Path, name: str) -> bool:
    """Unlink the block file ``name``; False when there was none (a shard folder that is a
    link holds nothing of this tier's: it is left alone)."""
    try:
        dir_fd = _open_shard(root, name)
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
