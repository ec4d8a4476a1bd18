"""A secondary tier in a local or shared folder: one verified file per block (design §3-4).

Layout: ``<root>/<2 hex>/<2 hex>/<hex key>`` plus ``<root>/kvtier-fs.json``, the format marker.
The two shard folders are the key's *last* four hex digits (keys start with a version byte).
Folders are 0700 and files 0600: KV blocks are as private as the prompts they came from.

What makes it trustworthy:

- **Never a torn or wrong block.** A block is written to a uniquely named temporary file beside
  its final place and renamed into place, so a reader sees the whole file or none. Every load
  checks the header (magic, version, key, length) and the payload's xxh3-64 before the bytes
  count as loaded; a bad file is removed, counted as ``corrupt`` and becomes a miss.
- **Survives kill -9 and restarts.** A process killed mid-store leaves at most a temporary file,
  which the next ``open()`` removes once its writer is gone; a new ``FSTier`` on the same folder
  rebuilds its index (and its usage) from the files, oldest first.
- **Bounded.** With ``capacity_bytes`` the least recently used blocks are removed before a store
  would pass the limit.
- **Shares a folder.** Several processes may use one folder: publishing is a rename, removal is
  an unlink, and a reader holding a file open keeps reading it even if another process evicts
  it, so the worst another process can do is turn a hit into a miss. Files are reached from
  the root one folder at a time without following links, so a shard folder replaced by a link
  cannot make the tier write, read or delete outside its root.
- **Never blocks the loop.** Each operation is one call in a worker thread (``anyio.to_thread``,
  bounded by ``max_concurrency`` for reads and ``max_write_concurrency`` for write-through);
  see ``_fs_io``. aiofiles would cost one thread hop per OS call
  (open, write, fsync, close, rename: five per store) and could be abandoned between them by a
  cancellation, leaving a temporary file behind; one hop per operation is faster and atomic.
- **Deadlines hold on a hung mount.** A caller whose deadline fires leaves the thread behind
  (a syscall on a dead NFS server cannot be interrupted); reads land in a private buffer and
  writes copy the pool slot out first, so an abandoned thread never touches pool memory (see
  ``_fs_calls``). At most ``max_stuck_threads`` abandoned threads may still be running; past
  that, operations fail at once (``unavailable``) instead of piling threads onto the mount.
- **Batches cost a few thread hops.** ``load_many``/``store_many`` cut a batch into at most
  ``max_concurrency`` (``max_write_concurrency``) runs, each one worker-thread call that
  handles its blocks in turn, with ``load``'s and ``store``'s bookkeeping block by block
  (a bad block fails alone; capacity is kept in waves, so a block only evicts what is
  published). A *pinned* batch (the caller waits for it whatever happens, as the vLLM
  adapter does) reads into and writes from the caller's memory directly and is never
  walked away from; its deadline only stops blocks that have not started. Batches that
  are not pinned keep every deadline promise above. The batch machinery is its own job,
  so it lives in ``_fs_batch``; ``FSTier`` checks a batch's arguments and hands it over.
- **O_DIRECT on request** (``direct_io=True``; used where the file system takes it, probed
  at open): blocks are written and read past the page cache, through an aligned private
  buffer that holds header and payload side by side (the header is why: the payload sits at
  an unaligned offset, so the engine's memory cannot be the buffer). The files are the same
  bytes either way, so folders written with and without it read alike. It is off by default
  because it did not pay here: on one thread a cold 2 MiB load cost ~230 ms of CPU per GiB
  direct against ~380 through the page cache, but behind vLLM on this 2-core machine the
  buffered tier matched or beat it in MiB/s both ways (``benchmarks/bench_vllm_fs.py`` runs
  both). Turn it on to keep KV blocks out of the page cache and leave no write-back behind.
  Which buffer a block's bytes pass through, per block in a worker thread, is ``_fs_block``'s.
- **Exclusive folders answer without a stat.** With ``shared=False`` (only this process writes
  the folder) ``lookup()`` answers from the index at once: a key it holds is a ``HIT``, any
  other a ``MISS`` (``not_found``) (see ``_fs_index``). The default, ``shared=True``, checks
  the folder in batches, because another process may have written it.
- **A block being written is not a miss.** In either mode a key this tier is storing and
  does not hold yet answers ``RETRY``, and having answered so, its listeners hear the key
  when the store ends (landed or failed). A deferred write to a slower tier that copies
  the block from here then waits for it instead of giving the block up
  (``settled_lookup``).
- **Signed blocks.** With ``integrity_key`` every block carries a keyed BLAKE2b MAC and only
  blocks that verify are served (anything else is a ``corrupt`` miss): someone who can write
  to a shared folder can no longer publish a block for a key. The folder marker names the key's
  public fingerprint, so a node without the key, or with another, refuses the folder at open
  rather than calling its peers' blocks corrupt. See ``kvtier._format``.

The ``fsync`` policy (what a store costs against what a crash of the *machine* can lose; a
crash of the process, kill -9 included, loses nothing that ``store`` returned under any policy,
because the page cache survives it):

- ``never``: fastest. After a power loss a recently stored block may be missing or, on some
  filesystems, present with zeroed or stale contents; the checksum catches that, so it is a
  miss (``corrupt``), never wrong bytes.
- ``data`` (default): ``fdatasync`` before the rename, so after a power loss a published block
  is whole; the newest blocks may be missing (their rename was not yet durable).
- ``always``: also ``fsync`` the folder after the rename, so a block is durable when ``store``
  returns. The slowest; for a cache it rarely pays.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread

from kvtier._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    InvalidArgumentError,
    TierError,
    TierNoSpaceError,
    TierUnavailableError,
)
from kvtier._format import IntegrityKey, header_size
from kvtier._keys import check_key
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier._validate import positive_int, positive_number
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import (
    BatchResults,
    SecondaryTier,
    TierMeter,
    TierStatistics,
    batch_deadline,
    check_batch,
)
from kvtier.tiers.fs import _batch, _blocks
from kvtier.tiers.fs import _io as io
from kvtier.tiers.fs import _layout as layout
from kvtier.tiers.fs._calls import Abandoned, BufferPool, Handoff, Stuck, WorkerCalls
from kvtier.tiers.fs._index import IndexLookups

__all__ = ["FSYNC_POLICIES", "FSTier"]

logger = logging.getLogger(__name__)

FSYNC_POLICIES = ("never", "data", "always")
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class FSTier(SecondaryTier):
    """Blocks as files under ``root``; see the module docstring for the guarantees."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str = "fs",
        capacity_bytes: int | None = None,
        fsync: str = "data",
        miss_ttl: float = 2.0,
        lookup_batch_size: int = 256,
        lookup_timeout: float = 5.0,
        max_concurrency: int = 16,
        max_write_concurrency: int = 16,
        shared: bool = True,
        integrity_key: str | bytes | IntegrityKey | None = None,
        max_stuck_threads: int = 32,
        direct_io: bool = False,
    ) -> None:
        if not isinstance(root, str | os.PathLike) or not os.fspath(root):
            raise InvalidArgumentError(
                f"root must be a folder path (str or os.PathLike), got {root!r}"
            )
        if not isinstance(os.fspath(root), str):
            raise InvalidArgumentError("root must be a str path, not bytes; decode it first")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"name must be a non-empty str, got {name!r}")
        if capacity_bytes is not None:
            positive_int(capacity_bytes, "capacity_bytes", " (bytes) or None")
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        positive_number(miss_ttl, "miss_ttl", " of seconds")
        positive_int(lookup_batch_size, "lookup_batch_size")
        positive_number(lookup_timeout, "lookup_timeout", " of seconds")
        positive_int(max_concurrency, "max_concurrency")
        positive_int(max_write_concurrency, "max_write_concurrency")
        positive_int(max_stuck_threads, "max_stuck_threads")
        if not isinstance(direct_io, bool):
            raise InvalidArgumentError(
                f"direct_io must be True (O_DIRECT where the file system takes it) or False, "
                f"got {direct_io!r}"
            )
        if not isinstance(shared, bool):
            raise InvalidArgumentError(
                f"shared must be True (other processes may write the folder) or False (only "
                f"this process writes it), got {shared!r}"
            )
        self.integrity_key = (
            integrity_key
            if integrity_key is None or isinstance(integrity_key, IntegrityKey)
            else IntegrityKey(integrity_key)
        )
        super().__init__(name)
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.shared = shared
        self.direct_io = direct_io
        self._direct = False  # O_DIRECT asked for and taken by the file system (probed at open)
        self._marker = layout.marker_for(self.integrity_key)
        self._calls: WorkerCalls[Any] = WorkerCalls(max_stuck_threads)
        self._buffers = BufferPool(keep=max_concurrency + max_write_concurrency)
        self._limiter = anyio.CapacityLimiter(max_concurrency)
        # Threads for reads and for write-through; a batch is cut into at most this many runs.
        self.max_concurrency, self.max_write_concurrency = max_concurrency, max_write_concurrency
        # Existence checks get threads of their own: queued behind write-through they would
        # hold lookups in RETRY for as long as a burst of stores takes.
        self._check_limiter = anyio.CapacityLimiter(max(1, min(4, max_concurrency)))
        # Reads (promotions) and writes (write-through) have threads of their own, so a burst
        # of stores never queues the loads a request waits on. Fewer writer threads leave more
        # of the GIL to reads and checks, but too few let write-through fall behind a busy
        # engine (the trace replay lost 13% of its hits at 4): measure before lowering it.
        self._write_limiter = anyio.CapacityLimiter(max_write_concurrency)
        self._lookups: AsyncLookupManager | IndexLookups
        if shared:
            self._lookups = AsyncLookupManager(
                self.contains_many,
                name=name,
                batch_size=lookup_batch_size,
                max_concurrency=max(1, min(4, max_concurrency)),
                timeout=lookup_timeout,
                miss_ttl=miss_ttl,
                on_verdict=self.notify,
            )
        else:
            self._lookups = IndexLookups(self._holds, miss_ttl=miss_ttl)
        # Synchronous bookkeeping: file name -> size, least recently used first.
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0  # bytes of the files in the index
        self._reserved = 0  # bytes of stores in flight, counted against the capacity
        # Keys being stored (set when their write ends): a second store of one waits for the
        # first, and ``lookup`` answers RETRY for one the index does not hold yet; those it
        # answered so are in ``_retried``, and listeners hear them when their write ends.
        self._storing: dict[bytes, anyio.Event] = {}
        self._retried: set[bytes] = set()
        self._writing_retries = 0  # lookups answered RETRY because of that
        # A check (or load) that finds no file must not drop a name stored while it ran: the
        # names added since each watcher started are kept, by epoch, while any watcher runs.
        self._epoch = 0
        self._watchers = 0
        self._added: dict[str, int] = {}
        self._ready = False
        self._meter = TierMeter()
        self._log = BurstLogger(logger)

    # -- lifecycle -----------------------------------------------------------------------------

    async def open(self) -> None:
        """Prepare the root and start the existence checks.

        An incompatible or foreign root raises ``InvalidArgumentError``: nothing is touched.
        A root that cannot be used now (missing parent, permissions, I/O error) does not: the
        tier opens degraded (stores fail as ``unavailable``, lookups are misses) and tries
        again on the next store, so a late mount recovers without a restart.
        """
        if self._lookups.is_open:
            return
        await self._prepare(raise_unavailable=False)
        await self._lookups.__aenter__()

    async def aclose(self) -> None:
        """Stop the existence checks. The blocks stay; opening again rescans the folder."""
        await self._lookups.aclose()
        self._ready = False

    async def _prepare(self, *, raise_unavailable: bool) -> None:
        root, marker = self.root, self._marker
        try:
            entries, direct = await self._calls.run(
                lambda _: (io.prepare_root(root, marker), self.direct_io and io.probe_direct(root)),
                limiter=self._limiter,
            )
        except layout.IncompatibleRoot as exc:
            raise InvalidArgumentError(str(exc)) from None
        except (OSError, Stuck) as exc:
            self._ready = False
            self._log.warning(
                "root", "%s: cannot use root %s (%s); tier degraded", self.name, self.root, exc
            )
            if raise_unavailable:
                raise self._error(exc, "store") from exc
            return
        self._direct = direct
        self._index = OrderedDict((e.name, e.size) for e in entries)
        self._used = sum(e.size for e in entries)
        self._ready = True

    # -- lookup --------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if key in self._storing and not self._holds(key):
            # Its file is not there yet: not a miss. ``_stored`` notifies when it ends.
            self._writing_retries += 1
            self._retried.add(key)
            return LookupResult.RETRY
        return self._lookups.lookup(key)

    def _holds(self, key: bytes) -> bool:
        return self._ready and layout.name_of(key) in self._index

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self._lookups.record(key, False, reason)

    def record_hit(self, key: bytes) -> None:
        self._lookups.record(key, True)

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        names = [layout.name_of(check_key(k)) for k in keys]
        self._calls.drain_late()
        root = self.root
        since = self._watch()
        try:
            sizes: list[int | None] = await self._calls.run(
                lambda _: io.stat_many(root, names), limiter=self._check_limiter
            )
            for name, size in zip(names, sizes, strict=True):
                if size is None:
                    self._drop_unless_newer(name, since)
                elif name not in self._index:  # written by another process: account for it
                    self._add(name, size)
        except (OSError, Stuck) as exc:
            raise self._error(exc, "contains") from exc
        finally:
            self._unwatch()
        return [size is not None for size in sizes]

    # -- data ----------------------------------------------------------------------------------

    async def load(self, key: bytes, dst: memoryview) -> None:
        check_key(key)
        view = _writable_bytes(dst)
        name = layout.name_of(key)
        started = time.perf_counter()
        self._calls.drain_late()
        ikey = self.integrity_key

        def read(call: Handoff) -> io.ReadOutcome:
            # Through a private buffer: a thread abandoned mid-read must never write into a
            # pool slot that may already hold another block.
            return _blocks.read_block(self, call, key, name, view, private=True)

        since = self._watch()
        try:
            outcome = await self._calls.run(read, limiter=self._limiter)
        except io.WrongSize as exc:
            raise InvalidArgumentError(
                f"dst holds {view.nbytes} bytes but block {key.hex()} is {exc.stored} bytes"
            ) from None
        except io.Corrupt as exc:
            self._drop_unless_newer(name, since)
            self._fail(key, MissReason.CORRUPT, "load", str(exc))
            raise CorruptBlockError(str(exc), tier=self.name, operation="load", key=key) from exc
        except (OSError, Stuck) as exc:
            error = self._error(exc, "load", key)
            self._lookups.record(key, False, error.reason)
            raise error from exc
        finally:
            self._unwatch()
        if outcome is io.ReadOutcome.MISSING:
            self._drop_unless_newer(name, since)
            self._fail(key, MissReason.NOT_FOUND, "load", None)
            raise BlockNotFoundError("no such block", tier=self.name, operation="load", key=key)
        if name in self._index:
            self._index.move_to_end(name)
        else:
            self._add(name, header_size(len(key), integrity_key=ikey) + view.nbytes)
        self._meter.read(view.nbytes, time.perf_counter() - started)

    async def store(self, key: bytes, src: memoryview) -> None:
        check_key(key)
        payload = _readable_bytes(src)
        name = layout.name_of(key)
        while (busy := self._storing.get(key)) is not None:
            await busy.wait()  # the same key is being written: let that store decide
        done = self._storing[key] = anyio.Event()
        try:
            await self._store(key, name, payload)
        finally:
            del self._storing[key]
            done.set()
            self._stored([key])

    async def _store(self, key: bytes, name: str, payload: memoryview) -> None:
        started = time.perf_counter()
        self._calls.drain_late()
        if not self._ready:
            await self._prepare(raise_unavailable=True)  # counts its own failure
        ikey = self.integrity_key
        size = header_size(len(key), integrity_key=ikey) + payload.nbytes
        victims = self._choose_victims(key, name, size)
        self._reserved += size
        names = [v for v, _ in victims]

        def write(call: Handoff) -> tuple[io.WriteOutcome, int]:
            # Copy out of the caller's memory (a pool slot) first: once the caller's deadline
            # fires it unpins the slot, and an abandoned write must not read it any more.
            return _blocks.write_block(self, call, key, name, payload, names, private=True)

        def late(result: tuple[io.WriteOutcome, int] | None, error: BaseException | None) -> None:
            """The write was abandoned at a deadline and has now finished: settle its account."""
            self._reserved -= size
            self._settle(key, name, victims, result, touched=not isinstance(error, Abandoned))

        call = Handoff()
        try:
            result = await self._calls.run(
                write, limiter=self._write_limiter, on_late=late, handoff=call
            )
        except BaseException as exc:
            if not call.left_running:  # else ``late`` settles the account when it finishes
                self._reserved -= size
                landed = cast("tuple[io.WriteOutcome, int] | None", call.result)  # cancelled late
                self._settle(key, name, victims, landed, touched=call.started)
            if isinstance(exc, OSError | Stuck):
                raise self._error(exc, "store", key) from exc
            raise
        self._reserved -= size
        self._settle(key, name, victims, result, touched=True)
        if result[0] is io.WriteOutcome.WRITTEN:
            self._meter.wrote(payload.nbytes, time.perf_counter() - started)

    # -- batches -------------------------------------------------------------------------------

    async def load_many(
        self,
        keys: Sequence[bytes],
        dsts: Sequence[memoryview],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-batch bound with partial results
        pinned: bool = False,
    ) -> BatchResults:
        """``load`` for many blocks in a few thread hops: the batch is split into at most
        ``max_concurrency`` runs, each read in turn by one worker thread. Pinned, a run
        reads straight into ``dsts`` (buffered I/O) and a cancellation waits for it; else
        through private buffers, as ``load`` does."""
        check_batch(keys, dsts, "dsts")
        keys = [check_key(k) for k in keys]
        views = [_writable_bytes(d) for d in dsts]
        deadline = batch_deadline(timeout)
        return await _batch.load_many(self, keys, views, deadline, pinned)

    async def store_many(
        self,
        keys: Sequence[bytes],
        srcs: Sequence[memoryview],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-batch bound with partial results
        pinned: bool = False,
    ) -> BatchResults:
        """``store`` for many blocks in a few thread hops (see ``load_many``). Pinned, a run
        writes straight from ``srcs``; else it copies each block out first, as ``store``
        does. Capacity, victims and publishing are ``store``'s, block by block."""
        check_batch(keys, srcs, "srcs")
        keys = [check_key(k) for k in keys]
        payloads = [_readable_bytes(s) for s in srcs]
        deadline = batch_deadline(timeout)
        return await _batch.store_many(self, keys, payloads, deadline, pinned)

    def _settle(
        self,
        key: bytes,
        name: str,
        victims: list[tuple[str, int]],
        result: tuple[io.WriteOutcome, int] | None,
        *,
        touched: bool,
    ) -> None:
        """Account for a store: its victims and, when it landed, its file."""
        if result is None and touched:
            self._evicted(victims)  # the write ran: they may be gone, never count them again
        elif result is None or result[0] is io.WriteOutcome.EXISTS:
            self._restore(victims)  # nothing happened on disk, or nothing needed the room
        else:
            self._evicted(victims)
        if result is not None:
            self._add(name, result[1])
            self._lookups.record(key, True)

    def _choose_victims(self, key: bytes, name: str, size: int) -> list[tuple[str, int]]:
        """Take least recently used blocks out of the index until ``size`` more bytes fit."""
        if self.capacity_bytes is None:
            return []
        if size > self.capacity_bytes:
            self._meter.failed(MissReason.NO_SPACE)
            raise TierNoSpaceError(
                f"a block of {size} bytes is larger than capacity_bytes={self.capacity_bytes}",
                tier=self.name,
                operation="store",
                key=key,
            )
        victims: list[tuple[str, int]] = []
        budget = self.capacity_bytes - self._reserved - size
        while self._used > budget and self._index:
            victim, victim_size = self._index.popitem(last=False)
            if victim == name:  # it is there already: it needs no room
                self._index[victim] = victim_size
                if len(self._index) == 1:
                    break
                continue
            self._used -= victim_size
            victims.append((victim, victim_size))
        return victims

    def _restore(self, victims: list[tuple[str, int]]) -> None:
        for victim, victim_size in reversed(victims):
            if victim not in self._index:
                self._index[victim] = victim_size
                self._index.move_to_end(victim, last=False)
                self._used += victim_size

    def _evicted(self, victims: list[tuple[str, int]]) -> None:
        self._meter.evictions += len(victims)
        keys = [k for v, _ in victims if (k := layout.key_of(v)) is not None]
        for k in keys:
            self._lookups.record(k, False, MissReason.EVICTED)
        if keys:
            self.notify(keys)

    async def delete(self, key: bytes) -> None:
        check_key(key)
        name = layout.name_of(key)
        root = self.root
        try:
            removed = await self._calls.run(
                lambda _: io.remove_block(root, name), limiter=self._limiter
            )
        except (OSError, Stuck) as exc:
            raise self._error(exc, "delete", key) from exc
        self._drop(name)
        self._lookups.record(key, False, MissReason.NOT_FOUND)
        self._meter.deletes += removed

    # -- bookkeeping ---------------------------------------------------------------------------

    def _stored(self, keys: list[bytes]) -> None:
        """The stores of ``keys`` ended (``_storing`` no longer holds them): tell whoever
        was answered RETRY for one that it answers HIT or MISS now."""
        retried = self._retried
        if retried:
            told = [k for k in keys if k in retried]
            if told:
                retried.difference_update(told)
                self.notify(told)

    def _add(self, name: str, size: int) -> None:
        self._drop(name)
        self._index[name] = size
        self._used += size
        self._epoch += 1
        if self._watchers:
            self._added[name] = self._epoch

    def _watch(self) -> int:
        """Start a check whose "no such file" may be stale by the time it returns."""
        self._watchers += 1
        return self._epoch

    def _unwatch(self) -> None:
        self._watchers -= 1
        if not self._watchers:
            self._added.clear()

    def _drop_unless_newer(self, name: str, since: int) -> None:
        """Drop ``name`` unless a store (or a load) added it after the check began."""
        if self._added.get(name, -1) <= since:
            self._drop(name)

    def _drop(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self._used -= size

    def _fail(self, key: bytes, reason: MissReason, operation: str, detail: str | None) -> None:
        self._meter.failed(reason)
        self._lookups.record(key, False, reason)
        if detail is not None:
            self._log.warning(
                f"{operation}:{reason.value}",
                "%s: %s of %s failed (%s): %s; file removed",
                self.name,
                operation,
                key.hex(),
                reason.value,
                detail,
            )

    def _error(self, exc: OSError | Stuck, operation: str, key: bytes | None = None) -> TierError:
        """The one place an ``OSError`` becomes a kvtier error; counts and logs it."""
        if isinstance(exc, Stuck):
            self._meter.failed(MissReason.UNAVAILABLE)
            self._log.warning(
                f"{operation}:stuck",
                "%s: %s refused: %s (hung file system?)",
                self.name,
                operation,
                exc,
            )
            return TierUnavailableError(
                f"file system not answering: {exc}", tier=self.name, operation=operation, key=key
            )
        cls: type[TierError] = TierNoSpaceError if exc.errno in _NO_SPACE else TierUnavailableError
        self._meter.failed(cls.reason)
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._log.warning(
            f"{operation}:{code}", "%s: %s failed: %s (%s)", self.name, operation, code, exc
        )
        return cls(f"{code}: {exc.strerror or exc}", tier=self.name, operation=operation, key=key)

    def statistics(self) -> TierStatistics:
        self._calls.drain_late()
        lookups = self._lookups.statistics()
        if self._writing_retries:
            lookups = dataclasses.replace(lookups, retries=lookups.retries + self._writing_retries)
        return self._meter.snapshot(
            self.name,
            lookups,
            blocks=len(self._index),
            bytes_stored=self._used,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<FSTier {self.name!r} root={str(self.root)!r} ready={self._ready} "
            f"blocks={s.blocks} bytes={s.bytes_stored} capacity={self.capacity_bytes} "
            f"fsync={self.fsync} shared={self.shared} direct={self._direct} "
            f"signed={self.integrity_key is not None} "
            f"storing={len(self._storing)} pending={s.lookups.pending} "
            f"stuck_threads={self._calls.stuck}>"
        )


def _writable_bytes(dst: object) -> memoryview:
    if not isinstance(dst, memoryview):
        raise InvalidArgumentError(f"dst must be a memoryview, got {type(dst).__name__}")
    if dst.readonly:
        raise InvalidArgumentError("dst must be writable; pass a memoryview of a writable buffer")
    return _flat(dst, "dst")


def _readable_bytes(src: object) -> memoryview:
    if not isinstance(src, memoryview):
        raise InvalidArgumentError(f"src must be a memoryview, got {type(src).__name__}")
    return _flat(src, "src")


def _flat(view: memoryview, what: str) -> memoryview:
    if not view.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous; copy it into one buffer first")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
