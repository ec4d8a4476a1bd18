"""Page-cached blocks read on the event loop: a promotion without the two thread hops.

A load normally runs in a worker thread, because a read from the device blocks for as long as
the device takes. A block whose file the page cache already holds is a copy away, and for a
small block the hop to a worker thread and back (a futex wake, a queue, a wake-up of the loop)
costs the loop about as much time as that copy and the checksum, and the block's caller more.
``CachedReads.read`` reads such a block on the calling thread and never waits for the device:

- the path is opened with ``openat2(2)`` and ``RESOLVE_CACHED``, which fails rather than read
  a folder from the device; from a descriptor of the root, beneath it and through no link,
  as the worker thread's walk one level at a time is (``_layout.open_shard``);
- ``cachestat(2)`` says whether the cache holds the whole file; the read itself asks not to
  wait (``RWF_NOWAIT``), in case the pages went in between.

Anything else (a version 1 file, a header or checksum that does not match, a file of another
size, a kernel older than 6.5 or a filter that refuses these calls) answers False, and the
caller reads the block in a worker thread as before: that read is the one that reports a
corrupt file and removes it. So this path only ever serves a block that verifies; it never
decides that one is bad.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

from kvtier._format import HeaderError, IntegrityKey, PayloadCheck
from kvtier.tiers.fs._io import WrongSize
from kvtier.tiers.fs._layout import O_CLOEXEC, O_NOFOLLOW, shard_path
from kvtier.tiers.fs._read import all_cached, checked_header, knows_cache

__all__ = ["AT_FDCWD", "CachedReads"]

# ``openat2(2)``'s number where the generic table is used (x86-64 shares it), and its flags.
_OPENAT2 = 437
AT_FDCWD = -100  # a path relative to the working folder (or absolute)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE_CACHED = 0x20
_ARCHES = ("x86_64", "aarch64", "arm64", "riscv64")
_O_PATH = getattr(os, "O_PATH", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
# Errors that mean this kernel (or a filter in front of it) will never take the call; any
# other error means only that this block is not to be had from the caches.
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EPERM)


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _supported() -> bool:
    return (
        platform.system() == "Linux"
        and platform.machine() in _ARCHES
        and bool(_O_PATH and _RWF_NOWAIT and hasattr(os, "preadv"))
    )


class CachedReads:
    """Reads of page-cached block files under one root, on the calling thread.

    ``budget``: the largest ``load_many``, in bytes, read this way (a larger one goes to the
    worker threads whole). Off for good once the kernel refuses ``openat2`` or ``cachestat``.
    """

    def __init__(self, root: str, budget: int, integrity_key: IntegrityKey | None) -> None:
        self._root = os.fsencode(root)
        self.budget = budget
        self._integrity_key = integrity_key
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall if _supported() else None
        self._head = bytearray(0)
        self._tail = bytearray(1)  # catches a file longer than its header says
        self._nowait = _RWF_NOWAIT

    @property
    def on(self) -> bool:
        return self._syscall is not None and self.budget > 0

    def open_root(self) -> int:
        """A descriptor of the root for ``read`` (the caller closes it), from the caches only;
        -1 when it cannot be had so."""
        return self._open(AT_FDCWD, self._root, os.O_RDONLY | os.O_DIRECTORY | _O_PATH, 0)

    def read(self, root: int, name: str, key: bytes, dst: memoryview, region: int) -> bool:
        """Read ``key``'s block (file ``name`` below the descriptor ``root``, a version 2 file
        whose payload starts at ``region``) into ``dst`` and verify it, if it comes from the
        caches; else False."""
        resolve = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
        fd = self._open(root, os.fsencode(shard_path(name)), os.O_RDONLY | O_NOFOLLOW, resolve)
        if fd < 0:
            return False
        try:
            return self._read_verified(fd, key, dst, region)
        finally:
            os.close(fd)

    def _open(self, dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
        """``openat2`` from the caches only; -1 when it would have to read the device (or
        the file is not there)."""
        syscall = self._syscall
        if syscall is None:
            return -1
        how = _OpenHow(flags | O_CLOEXEC, 0, resolve | _RESOLVE_CACHED)
        fd = int(syscall(_OPENAT2, dir_fd, path, ctypes.byref(how), ctypes.sizeof(how)))
        if fd < 0 and ctypes.get_errno() in _UNSUPPORTED:
            self._syscall = None  # EINVAL: a kernel before RESOLVE_CACHED (5.12)
        return fd

    def _read_verified(self, fd: int, key: bytes, dst: memoryview, region: int) -> bool:
        size = region + dst.nbytes
        if not all_cached(fd, size):
            if not knows_cache():
                self._syscall = None  # no cachestat: nothing is known to be cached
            return False
        if len(self._head) != region:
            self._head = bytearray(region)
        head = memoryview(self._head)
        buffers = [head, dst, memoryview(self._tail)]
        try:
            got = os.preadv(fd, buffers, 0, self._nowait)
        except BlockingIOError:
            return False  # the pages left the cache since cachestat
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP or not self._nowait:
                return False
            # tmpfs refuses RWF_NOWAIT: cachestat alone says the pages are in memory (a
            # page swapped out in between is read back from swap on this thread).
            self._nowait = 0
            return self._read_verified(fd, key, dst, region)
        if got != size:
            return False
        try:
            header = checked_header(head, key, size, dst, self._integrity_key)
            if header.payload_offset != region:
                return False
            check = PayloadCheck(key, header, integrity_key=self._integrity_key)
            check.update(dst)
            check.finish()
        except (HeaderError, WrongSize):
            return False  # the worker thread reads it again, and reports it
        return True
