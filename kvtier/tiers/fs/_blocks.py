"""Block files across the worker-thread boundary: the threads, and whose memory bytes pass through.

``BlockFiles`` is what every FS tier operation needs to run its file work in a worker thread:
the root and file settings, the abandonable worker calls (``_calls``), the private buffers,
and one thread limiter per kind of work. Reads (promotions) and writes (write-through) have
threads of their own, so a burst of stores never queues the loads a request waits on, and
existence checks have their own few, so they are never queued behind write-through either.

``read_into_slot`` and ``write_from_slot`` decide, for one block in a worker thread, whether
the bytes go straight between the file and the caller's memory or through a private buffer of
the tier's: always for a call that may be abandoned at a deadline (so an abandoned thread never
touches pool memory) unless the caller lent its buffers (``kvtier.common._lending``: it keeps the
ones a thread left running may still write), and always with O_DIRECT when header and payload
must sit side by side in one aligned buffer (a format 1 file, an unaligned buffer).
``FSTier``'s ``load`` and ``store`` and the batch runs in ``_batch`` all call them; the file
work itself is ``_write``'s and ``_read``'s, and the sizes of files and buffers
``_geometry``'s. Both reach files from the root's held descriptor (``_held``), and run once
more on the folder the root's path names now when a swapped folder explains a failure.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from kvtier.common._format import ALIGNED_FORMAT_VERSION, IntegrityKey, header_size
from kvtier.tiers.fs import _geometry as geometry
from kvtier.tiers.fs._cached import CachedReads
from kvtier.tiers.fs._calls import BufferPool, Handoff, WorkerCalls, copy_bytes
from kvtier.tiers.fs._config import FSConfig
from kvtier.tiers.fs._held import HeldRoot, close_all
from kvtier.tiers.fs._keeper import FolderKeeper
from kvtier.tiers.fs._layout import MARKER_NAME
from kvtier.tiers.fs._read import ReadOutcome, read_verified
from kvtier.tiers.fs._write import WriteOutcome, write_block

__all__ = ["BlockFiles", "read_into_slot", "write_from_slot"]


class BlockFiles:
    """The file side of one FS tier: settings, worker calls, buffers and thread limits."""

    def __init__(
        self,
        root: Path,
        settings: FSConfig,
        integrity_key: IntegrityKey | None,
        keeper: FolderKeeper,
    ) -> None:
        """Files under ``root`` (already resolved), with the fsync mode, thread limits and
        buffer count of ``settings``; ``keeper`` keeps the folder's own files."""
        self.root = root
        self.held = HeldRoot(root)  # what every file operation starts from
        self.keeper = keeper
        self.fsync = settings.fsync
        self.integrity_key = integrity_key
        self.direct = False  # O_DIRECT asked for and taken by the file system (probed at open)
        self.calls: WorkerCalls[Any] = WorkerCalls(settings.max_stuck_threads)
        max_concurrency = self.max_concurrency = settings.max_concurrency  # runs per batch
        max_write_concurrency = self.max_write_concurrency = settings.max_write_concurrency
        self.buffers = BufferPool(keep=max_concurrency + max_write_concurrency)
        self.reads = anyio.CapacityLimiter(max_concurrency)
        # Fewer writer threads leave more of the GIL to reads and checks, but too few let
        # write-through fall behind a busy engine (the trace replay loses hits): measure
        # before lowering it.
        self.writes = anyio.CapacityLimiter(max_write_concurrency)
        # Queued behind write-through, checks would hold lookups in RETRY for as long as a
        # burst of stores takes.
        self.checks = anyio.CapacityLimiter(max(1, min(4, max_concurrency)))
        self.cached = CachedReads(str(root), settings.loop_read_bytes, integrity_key)

    def close(self) -> None:
        """Let go of the root's descriptors: closed now, or by the last abandoned thread
        still running when it returns (until then it may use one, and a closed number may be
        reused for another file), with any such a thread opened again meanwhile; the next
        open's operations open the root again."""
        fds = self.held.shut()
        held = self.held
        self.calls.when_unstuck(lambda: close_all([*fds, *held.detach_if_shut()]))

    def shard_made(self) -> None:
        """A store made a first-level shard folder (in its worker thread): the folder may
        have been emptied (``rm -rf root/*`` takes every such folder and the marker), so
        when the marker is gone the keeper checks the folder before the block lands. A
        marker that is there is left to the periodic check."""
        try:
            os.stat(MARKER_NAME, dir_fd=self.held.fd(), follow_symlinks=False)
        except OSError:
            self.keeper.shard_made()

    def header_size(self, key: bytes) -> int:
        return header_size(len(key), integrity_key=self.integrity_key)

    def region_size(self, key: bytes, payload_bytes: int) -> int:
        """Bytes before the payload in the file this tier writes for the block."""
        return geometry.region_size(self.header_size(key), payload_bytes)

    def cached_region(self, key: bytes, view: memoryview) -> int | None:
        """Bytes before the payload when a block for ``view`` may be read from the page
        cache on the loop (``CachedReads``): a version 2 file; None otherwise."""
        if geometry.file_version(view.nbytes) != ALIGNED_FORMAT_VERSION:
            return None
        return self.region_size(key, view.nbytes)

    def zero_copy(self, view: memoryview) -> bool:
        """Whether O_DIRECT moves the block between its file and ``view`` with no copy."""
        aligned_file = geometry.file_version(view.nbytes) == ALIGNED_FORMAT_VERSION
        return self.direct and aligned_file and geometry.aligned(view)


