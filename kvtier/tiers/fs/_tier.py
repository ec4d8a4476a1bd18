"""``FSTier``, the async shell of the file-system tier (what it promises: ``kvtier.tiers.fs``).

The shell takes its settings from one ``FSConfig`` (``_config``: names, defaults and checks),
opens and closes, and for each operation awaits the file work in
a worker thread (``_blocks``, ``_write``, ``_read``) between two synchronous steps: before, the
``Catalog`` reserves room and marks the key being stored; after, the ``Ledger`` books the
outcome (catalog, counters, verdicts, notices, errors). ``lookup`` is synchronous: a key
being stored answers ``RETRY``, any other is the lookup helper's (``AsyncLookupManager`` for a
shared folder, ``_index.IndexLookups`` for an exclusive one). Batches are ``_batch``'s. The
folder's own files (marker, manifest, locks) are the ``FolderKeeper``'s (``_keeper``), checked
while the tier is open by ``_upkeep``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Unpack, cast

import anyio
import anyio.abc

from kvtier.common._background import cancel_task_group, enter_task_group
from kvtier.common._describe import describe
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._events import EventBuffer, EventKind
from kvtier.common._format import IntegrityKey
from kvtier.common._identity import CacheIdentity, scoped_name
from kvtier.common._keys import check_key
from kvtier.common._lending import Lender
from kvtier.common._lookup import LookupResult, MissReason
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import (
    BatchResults,
    SecondaryTier,
)
from kvtier.tiers._checks import existence_checks
from kvtier.tiers.fs import _batch, _blocks
from kvtier.tiers.fs._blocks import BlockFiles
from kvtier.tiers.fs._calls import Handoff, Stuck
from kvtier.tiers.fs._catalog import Catalog
from kvtier.tiers.fs._config import FSConfig, FSOverrides
from kvtier.tiers.fs._exists import stat_many
from kvtier.tiers.fs._index import IndexLookups, IndexThenChecks
from kvtier.tiers.fs._keeper import FolderKeeper
from kvtier.tiers.fs._layout import IncompatibleRoot, name_of
from kvtier.tiers.fs._ledger import Ledger
from kvtier.tiers.fs._ownership import FolderBusy
from kvtier.tiers.fs._persistence import CatalogPersistence, FSTierStatistics
from kvtier.tiers.fs._read import Corrupt, ReadOutcome, WrongSize
from kvtier.tiers.fs._root import UnusableRootError
from kvtier.tiers.fs._upkeep import Upkeep
from kvtier.tiers.fs._views import readable_bytes, writable_bytes
from kvtier.tiers.fs._write import WriteOutcome, remove_block

__all__ = ["FSTier"]

logger = logging.getLogger("kvtier.tiers.fs")


class FSTier(SecondaryTier):
    """Blocks as files under ``root``; see ``kvtier.tiers.fs`` for the guarantees."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        config: FSConfig | None = None,
        integrity_key: str | bytes | IntegrityKey | None = None,
        identity: CacheIdentity | None = None,
        **overrides: Unpack[FSOverrides],
    ) -> None:
        """A tier in ``root``, with ``config``'s settings (else the defaults) and any
        keyword overrides (``fsync="never"``, ...); ``FSConfig`` names and checks each one.

        ``identity``: what the blocks are (``kvtier.CacheIdentity``); recorded in the folder
        at open, and a folder that records another one is refused (or, with
        ``separate_identities``, each identity keeps its blocks in ``root/id-<digest>``).
        Without one the folder is used as it is: you vouch for the keys' namespace."""
        self.config = settings = FSConfig.from_keywords(config, root=root, **overrides)
        self.integrity_key = (
            integrity_key
            if integrity_key is None or isinstance(integrity_key, IntegrityKey)
            else IntegrityKey(integrity_key)
        )
        super().__init__(settings.name)
        self.identity = identity
        self.root = Path(os.path.abspath(os.path.expanduser(settings.root)))
        self._container: Path | None = None  # the root that holds one folder per identity
        if settings.separate_identities and identity is not None:  # else nothing to separate
            self._container, self.root = self.root, self.root / scoped_name(identity)
        self.capacity_bytes, self.fsync = settings.capacity_bytes, settings.fsync
        self.shared, self.direct_io = settings.shared, settings.direct_io
        self.max_concurrency = settings.max_concurrency
        self.max_write_concurrency = settings.max_write_concurrency
        self._keeper = keeper = FolderKeeper(
            self.root, self.integrity_key, identity, self._container, self.shared
        )
        self._files = BlockFiles(self.root, settings, self.integrity_key, keeper)
        self._catalog: Catalog[anyio.Event] = Catalog(settings.capacity_bytes)
        self._reading_root = anyio.Lock()  # one read of the folder at a time
        # The owner answers lookups from the catalog; a shared writer checks the disk (another
        # process may have written a key). Both are open while the tier is, so an owner that
        # finds another process on its folder switches at once.
        self._index = IndexLookups(self._catalog.holds, miss_ttl=settings.miss_ttl)
        self._checks = existence_checks(self, self.contains_many, settings, most=4)
        self._lookups: AsyncLookupManager | IndexLookups | IndexThenChecks = (
            self._index if settings.shared is False else self._checks
        )
        self._interim = IndexThenChecks(self._index, self._checks)  # opened from a checkpoint
        self._task_group: anyio.abc.TaskGroup | None = None  # the folder's checks
        # What it holds, for routers and engines (``kvtier.common._events``): stored, removed,
        # cleared.
        self.events = EventBuffer(self.name, shared=settings.shared is True, storage="disk")
        self._ledger = Ledger(
            self.name, self._catalog, self._lookups, self.notify, self.integrity_key, self.events
        )
        self._upkeep = Upkeep(self._files, self._ledger, settings.lookup_timeout, self._share)
        self._persistence = CatalogPersistence(
            self.name,
            self.root,
            self._catalog,
            self._ledger.forget_files,
            settings.fsync,
            found=self._ledger.found_files,
        )
        self._keeping = False  # this open made the tier the owner: it keeps its catalog

    @property
    def owner(self) -> bool | None:
        """Whether this tier is the folder's only writer and answers lookups from its index
        (``shared``, see ``kvtier.tiers.fs._ownership``); None until it has opened its root."""
        return self._keeper.owner

    # -- lifecycle -----------------------------------------------------------------------------

    async def open(self) -> None:
        """Prepare the root, start the existence checks and the folder's checks.

        An incompatible or foreign root raises ``InvalidArgumentError``: nothing is touched.
        A root that cannot be created or written (permissions, a file in the way, a read-only
        file system where the marker must be written) raises ``UnusableRootError`` naming the
        path and the reason: a configuration error. Missing parents are created (and logged).
        A root whose file system does not answer (a hung mount) is a fault, not a setting: the
        tier opens degraded (stores fail as ``unavailable``, lookups are misses) and tries
        again on the next store.
        """
        if self._task_group is not None:
            return
        self._keeping = False
        self._files.held.reopened()
        await self._prepare(raise_unavailable=False)
        await self._index.__aenter__()
        await self._checks.__aenter__()
        self._task_group = tg = await enter_task_group()
        tg.start_soon(self._upkeep.run)
        if self._keeping:
            self._persistence.start(
                tg, self._reconciled, self.config.walk_interval, self._answers_from_index
            )

    async def aclose(self) -> None:
        """Stop the checks, write the catalog's last checkpoint (an owner), and let go of the
        folder. The blocks stay; opening again reads the checkpoint (or walks the folder)."""
        await self._index.aclose()  # holds no task group: nothing to leave
        self._catalog.ready = False
        tg, self._task_group = self._task_group, None
        try:
            if tg is not None:  # entered after the existence checks' group: left before it
                await cancel_task_group(tg)
        finally:  # even when the caller is cancelled meanwhile (a manager's open_timeout)
            await self._persistence.aclose()  # shielded and bounded; before the claim goes
            held, files = self._keeper.close(), self._files
            if held is not None:  # bounded: closing a lock on a dead mount may not return
                with anyio.move_on_after(self.config.lookup_timeout, shield=True):
                    with contextlib.suppress(OSError, Stuck):
                        await files.calls.run(lambda _: held.release(), limiter=files.reads)
            files.close()  # the root's held descriptors
            await self._checks.aclose()

    async def _prepare(self, *, raise_unavailable: bool) -> None:
        """Make the root usable and read its files into the catalog. Stores that find the
        root unusable all come here: the first reads the folder, the others find it ready."""
        async with self._reading_root:
            if not (raise_unavailable and self._catalog.ready):
                with self._catalog.watching() as since:
                    await self._read_root(raise_unavailable, since)

    async def _read_root(self, raise_unavailable: bool, since: int) -> None:
        keeper, files, probe = self._keeper, self._files, self.direct_io
        generation = keeper.generation
        kept = self._persistence
        load = None if raise_unavailable else kept.load  # at open only
        try:
            ready, built = await files.calls.run(
                lambda _: kept.built(keeper.prepare(probe, generation, load)), limiter=files.reads
            )
        except (IncompatibleRoot, FolderBusy) as exc:
            if raise_unavailable:  # at a store: the folder became another tier's
                raise self._ledger.refused(str(exc), "store") from None
            raise InvalidArgumentError(str(exc)) from None
        except (OSError, Stuck) as exc:
            self._catalog.ready = False
            if isinstance(exc, OSError) and not raise_unavailable:  # at open: a setting
                raise UnusableRootError(self.root, exc) from exc
            self._ledger.warn(
                "root", "%s: cannot use root %s (%s); tier degraded", self.name, self.root, exc
            )
            if raise_unavailable:
                raise self._ledger.error(exc, "store") from exc
            return
        files.direct = probe and not ready.direct_refused
        if why := ready.direct_refused:
            warning = "%s: %s: %s; through the page cache instead"
            self._ledger.warn("direct", warning, self.name, self.root, why)
        if (claimed := ready.claimed) is not None:  # owner, or one of the folder's writers
            how = "answer from the index" if claimed.owner else "check the disk"
            logger.info("%s: %s is %s: lookups %s", self.name, self.root, claimed.why, how)
            self._lookups = self._ledger.verdicts = self._index if claimed.owner else self._checks
            self._keeping = claimed.owner and not raise_unavailable
        self._ledger.rescanned(built, since)
        if ready.loaded:
            self._lookups = self._ledger.verdicts = self._interim
        if self._keeping:
            kept.attach(ready.entries)

    async def _prepare_for_store(self) -> None:
        await self._prepare(raise_unavailable=True)

    # -- the folder ------------------------------------------------------------------------------

    async def _check_folder(self) -> None:
        """Check the folder once now, as the periodic check does (``_upkeep``)."""
        await self._upkeep.check()

    def _share(self, why: str) -> None:
        """Another process uses the folder now: stop answering lookups from the index."""
        if self._lookups is not self._checks:
            logger.warning("%s: %s is %s: lookups check the disk", self.name, self.root, why)
            self._lookups = self._ledger.verdicts = self._checks

    def _answers_from_index(self) -> bool:
        """Whether lookups are answered from the catalog alone (an owner whose catalog is in
        line with the folder), which a walk while open keeps so."""
        return self._lookups is self._index

    def _reconciled(self) -> None:
        """The catalog loaded at open is in line with the folder: the index answers alone."""
        if self._lookups is self._interim:
            self._lookups = self._ledger.verdicts = self._index

    # -- lookup --------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        catalog = self._catalog
        if key in catalog.storing and catalog.retry_while_writing(key):
            # Its file is not there yet: not a miss. Listeners hear the key when it lands.
            return LookupResult.RETRY
        return self._lookups.lookup(key)

    def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, MissReason | None]:
        catalog = self._catalog
        if key in catalog.storing and catalog.retry_while_writing(key):
            return LookupResult.RETRY, None
        return self._lookups.lookup_with_reason(key)

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self._lookups.record(key, False, reason)

    def record_hit(self, key: bytes) -> None:
        self._lookups.record(key, True)

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        names = [name_of(check_key(k)) for k in keys]
        files, catalog = self._files, self._catalog
        files.calls.drain_late()
        root = self.root
        with catalog.watching() as since:
            try:
                sizes: list[int | None] = await files.calls.run(
                    lambda _: stat_many(root, names), limiter=files.checks
                )
            except (OSError, Stuck) as exc:
                raise self._ledger.error(exc, "contains") from exc
            self._ledger.checked(keys, names, sizes, since)
        return [size is not None for size in sizes]

    # -- data ----------------------------------------------------------------------------------

    async def load(self, key: bytes, dst: memoryview) -> None:
        check_key(key)
        view = writable_bytes(dst)
        name = name_of(key)
        started = time.perf_counter()
        files, ledger = self._files, self._ledger
        files.calls.drain_late()

        def read(call: Handoff) -> ReadOutcome:
            # Through a private buffer: a thread abandoned mid-read must never write into a
            # pool slot that may already hold another block.
            return _blocks.read_into_slot(files, call, key, name, view, private=True)

        with self._catalog.watching() as since:
            try:
                outcome = await files.calls.run(read, limiter=files.reads)
            except WrongSize as exc:
                raise InvalidArgumentError(
                    f"dst holds {view.nbytes} bytes but block {key.hex()} is {exc.stored} bytes"
                ) from None
            except Corrupt as exc:
                raise ledger.corrupt(key, name, since, str(exc)) from exc
            except (OSError, Stuck) as exc:
                raise ledger.load_failed(exc, key) from exc
        if outcome is ReadOutcome.MISSING:
            raise ledger.missing(key, name, since)
        ledger.loaded(key, name, view.nbytes, time.perf_counter() - started)

    async def store(self, key: bytes, src: memoryview) -> None:
        check_key(key)
        payload = readable_bytes(src)
        catalog = self._catalog
        while (busy := catalog.storing.get(key)) is not None:
            await busy.wait()  # the same key is being written: let that store decide
        done = anyio.Event()
        catalog.begin_store(key, done)
        try:
            await self._store(key, payload)
        finally:
            catalog.end_store(key)
            done.set()
            self._ledger.stores_ended([key])
            self._upkeep.follow()

    async def _store(self, key: bytes, payload: memoryview) -> None:
        """Reserve room, write, book the outcome; on a full disk, evict the least recently
        used blocks with it and write again (``Ledger.make_room``)."""
        started, name = time.perf_counter(), name_of(key)
        files, ledger = self._files, self._ledger
        files.calls.drain_late()
        if not self._catalog.ready:
            await self._prepare(raise_unavailable=True)  # counts its own failure
        res = ledger.reserve(key, name, payload.nbytes)

        def write(call: Handoff) -> tuple[WriteOutcome, int]:
            # Copy out of the caller's memory (a pool slot) first: once the caller's deadline
            # fires it unpins the slot, and an abandoned write must not read it any more.
            return _blocks.write_from_slot(
                files, call, key, name, payload, res.victim_names, private=True
            )

        attempt = 0
        while True:
            call = Handoff()
            try:
                result = await files.calls.run(
                    write, limiter=files.writes, on_late=ledger.late_store(res), handoff=call
                )
            except OSError as exc:  # the thread ran to its end: nothing is left running
                if ledger.make_room(res, exc, attempt):
                    attempt += 1
                    continue
                ledger.settle(res, None, touched=True)
                raise ledger.error(exc, "store", key) from exc
            except BaseException as exc:
                if not call.left_running:  # else the late hook settles it when it finishes
                    landed = cast("tuple[WriteOutcome, int] | None", call.result)  # late
                    ledger.settle(res, landed, touched=call.started)
                if isinstance(exc, Stuck):
                    raise ledger.error(exc, "store", key) from exc
                raise
            break
        ledger.stored(res, result, payload.nbytes, time.perf_counter() - started)

    # -- batches -------------------------------------------------------------------------------

    async def _load_batch(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        """``load`` for many blocks in a few thread hops: the batch is split into at most
        ``max_concurrency`` runs, each read in turn by one worker thread. Pinned, a run
        reads straight into ``dsts`` (buffered I/O) and a cancellation waits for it; else
        through private buffers, as ``load`` does."""
        keys = [check_key(k) for k in keys]
        views = [writable_bytes(d) for d in dsts]
        batch = _batch.Batch.of(self._files, self._ledger, keys, views, pinned)
        return await _batch.load_many(batch, deadline)

    async def _load_lent(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], deadline: float, lender: Lender
    ) -> BatchResults:
        """``_load_batch`` straight into ``dsts``, as pinned, yet walking away at the
        deadline: a run left reading keeps its block's buffer through ``lender``."""
        keys = [check_key(k) for k in keys]
        views = [writable_bytes(d) for d in dsts]
        batch = _batch.Batch.of(self._files, self._ledger, keys, views, False, lender)
        return await _batch.load_many(batch, deadline)

    async def _store_batch(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        """``store`` for many blocks in a few thread hops (see ``_load_batch``). Pinned, a run
        writes straight from ``srcs``; else it copies each block out first, as ``store``
        does. Capacity, victims and publishing are ``store``'s, block by block."""
        keys = [check_key(k) for k in keys]
        payloads = [readable_bytes(s) for s in srcs]
        batch = _batch.Batch.of(self._files, self._ledger, keys, payloads, pinned)
        try:  # a block that found the disk full is stored again alone, making room
            return await _batch.store_many(
                batch, deadline, self._prepare_for_store, self.store, self._store
            )
        finally:
            self._upkeep.follow()

    async def delete(self, key: bytes) -> None:
        """Remove ``key``'s block. Stores and deletes of one key run one at a time: a delete
        waits for a store of the key in flight, and a store for a delete (both are in
        ``Catalog.storing`` while they run). Run together, a delete whose file removal came
        after a store's rename, and whose catalog drop after that store's add, would leave
        the owner's catalog without a file that is there (a miss until the next open), or
        take the block a store had just acknowledged."""
        check_key(key)
        catalog = self._catalog
        while (busy := catalog.storing.get(key)) is not None:
            await busy.wait()  # the key is being written: this delete comes after it
        done = anyio.Event()
        catalog.begin_store(key, done)
        try:
            await self._delete(key)
        finally:
            catalog.end_store(key)
            done.set()
            self._ledger.stores_ended([key])

    async def _delete(self, key: bytes) -> None:
        name = name_of(key)
        root, files, catalog = self.root, self._files, self._catalog
        catalog.change(name)  # a walk meanwhile leaves its removal to this delete
        try:
            removed = await files.calls.run(lambda _: remove_block(root, name), limiter=files.reads)
        except (OSError, Stuck) as exc:
            raise self._ledger.error(exc, "delete", key) from exc
        finally:
            catalog.changed([name])
        held = catalog.drop(name)
        self._lookups.record(key, False, MissReason.NOT_FOUND)
        if removed or held:
            self.events.emit(EventKind.REMOVED, (key,), reason="deleted")
        self._ledger.meter.deletes += removed

    def demote(self, keys: Sequence[bytes]) -> int:
        """Let ``keys`` go first when the tier must evict for ``capacity_bytes``: the
        catalog's order (what it does not hold, it leaves alone)."""
        return self._catalog.demote(name_of(key) for key in keys)

    # -- state ---------------------------------------------------------------------------------

    def held_keys(self) -> list[bytes]:
        """The keys of the blocks the catalog holds (a router's full state; read-only)."""
        return self.held_keys_reader()()

    def held_keys_reader(self) -> Callable[[], list[bytes]]:
        """``held_keys`` as the catalog is now, to read in a worker thread: a full state of
        millions of blocks never holds the loop for more than a copy of its columns."""
        return self._catalog.keys_reader()

    def statistics(self) -> FSTierStatistics:
        self._files.calls.drain_late()
        lookups = self._lookups.statistics()
        if retries := self._catalog.writing_retries:
            lookups = dataclasses.replace(lookups, retries=lookups.retries + retries)
        base = self._ledger.meter.snapshot(
            self.name, lookups, blocks=self._catalog.blocks, bytes_stored=self._catalog.used
        )
        return self._persistence.statistics(base)

    def __repr__(self) -> str:
        catalog, files = self._catalog, self._files
        return describe(
            "FSTier",
            repr(self.name),
            f"root={str(self.root)!r}",
            stats=self.statistics(),
            shown="blocks bytes_stored lookups.pending",
            ready=catalog.ready,
            capacity=self.capacity_bytes,
            fsync=self.fsync,
            shared=self.shared,
            owner=self.owner,
            direct=files.direct,
            signed=self.integrity_key is not None,
            storing=len(catalog.storing),
            stuck_threads=files.calls.stuck,
            disk_full_evictions=self._ledger.disk_full_evictions,
        )
