"""The blocking half of ``FSTier`` that reads: one block back from its file, verified.

``read_verified`` runs in a worker thread and reads a block piece by piece, hashing each piece
while it is in the cache, so its bytes count as loaded only once the header (magic, version,
key, length) and the payload's checksum (or MAC) match; a file that fails is removed, if it is
still the file that was read. ``_preadv`` is the one OS call that reads, named once so tests
can inject a fault or a hang at exactly this boundary.

A read lands in the caller's buffer while a syscall is in flight only when the caller lets
it: a *pinned* batch, whose caller waits for the thread however long it takes, or a *lent*
one, whose caller keeps each buffer a thread it walked away from may still write
(``kvtier.common._lending``). Otherwise it lands in a private buffer and is copied into the caller's
under ``Handoff.touching()`` (see ``_calls``), so a thread abandoned at a deadline cannot write
into a pool slot that may hold another block by then.

A version 2 file read straight into the caller's buffer by O_DIRECT is read through the page
cache instead when the cache holds all of it (``cachestat``, Linux 6.5 on): a memcpy, where
O_DIRECT would read the device again. Asking costs one call that does no I/O; a buffered read
that refuses to wait (``RWF_NOWAIT``) would say the same but starts the read-ahead of a file it
does not find, which then competes with the O_DIRECT read for the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import mmap
import os
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from kvtier.common._format import (
    FLAG_MAC,
    BlockHeader,
    HeaderError,
    IntegrityKey,
    PayloadCheck,
    decode_header,
    header_size,
)
from kvtier.tiers.fs._calls import copy_bytes
from kvtier.tiers.fs._geometry import ALIGN, READ_CHUNK, READ_VERSIONS
from kvtier.tiers.fs._layout import (
    O_DIRECT,
    READ_FLAGS,
    Kind,
    key_of,
    name_of,
    open_block,
    open_maybe_direct,
    open_shard,
    remove_if_same,
    walk,
)

__all__ = [
    "Corrupt",
    "ReadOutcome",
    "WrongSize",
    "all_cached",
    "checked_header",
    "knows_cache",
    "read_verified",
    "unlike",
]

# The OS call that reads, named once so tests can inject a fault at exactly this boundary.
_preadv = os.preadv


class Corrupt(Exception):
    """The file failed verification; it has been removed."""


class WrongSize(Exception):
    """The block is intact but the caller's buffer has another size."""

    def __init__(self, stored: int) -> None:
        super().__init__(stored)
        self.stored = stored


class ReadOutcome(enum.Enum):
    LOADED = "loaded"
    MISSING = "missing"


# Any key: what decodes a signed header to read its flags, never to verify a MAC.
_ANY_KEY = IntegrityKey(bytes(32))


def read_verified(
    root: Path,
    name: str,
    key: bytes,
    dst: memoryview,
    scratch: memoryview | None,
    touching: Callable[[], AbstractContextManager[None]],
    *,
    integrity_key: IntegrityKey | None = None,
    direct: bool = False,
    region: memoryview | None = None,
    root_fd: int | None = None,
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
    With ``direct`` and no ``scratch``, ``region`` (aligned, as long as a version 2 header's
    padded region) and an aligned ``dst``, the disk fills ``dst`` itself, in one request with
    the header, and the checksum runs over the bytes where they landed (an older, unaligned
    file is read through the page cache instead). ``root_fd``: a descriptor of ``root``
    that the file is opened from (``_held``), else ``root`` is opened for it.
    """
    use_direct = direct and (scratch is not None or region is not None)
    try:
        fd, direct = open_maybe_direct(
            lambda flags: open_block(root, name, flags, root_fd=root_fd), READ_FLAGS, use_direct
        )
    except FileNotFoundError:
        return ReadOutcome.MISSING
    try:
        if direct and scratch is not None:
            _read_direct(fd, key, dst, scratch, touching, integrity_key)
        elif direct and region is not None:
            _read_into(fd, key, dst, region, touching, integrity_key)
        else:
            _read_buffered(fd, key, dst, scratch, touching, integrity_key)
    except HeaderError as exc:
        with contextlib.suppress(OSError):
            _remove_if_same(root, name, fd, root_fd)
        raise Corrupt(str(exc)) from exc
    finally:
        os.close(fd)
    return ReadOutcome.LOADED


def unlike(root: Path, integrity_key: IntegrityKey | None, most: int) -> tuple[str, str] | None:
    """Why a tier with ``integrity_key`` (or none) must not adopt ``root``, a folder that lost
    its marker: where and why, or None when it may. Nothing is removed.

    Up to ``most`` block files are read. One whose header is intact but signed the other way
    (signed where this tier has no key, or unsigned and intact where it has one) was written
    with other settings: refused at once, since adopting would call every such block corrupt
    and remove it. A block that fails its checks otherwise may be damaged (a torn or flipped
    file, which any tier would remove) or signed with another key, which cannot be told
    apart one block at a time; so the folder is adopted only when at least one block read
    verifies as this tier's own (or there are none)."""
    read, first_failure = 0, None
    with contextlib.closing(walk(root)) as items:
        for item in items:
            if item.kind is not Kind.BLOCK:
                continue
            name = item.parts[-1]
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=item.folder)
            except FileNotFoundError:
                continue  # evicted while we looked
            try:
                problem = _unreadable(fd, name, integrity_key)
                other = problem is not None and _other_settings(fd, name, integrity_key)
            finally:
                os.close(fd)
            where = "/".join(item.parts)
            if problem is None:
                return None  # one block of its own: the rest are its own or damaged
            if other:
                return where, f"{problem}; the block is intact under the other signing setting"
            first_failure = first_failure or (where, problem)
            read += 1
            if read >= most:
                break
    return first_failure


