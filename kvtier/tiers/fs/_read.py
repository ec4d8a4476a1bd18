"""The blocking half of ``FSTier`` that reads: one block back from its file, verified.

``read_block`` runs in a worker thread and reads a block piece by piece, hashing each piece
while it is in the cache, so its bytes count as loaded only once the header (magic, version,
key, length) and the payload's checksum (or MAC) match; a file that fails is removed, if it is
still the file that was read. ``_preadv`` is the one OS call that reads, named once so tests
can inject a fault or a hang at exactly this boundary.

A read never lands in the caller's buffer while a syscall is in flight: it lands in a private
buffer and is copied into the caller's under ``Handoff.touching()`` (see ``_calls``), so a
thread abandoned at a deadline cannot write into a pool slot that may hold another block by
then. The one exception is a *pinned* batch, whose caller waits for the thread however long it
takes: it reads into the caller's buffers directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from kvtier._format import (
    ALIGNED_FORMAT_VERSION,
    FORMAT_VERSION,
    BlockHeader,
    HeaderError,
    IntegrityKey,
    PayloadCheck,
    decode_header,
    header_size,
)
from kvtier.tiers.fs._io import (
    ALIGN,
    O_DIRECT,
    Corrupt,
    ReadOutcome,
    WrongSize,
    copy_bytes,
    open_maybe_direct,
    staging_size,
)
from kvtier.tiers.fs._layout import READ_FLAGS, open_shard, remove_if_same

__all__ = ["DIRECT_CHUNK", "READ_CHUNK", "read_block", "scratch_size"]

# The OS call that reads, named once so tests can inject a fault at exactly this boundary.
_preadv = os.preadv

READ_CHUNK = 256 << 10  # small enough to stay in a core's cache between read, hash and copy
# O_DIRECT reads are synchronous device requests: small ones cost more CPU per byte than the
# cache misses they save, so a block is read whole, up to this size.
DIRECT_CHUNK = 4 << 20


# The FS tier writes version 2 (the payload aligned for O_DIRECT) and still reads version 1.
VERSIONS = (FORMAT_VERSION, ALIGNED_FORMAT_VERSION)


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
    region: memoryview | None = None,
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
    file is read through the page cache instead).
    """
    try:
        dir_fd = open_shard(root, name)
    except FileNotFoundError:
        return ReadOutcome.MISSING
    try:
        try:
            use_direct = direct and (scratch is not None or region is not None)
            fd, direct = open_maybe_direct(name, READ_FLAGS, use_direct, dir_fd)
        except FileNotFoundError:
            return ReadOutcome.MISSING
        try:
            if direct and scratch is not None:
                _read_verified_direct(fd, key, dst, scratch, touching, integrity_key)
            elif direct and region is not None:
                _read_into(fd, key, dst, region, touching, integrity_key)
            else:
                _read_verified(fd, key, dst, scratch, touching, integrity_key)
        except HeaderError as exc:
            with contextlib.suppress(OSError):
                remove_if_same(dir_fd, name, fd)
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
    header = _checked_header(header_buf, key, size, dst, integrity_key)
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
    header = _checked_header(scratch[:hlen], key, size, dst, integrity_key)
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
    """A version 2 file read by O_DIRECT straight into ``dst`` (header into ``region``), then
    verified where it landed; any other file is read again through the page cache."""
    size = os.fstat(fd).st_size
    hlen = header_size(len(key), integrity_key=integrity_key)
    if size == region.nbytes + dst.nbytes:  # else not a version 2 file of this size
        got = _read_all(fd, [region, dst], 0)
        if got >= hlen:
            header = _checked_header(region[:hlen], key, size, dst, integrity_key)
            if header.payload_offset == region.nbytes:
                if got != size:
                    raise HeaderError(f"read {got} bytes of {size}")
                check = PayloadCheck(key, header, integrity_key=integrity_key)
                check.update(dst)
                check.finish()
                return
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
    _read_verified(fd, key, dst, None, touching, integrity_key)


def _checked_header(
    raw: memoryview | bytearray,
    key: bytes,
    size: int,
    dst: memoryview,
    integrity_key: IntegrityKey | None,
) -> BlockHeader:
    """The header of a file of ``size`` bytes meant to hold ``key``'s block for ``dst``."""
    header = decode_header(raw, integrity_key=integrity_key, versions=VERSIONS)
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
