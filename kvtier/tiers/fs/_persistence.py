"""An owner's catalog across restarts: ``CatalogPersistence`` and ``FSTierStatistics``.

A tier that owns its folder keeps its catalog there (``_catalog_journal``: a checkpoint and a
log, written in the background) and, at the next open, reads it back (``load``, in the worker
thread that prepares the root, once the claim made the tier the owner) instead of walking the
folder before it serves anything. It then answers at once: keys in the loaded catalog from the
index, others from the disk (``_index.IndexThenChecks``), while a walk in the background
(``_reconcile``) brings the catalog in line with the folder; then lookups go back to the index
alone (``on_complete``). A missing, old or damaged checkpoint falls back to the walk at open,
as a tier that keeps nothing does, and says why once.

``fsync``: with ``never`` nothing is synced (a crash of the process loses nothing written; a
power loss may leave a checkpoint the checksum refuses: the folder is walked); otherwise
checkpoints are synced before and after their rename and each flush of the log is
``fdatasync``-ed, once per ``FLUSH_SECONDS`` at most, whatever the number of stores.

A shared folder's tier keeps nothing: other processes change the folder all the time, and
its lookups check the disk anyway. An owner that finds another process on its folder while
it runs goes on keeping its catalog (it is still the best account of the LRU order there is,
and it is the only writer of these files: no other tier can own the folder until it closes);
what the other process changed is reconciled at the next open.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc

from kvtier.common._logging import BurstLogger
from kvtier.common._threads import run_sync
from kvtier.tiers._base import TierStatistics
from kvtier.tiers.fs import _catalog_files
from kvtier.tiers.fs._catalog import Built, Catalog
from kvtier.tiers.fs._catalog_files import JournalFiles, Loaded
from kvtier.tiers.fs._catalog_format import Limits
from kvtier.tiers.fs._catalog_journal import CatalogJournal
from kvtier.tiers.fs._keeper import Prepared
from kvtier.tiers.fs._layout import Entry
from kvtier.tiers.fs._packed_build import Columns
from kvtier.tiers.fs._reconcile import Difference, apply, compare

__all__ = ["CatalogPersistence", "FSTierStatistics"]

logger = logging.getLogger("kvtier.tiers.fs")
_walk_log = BurstLogger(logger)

WALK_COST_RATIO = 50
"""A walk while open waits at least this many times the CPU time the last one took: on a large
folder a walk is seconds of a thread, and a check for what nobody announced should take a few
percent of it at most. CPU time, not wall time: under a burst of stores the walk's thread waits
for the interpreter lock many times longer than it works, and a ratio of that wait would put
the next walk off for many minutes."""


@dataclass(frozen=True, slots=True)
class FSTierStatistics(TierStatistics):
    """``TierStatistics`` plus the catalog kept across restarts: whether this open read it
    from the checkpoint (else it walked the folder), whether it is in line with the folder
    (a catalog from a checkpoint is not until the walk in the background ends: until then
    keys it does not hold are checked on the disk), and its writes."""

    catalog_from_checkpoint: bool = False
    catalog_complete: bool = True
    catalog_checkpoints: int = 0
    catalog_log_writes: int = 0
    catalog_write_failures: int = 0
    catalog_unwritten_changes: int = 0  # what a kill -9 would lose of the LRU order now
    catalog_walks: int = 0  # walks while open that brought the catalog in line (``walk_interval``)
    catalog_walk_failures: int = 0


class CatalogPersistence:
    """Loads, keeps and reconciles one owner's catalog; see the module docstring."""

    def __init__(
        self,
        name: str,
        root: Path,
        catalog: Catalog[anyio.Event],
        forget: Callable[[list[str]], None],
        fsync: str,
        limits: Limits | None = None,
        *,
        found: Callable[[list[str]], None] = lambda names: None,
    ) -> None:
        self.name = name
        self.root = root
        self._catalog = catalog
        self._forget = forget  # entries the walk found without a file: ``not_found``
        self._found = found  # files the walk found that the catalog lacked: ``stored``
        self._limits = limits or Limits()
        self._durable = fsync != "never"
        self.loaded: Loaded | None = None  # read by ``load``, until the walk has compared it
        self._base: Columns | None = None  # the catalog as loaded, for the walk to compare
        self.from_checkpoint = False
        self.complete = True
        self.journal: CatalogJournal | None = None
        self._since: int | None = None  # the epoch the walk compares from, while watched
        self._walked = anyio.Event()  # the walk ended (or there is none)
        self._walked.set()
        self.walks = self.walk_failures = 0  # the walks while open (``walk_again``)
        self._walk_cpu = 0.0  # the CPU time the last walk took

    # -- open ----------------------------------------------------------------------------------

    def load(self) -> bool:
        """Read the catalog kept in the root (a worker thread, at open, as the owner);
        whether there was a usable one. Says once why not."""
        loaded, why = _catalog_files.load(self.root, self._limits)
        self.loaded = loaded
        if loaded is None:
            level = logging.INFO if why == "no checkpoint" else logging.WARNING
            logger.log(level, "%s: %s: %s; walking the folder", self.name, self.root, why)
        return loaded is not None

    def built(self, ready: Prepared) -> tuple[Prepared, Built]:
        """``ready`` and the catalog's index of what it read (the loaded catalog, or the
        walk's entries), built in the worker thread that prepared the root."""
        loaded = self.loaded if ready.loaded else None
        if loaded is not None:
            # The catalog takes the index over; the walk compares the folder with a copy.
            self._base = loaded.columns
            return ready, Built(loaded.order, loaded.order.total)
        entries = ready.entries
        return ready, Catalog.build(
            ((e.name, e.size) for e in entries), sum(e.size for e in entries)
        )

    def attach(self, walked: Sequence[Entry]) -> None:
        """The tier opened as the owner and its catalog was just reset from what ``load``
        read, or else from the ``walked`` entries: keep it from now on."""
        catalog, loaded = self._catalog, self.loaded
        files = JournalFiles(self.root, self._durable, self._limits)
        self.journal = journal = CatalogJournal(self.name, files, catalog.entries)
        catalog.changes = journal
        self.from_checkpoint = loaded is not None
        if loaded is None:
            journal.state.walked(walked)  # its first write is their checkpoint
            return
        journal.state.resume(
            loaded.generation, loaded.checkpoint_entries, loaded.log_changes, loaded.log_end
        )
        self.complete = False
        self._walked = anyio.Event()
        self._since = catalog.watch()
        logger.info(
            "%s: %s: opened from its catalog (%d entries, %d changes replayed%s); checking "
            "the folder in the background",
            self.name,
            self.root,
            loaded.entries,
            loaded.log_changes,
            f"; {loaded.log_note}" if loaded.log_note else "",
        )

    def start(
        self,
        tg: anyio.abc.TaskGroup,
        on_complete: Callable[[], None],
        walk_interval: float | None,
        owner: Callable[[], bool],
    ) -> None:
        """The tier's task group is open: write in the background, reconcile a catalog
        loaded from a checkpoint with the folder, and walk it again every ``walk_interval``
        seconds while ``owner()`` (``walk_again``)."""
        if self.journal is not None:
            tg.start_soon(self.journal.run)
            if walk_interval is not None:
                tg.start_soon(self.walk_again, walk_interval, owner)
        if self._base is not None and self._since is not None:
            tg.start_soon(self._reconcile, self._base, on_complete)

    async def _reconcile(self, base: Columns, on_complete: Callable[[], None]) -> None:
        since = self._since
        assert since is not None
        try:
            diff = await run_sync(compare, self.root, base, abandon_on_cancel=True)
            self.loaded = self._base = None  # compared: its memory goes
            del base
            done = await apply(self._catalog, diff, since, self._forget, self._found)
            self.complete = True
            on_complete()
        except Exception as exc:  # a task that serves the tier lives on, and says so
            logger.warning(
                "%s: walking %s failed (%r): keys the catalog lacks are checked on the disk",
                self.name,
                self.root,
                exc,
            )
            return
        finally:
            self._unwatch()
            self._walked.set()
        logger.info(
            "%s: %s: catalog complete: %d files found, %d entries without a file dropped",
            self.name,
            self.root,
            done.found,
            len(done.gone),
        )

    async def walk_again(self, every: float, owner: Callable[[], bool]) -> None:
        """Walk the folder again every ``every`` seconds, and at least ``WALK_COST_RATIO``
        times the CPU time the last walk took, while the tier answers lookups from its catalog
        (``owner()``): a file removed behind the tier's back (by hand, by a cleanup job) is
        dropped and said as removed (``not_found``), a block file the catalog lacked is taken
        in and said as stored, within a bound rather than at the block's next load or the
        next open. The walk at open comes first. Until cancelled (the tier's close)."""
        await self._walked.wait()
        while True:
            await anyio.sleep(max(every, WALK_COST_RATIO * self._walk_cpu))
            if owner():
                await self._walk_once()

    async def _walk_once(self) -> None:
        """One walk while open, compared with the catalog as it is when the walk begins
        (what the tier does meanwhile is not undone: ``_reconcile``); a failure is logged
        and counted, and the next walk runs on time."""
        catalog = self._catalog
        self._walk_cpu = 0.0
        try:
            with catalog.watching() as since:
                base = catalog.columns()
                diff, self._walk_cpu = await run_sync(
                    _compare_timed, self.root, base, abandon_on_cancel=True
                )
                del base
                done = await apply(catalog, diff, since, self._forget, self._found)
        except Exception as exc:  # a task that serves the tier lives on, and says so
            self.walk_failures += 1
            _walk_log.warning(
                f"walk:{self.root}", "%s: walking %s failed (%r)", self.name, self.root, exc
            )
            return
        self.walks += 1
        if done.found or done.gone:
            logger.info(
                "%s: %s: a walk found %d files the catalog lacked and %d entries without a file",
                self.name,
                self.root,
                done.found,
                len(done.gone),
            )

    async def walked(self) -> None:
        """Wait until the walk that reconciles a loaded catalog has ended (at once when there
        is none): ``complete`` says whether it succeeded."""
        await self._walked.wait()

    def _unwatch(self) -> None:
        if self._since is not None:
            self._since = None
            self._catalog.unwatch()

    # -- close ---------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """The tier closes: a last checkpoint (shielded, bounded), and nothing kept after."""
        self._unwatch()
        self._walked.set()
        self.loaded = self._base = None
        journal = self.journal
        if journal is not None and self._catalog.changes is journal:
            self._catalog.changes = None
            await journal.aclose()

    def statistics(self, base: TierStatistics) -> FSTierStatistics:
        journal = self.journal
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return FSTierStatistics(
            **fields,
            catalog_from_checkpoint=self.from_checkpoint,
            catalog_complete=self.complete,
            catalog_checkpoints=journal.checkpoints if journal else 0,
            catalog_log_writes=journal.appends if journal else 0,
            catalog_write_failures=journal.failures if journal else 0,
            catalog_unwritten_changes=journal.unwritten if journal else 0,
            catalog_walks=self.walks,
            catalog_walk_failures=self.walk_failures,
        )


def _compare_timed(root: Path, base: Columns) -> tuple[Difference, float]:
    """``compare`` in a worker thread, with the CPU time the thread spent on the walk itself
    (the removal of the empty shard folders it found is the stores' cost, not the walk's)."""
    cpu = time.thread_time()
    diff = compare(root, base)
    return diff, time.thread_time() - cpu - diff.pruning.cpu_seconds