def _other_settings(fd: int, name: str, integrity_key: IntegrityKey | None) -> bool:
    """Whether the block file verifies as far as it can under the other signing setting:
    signed with an intact header where this tier has no key (its MAC cannot be checked
    without the key), or unsigned and whole where it has one."""
    if integrity_key is None:
        try:
            head = os.pread(fd, ALIGN, 0)
            header = decode_header(head, integrity_key=_ANY_KEY, versions=READ_VERSIONS)
        except HeaderError:
            return False
        return bool(header.flags & FLAG_MAC)
    return _unreadable(fd, name, None) is None


def _unreadable(fd: int, name: str, integrity_key: IntegrityKey | None) -> str | None:
    """Why the block file ``name`` open at ``fd`` is not an intact block of a reader with
    ``integrity_key``, or None when it is."""
    try:
        _verify_file(fd, name, integrity_key)
    except HeaderError as exc:
        return str(exc)
    return None


def _verify_file(fd: int, name: str, integrity_key: IntegrityKey | None) -> None:
    """Read the block file ``name`` open at ``fd`` whole and verify it (``HeaderError``)."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, ALIGN, 0)  # any header fits: a key is at most 255 bytes
    header = decode_header(head, integrity_key=integrity_key, versions=READ_VERSIONS)
    key = key_of(name)
    if key is None:  # named by a hash of its key: the name must be that hash
        key = header.key if name_of(header.key) == name else b""
    check = PayloadCheck(key, header, integrity_key=integrity_key)
    offset, end = header.payload_offset, header.payload_offset + header.payload_length
    if size != end:
        raise HeaderError(f"file is {size} bytes, header says {end}")
    while offset < end:
        piece = os.pread(fd, min(READ_CHUNK, end - offset), offset)
        if not piece:
            raise HeaderError(f"read {offset} bytes of {end}")
        check.update(piece)
        offset += len(piece)
    check.finish()


def _remove_if_same(root: Path, name: str, fd: int, root_fd: int | None) -> None:
    dir_fd = open_shard(root, name, root_fd=root_fd)
    try:
        remove_if_same(dir_fd, name, fd)
    finally:
        os.close(dir_fd)


def _read_buffered(
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
    header = checked_header(header_buf, key, size, dst, integrity_key)
    start = header.payload_offset
    expected = start + header.payload_length
    check = PayloadCheck(key, header, integrity_key=integrity_key)
    done = 0
    chunk = READ_CHUNK if scratch is None else scratch.nbytes
    while done < dst.nbytes:
        n = min(chunk, dst.nbytes - done)
        piece = dst[done : done + n] if scratch is None else scratch[:n]
        got = _read_all(fd, [piece], start + done)
        if got != n:
            raise HeaderError(f"read {start + done + got} bytes of {expected}")
        check.update(piece)
        if scratch is not None:
            with touching():
                copy_bytes(dst[done : done + n], piece)
        done += n
    check.finish()


def _read_direct(
    fd: int,
    key: bytes,
    dst: memoryview,
    scratch: memoryview,
    touching: Callable[[], AbstractContextManager[None]],
    integrity_key: IntegrityKey | None,
) -> None:
    """``_read_buffered`` for a file opened with O_DIRECT: reads start at aligned offsets,
    so the header arrives with the first piece of the payload."""
    size = os.fstat(fd).st_size
    hlen = header_size(len(key), integrity_key=integrity_key)
    chunk = scratch.nbytes
    got = _read_aligned(fd, scratch, 0)
    if got < hlen:
        raise HeaderError(f"file is {size} bytes, shorter than its header")
    header = checked_header(scratch[:hlen], key, size, dst, integrity_key)
    payload_start = header.payload_offset
    expected = payload_start + header.payload_length
    check = PayloadCheck(key, header, integrity_key=integrity_key)
    offset = 0  # of scratch[0] in the file
    while True:
        valid = min(got, size - offset)
        start = max(payload_start - offset, 0)
        if valid > start:
            piece = scratch[start:valid]
            check.update(piece)
            with touching():
                copy_bytes(
                    dst[offset + start - payload_start : offset + valid - payload_start], piece
                )
        offset += got
        if offset >= size:
            break
        if got != chunk:
            raise HeaderError(f"read {offset} bytes of {expected}")
        got = _read_aligned(fd, scratch, offset)
    check.finish()


def _read_into(
    fd: int,
    key: bytes,
    dst: memoryview,
    region: memoryview,
    touching: Callable[[], AbstractContextManager[None]],
    integrity_key: IntegrityKey | None,
) -> None:
    """A version 2 file read by O_DIRECT (through the page cache if it holds the whole file)
    straight into ``dst``, its header into ``region`` (whose last ``ALIGN`` bytes catch a
    file longer than it should be), then verified where it landed; any other file is read
    again through the page cache."""
    head = region[:-ALIGN]
    size = head.nbytes + dst.nbytes
    buffered = all_cached(fd, size)
    if buffered:
        _set_direct(fd, False)
    got = _read_all(fd, [head, dst, region[-ALIGN:]], 0, least=size)
    hlen = header_size(len(key), integrity_key=integrity_key)
    if got == size:  # else not a version 2 file of this size
        header = checked_header(head[:hlen], key, size, dst, integrity_key)
        if header.payload_offset == head.nbytes:
            check = PayloadCheck(key, header, integrity_key=integrity_key)
            check.update(dst)
            check.finish()
            return
    if not buffered:
        _set_direct(fd, False)
    _read_buffered(fd, key, dst, None, touching, integrity_key)


class _CacheRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _CacheStat(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in ("cached", "dirty", "writeback", "evicted", "recently_evicted")
    )


# ``cachestat(2)``'s number on the architectures where it is 451 (the generic table's, which
# x86-64 shares); elsewhere the tier does not ask, and reads by O_DIRECT.
_CACHESTAT_ARCHES = ("x86_64", "aarch64", "arm64", "riscv64")
_CACHESTAT = 451 if platform.system() == "Linux" and platform.machine() in _CACHESTAT_ARCHES else 0
# Called holding the GIL (``PyDLL``): ``cachestat`` only looks at the page cache, it never waits
# for a device, and letting go of the GIL and taking it back costs a thread that reads more
# than the call itself whenever other threads want the GIL.
_syscall = ctypes.PyDLL(None, use_errno=True).syscall if _CACHESTAT else None


def knows_cache() -> bool:
    """Whether ``all_cached`` can tell (this kernel answers ``cachestat``)."""
    return _syscall is not None


def all_cached(fd: int, size: int) -> bool:
    """Whether the page cache holds the first ``size`` bytes of ``fd``'s file (False when
    the kernel cannot say: older than 6.5, or another system)."""
    global _syscall
    if _syscall is None:
        return False
    stat = _CacheStat()
    if _syscall(_CACHESTAT, fd, ctypes.byref(_CacheRange(0, size)), ctypes.byref(stat), 0):
        _syscall = None  # ENOSYS (or a seccomp filter): never ask again
        return False
    return bool(stat.cached * mmap.PAGESIZE >= size)


def _set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for ``fd``, opened with ``READ_FLAGS`` (so no other flag that
    ``F_SETFL`` changes is set); a file system that refuses it is read through the cache."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETFL, O_DIRECT if on else 0)


def checked_header(
    raw: memoryview | bytearray,
    key: bytes,
    size: int,
    dst: memoryview,
    integrity_key: IntegrityKey | None,
) -> BlockHeader:
    """The header of a file of ``size`` bytes meant to hold ``key``'s block for ``dst``."""
    header = decode_header(raw, integrity_key=integrity_key, versions=READ_VERSIONS)
    if header.key != key:
        raise HeaderError("block belongs to another key")
    expected = header.payload_offset + header.payload_length
    if size != expected:
        raise HeaderError(f"file is {size} bytes, header says {expected}")
    if header.payload_length != dst.nbytes:
        raise WrongSize(header.payload_length)
    return header


def _read_aligned(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from the aligned ``offset``; fewer bytes only at the end of the file."""
    total = 0
    while total < view.nbytes:
        got = _preadv(fd, [view[total:]], offset + total)
        total += got
        if got == 0 or total % ALIGN:
            break  # the end of the file
    return total


def _read_all(fd: int, views: list[memoryview], offset: int, least: int | None = None) -> int:
    """Fill ``views`` from ``offset``, or stop once ``least`` bytes are in (a regular file's
    read comes back short only at its end: a last view not filled then means the end)."""
    total = 0
    while views and (least is None or total < least):
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
