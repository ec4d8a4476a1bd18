"""Page-cached blocks read on the event loop: a promotion without the two thread hops.

A load normally runs in a worker thread, because a read from the device blocks for as long as
the device takes. A block whose file the page cache already holds is a copy away, and for a
small block the hop to a worker thread and back (a futex wake, a queue, a wake-up of the loop)
costs the loop about as much time as that copy and the checksum, and the block's caller more.
``CachedReads.read`` reads such a block on the calling thread and never waits for the device:

- the path is opened with ``openat2(2)`` and ``RESOLVE_CACHED``, which fails rather than read
  a folder from the device; from a descriptor of the root, beneath it and through no link,
  as the worker thread opens it (``_layout.open_block``);
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

from kvtier.common._format import HeaderError, IntegrityKey, PayloadCheck
from kvtier.tiers.fs._beneath import (
    AT_FDCWD,
    RESOLVE_CACHED,
    RESOLVE_NO_LINKS,
    UNSUPPORTED,
    Openat2,
)
from kvtier.tiers.fs._layout import O_NOFOLLOW, shard_path
from kvtier.tiers.fs._read import WrongSize, all_cached, checked_header, knows_cache

__all__ = ["CachedReads"]

_O_PATH = getattr(os, "O_PATH", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_HAS_CALLS = bool(_O_PATH and _RWF_NOWAIT and hasattr(os, "preadv"))


class CachedReads:
    """Reads of page-cached block files under one root, on the calling thread.

    ``budget``: the largest ``load_many``, in bytes, read this way (a larger one goes to the
    worker threads whole). Off for good once the kernel refuses ``openat2`` or ``cachestat``.
    """

    def __init__(self, root: str, budget: int, integrity_key: IntegrityKey | None) -> None:
        self._root = os.fsencode(root)
        self.budget = budget
        self._integrity_key = integrity_key
        self._openat2 = Openat2()
        if not _HAS_CALLS:
            self._openat2.off()
        self._head = bytearray(0)
        self._tail = bytearray(1)  # catches a file longer than its header says
        self._nowait = _RWF_NOWAIT

    @property
    def on(self) -> bool:
        return self._openat2.on and self.budget > 0

    def open_root(self) -> int:
        """A descriptor of the root for ``read`` (the caller closes it), from the caches only;
        -1 when it cannot be had so."""
        return self._open(AT_FDCWD, self._root, os.O_RDONLY | os.O_DIRECTORY | _O_PATH, 0)

    def read(self, root: int, name: str, key: bytes, dst: memoryview, region: int) -> bool:
        """Read ``key``'s block (file ``name`` below the descriptor ``root``, a version 2 file
        whose payload starts at ``region``) into ``dst`` and verify it, if it comes from the
        caches; else False."""
        path = os.fsencode(shard_path(name))
        fd = self._open(root, path, os.O_RDONLY | O_NOFOLLOW, RESOLVE_NO_LINKS)
        if fd < 0:
            return False
        try:
            return self._read_verified(fd, key, dst, region)
        finally:
            os.close(fd)

    def _open(self, dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
        """``openat2`` from the caches only; -1 when it would have to read the device (or
        the file is not there)."""
        fd = self._openat2.open(dir_fd, path, flags, resolve | RESOLVE_CACHED)
        if fd < 0 and ctypes.get_errno() in UNSUPPORTED:
            self._openat2.off()  # EINVAL: a kernel before RESOLVE_CACHED (5.12)
        return fd

    def _read_verified(self, fd: int, key: bytes, dst: memoryview, region: int) -> bool:
        size = region + dst.nbytes
        if not all_cached(fd, size):
            if not knows_cache():
                self._openat2.off()  # no cachestat: nothing is known to be cached
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