def _usable(files: BlockFiles) -> None:
    """Raise ``OSError`` when the folder is no longer this tier's (another kvtier's marker
    took it while the tier ran): its blocks are neither read, which could call another
    format's blocks corrupt and remove them, nor written."""
    if (refused := files.keeper.refused) is not None:
        raise OSError(errno.ESTALE, refused)


def read_into_slot(
    files: BlockFiles, call: Handoff, key: bytes, name: str, view: memoryview, *, private: bool
) -> ReadOutcome:
    """Read and verify one block (in a worker thread). ``private``: through a buffer of
    the tier's, copied into ``view`` inside ``touching()``; else straight into ``view`` (with
    O_DIRECT when ``view`` is aligned, else through an aligned buffer anyway). A block not
    found is looked for again when the root's path names another folder now."""
    _usable(files)
    held = files.held
    try:
        outcome = _read_once(files, call, key, name, view, private, used := held.fd())
        if outcome is ReadOutcome.MISSING and held.moved(used):
            outcome = _read_once(files, call, key, name, view, private, held.fd())
    except FileNotFoundError:  # the root itself is gone
        return ReadOutcome.MISSING
    return outcome


def _read_once(
    files: BlockFiles,
    call: Handoff,
    key: bytes,
    name: str,
    view: memoryview,
    private: bool,
    root_fd: int,
) -> ReadOutcome:
    if not (private or files.direct):
        return read_verified(
            files.root,
            name,
            key,
            view,
            None,
            call.touching,
            integrity_key=files.integrity_key,
            root_fd=root_fd,
        )
    # Without a copy: an aligned buffer for the header page only. Else: one for the pieces.
    zero_copy = not private and files.zero_copy(view)
    if zero_copy:  # and a page more, to tell a file longer than it should be
        size = files.region_size(key, view.nbytes) + geometry.ALIGN
    else:
        size = geometry.scratch_size(files.direct, files.header_size(key), view.nbytes)
    buf = files.buffers.take(size)
    try:
        return read_verified(
            files.root,
            name,
            key,
            view,
            None if zero_copy else memoryview(buf),
            call.touching,
            integrity_key=files.integrity_key,
            direct=files.direct,
            region=memoryview(buf) if zero_copy else None,
            root_fd=root_fd,
        )
    finally:
        files.buffers.give(buf)


def write_from_slot(
    files: BlockFiles,
    call: Handoff,
    key: bytes,
    name: str,
    payload: memoryview,
    victims: list[str],
    *,
    private: bool,
    started: Callable[[], None] | None = None,
) -> tuple[WriteOutcome, int]:
    """Publish one block (in a worker thread). ``private``: copy the payload out of the
    caller's memory first, inside ``touching()``; else write from it (with O_DIRECT straight
    from it when it is aligned, else through an aligned copy). ``started`` is called, under
    the call's lock, once the block may touch the file system."""
    _usable(files)
    hlen = files.region_size(key, payload.nbytes)
    zero_copy = not private and files.zero_copy(payload)
    copied = (private or files.direct) and not zero_copy
    size = geometry.staging_size(hlen, payload.nbytes) if copied else hlen if zero_copy else 0
    buf = files.buffers.take(size) if size else None
    try:
        region = memoryview(buf) if zero_copy and buf is not None else None
        staging = memoryview(buf) if copied and buf is not None else None
        body = payload if staging is None else staging[hlen : hlen + payload.nbytes]
        with call.touching() if copied else call.holding():
            if staging is not None:
                copy_bytes(body, payload)
            if started is not None:
                started()
        held = files.held
        write = functools.partial(
            write_block,
            files.root,
            name,
            key,
            body,
            files.fsync,
            victims,
            integrity_key=files.integrity_key,
            staging=staging if files.direct else None,
            region=region,
            new_shard=files.shard_made,
        )
        try:
            return write(root_fd=(used := held.fd()))
        except FileNotFoundError:  # its folder removed: the root's path may name another
            if not held.moved(used):
                raise
            return write(root_fd=held.fd())
    finally:
        if buf is not None:
            files.buffers.give(buf)
