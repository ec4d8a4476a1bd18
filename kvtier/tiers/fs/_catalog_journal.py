"""Keeping an owner's catalog in its root, in the background: ``CatalogJournal``.

The catalog tells the journal each change as it makes it (``Catalog.changes``); noting one
costs three appends on the event loop. Every ``FLUSH_SECONDS``, and at close, the journal hands
what it noted to a worker thread (``_catalog_files.JournalFiles``), which encodes it and
appends it to the log as frames: batched, so a busy tier costs one write a second, and off
the loop. A kill -9 loses at most the changes of the last ``FLUSH_SECONDS``; the next open
replays the rest onto the checkpoint, and the walk that follows finds the files those
changes were about.

A new checkpoint (the whole catalog, with a new generation and an empty log) is written when
the log would pass ``max(checkpoint entries, MIN_LOG_CHANGES)`` changes (so replaying the log
never costs more than reading the checkpoint) and at a clean close (so the next open replays
nothing). It is made in the worker thread from the files themselves (``Compact``: append what
is noted, read checkpoint and log back, write their replay), so the event loop never copies
the catalog for it. The catalog is copied on the loop only when no file holds it: after a
write failed (the log may be torn), or after the catalog was replaced by a walk of a root
that came back (``Rewrite``); the walk at open hands its own list over instead.

``JournalState`` is the synchronous half (what is noted, what to write next, what a write
that ended means); ``CatalogJournal`` awaits the writes around it. A write that fails is
logged once per burst, counted, and answered by a checkpoint at the next flush; a write that
hangs (a dead mount) is abandoned after ``WRITE_SECONDS`` and the journal stops, so close stays
bounded.
"""

from __future__ import annotations

import array
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio

from kvtier.common._logging import BurstLogger
from kvtier.tiers.fs._catalog_files import JournalFiles, new_generation
from kvtier.tiers.fs._catalog_format import MAX_FRAME_CHANGES, Change, encode_frame
from kvtier.tiers.fs._layout import Entry

__all__ = [
    "FLUSH_SECONDS",
    "MIN_LOG_CHANGES",
    "WRITE_SECONDS",
    "Append",
    "CatalogJournal",
    "Changes",
    "Compact",
    "Job",
    "JournalState",
    "Rewrite",
]

logger = logging.getLogger("kvtier.tiers.fs")

FLUSH_SECONDS = 1.0
"""How often noted changes are written: what a kill -9 may lose of the LRU order."""
MIN_LOG_CHANGES = 65536
"""A log may hold this many changes, or as many as its checkpoint's entries, before a new
checkpoint replaces both."""
WRITE_SECONDS = 30.0
"""The bound on one write (a checkpoint of millions of entries included); past it the file
system is taken for hung and the journal stops."""


@dataclass(frozen=True, slots=True)
class Changes:
    """Changes noted, in order, as columns (what a log frame holds)."""

    ops: bytearray = field(default_factory=bytearray)
    names: list[str] = field(default_factory=list)
    sizes: array.array[int] = field(default_factory=lambda: array.array("Q"))

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True, slots=True)
class Rewrite:
    """Write a checkpoint of ``generation`` holding ``entries`` (a copy of the catalog, or
    the walk it was just reset from), then a new log holding ``then``."""

    generation: int
    entries: Sequence[tuple[str, int]] | Sequence[Entry]
    then: Changes


@dataclass(frozen=True, slots=True)
class Append:
    """Append ``changes`` to the log of ``generation`` (``resume_end``: the log in place, cut
    there; None: the log open, or a new one)."""

    generation: int
    resume_end: int | None
    changes: Changes


@dataclass(frozen=True, slots=True)
class Compact:
    """Append ``changes`` to the log of ``previous``, then replace checkpoint and log by a
    checkpoint of ``generation``: the one read back from them, in the worker thread, so the
    catalog is never copied on the loop."""

    generation: int
    previous: int
    resume_end: int | None
    changes: Changes


Job = Rewrite | Append | Compact


class JournalState:
    """What the catalog changed since the last write, and what to write next."""

    def __init__(self) -> None:
        self.generation = 0  # the checkpoint in place (0: none)
        self.checkpoint_entries = 0
        self.log_changes = 0  # changes in the log of that checkpoint
        self.resume_end: int | None = None  # the loaded log, cut there, until first appended
        self.rewrite = True  # the next write copies the catalog: notes are not kept till then
        self._base: Sequence[Entry] | None = None  # what the catalog was reset from
        self._changes = Changes()

    def resume(self, generation: int, entries: int, log_changes: int, end: int | None) -> None:
        """The catalog was loaded from the checkpoint ``generation`` (``entries``) and
        ``log_changes`` changes of its log, whose good frames end at ``end``."""
        self.generation, self.checkpoint_entries = generation, entries
        self.log_changes, self.resume_end = log_changes, end
        self.rewrite, self._base, self._changes = False, None, Changes()

    def walked(self, entries: Sequence[Entry]) -> None:
        """The catalog was just reset from the walk's ``entries``: the next write is their
        checkpoint, and changes from now on go to its log."""
        self.rewrite, self._base, self._changes = False, entries, Changes()

    @property
    def pending(self) -> int:
        return len(self._changes)

    @property
    def due(self) -> bool:
        """Whether the next write is a checkpoint of what the log does not hold."""
        return self.rewrite or self._base is not None

    def note(self, change: Change, name: str, size: int) -> None:
        if self.rewrite:
            return  # the next checkpoint holds it
        changes = self._changes
        changes.ops.append(change)
        changes.names.append(name)
        changes.sizes.append(size)

    def replaced(self) -> None:
        """The catalog was replaced as a whole, or a write failed (the log may be torn): the
        next write copies the catalog."""
        self.rewrite, self._base, self._changes = True, None, Changes()

    def failed(self) -> None:
        self.replaced()

    def take(self, entries: Callable[[], list[tuple[str, int]]], final: bool) -> Job | None:
        """The next write (None: nothing to write), counted as done: changes noted after it
        go to the log it leaves (a write that fails calls ``failed``). ``entries``: a copy
        of the catalog, for the rare checkpoint nothing else can give; ``final``: the tier
        closes, so a checkpoint if anything changed."""
        changes, generation = self._changes, new_generation()
        job: Job
        if self.rewrite or self._base is not None:
            base = entries() if self._base is None else self._base
            job = Rewrite(generation, base, changes)
            self.checkpoint_entries, self.log_changes = len(base), len(changes)
            self.generation, self.rewrite, self._base = generation, False, None
        elif (final and (self.log_changes or changes)) or self._past_bound():
            job = Compact(generation, self.generation, self.resume_end, changes)
            self.checkpoint_entries += len(changes)  # at most; ``compacted`` says
            self.generation, self.log_changes = generation, 0
        elif changes:
            job = Append(self.generation, self.resume_end, changes)
            self.log_changes += len(changes)
        else:
            return None
        self._changes = Changes()
        self.resume_end = None  # the writer holds the log open after this write
        return job

    def compacted(self, entries: int) -> None:
        """A ``Compact`` wrote a checkpoint of ``entries``."""
        self.checkpoint_entries = entries

    def _past_bound(self) -> bool:
        most = max(self.checkpoint_entries, MIN_LOG_CHANGES)
        return self.log_changes + len(self._changes) > most


def _columns(
    entries: Sequence[tuple[str, int]] | Sequence[Entry],
) -> tuple[list[str], array.array[int]]:
    pairs = [(e.name, e.size) if isinstance(e, Entry) else e for e in entries]
    return [n for n, _ in pairs], array.array("Q", (size for _, size in pairs))


def _frames(generation: int, changes: Changes) -> list[bytes]:
    step = MAX_FRAME_CHANGES
    return [
        encode_frame(
            generation,
            bytes(changes.ops[i : i + step]),
            changes.names[i : i + step],
            changes.sizes[i : i + step],
        )
        for i in range(0, len(changes), step)
    ]


def _write(files: JournalFiles, job: Job) -> int:
    """One write, in a worker thread; the entries of the checkpoint it wrote (0: none)."""
    if isinstance(job, Rewrite):
        names, sizes = _columns(job.entries)
        files.checkpoint(job.generation, names, sizes)
        if job.then:
            files.append(job.generation, None, _frames(job.generation, job.then))
        return len(names)
    if isinstance(job, Append):
        files.append(job.generation, job.resume_end, _frames(job.generation, job.changes))
        return 0
    frames = _frames(job.previous, job.changes)
    return files.compact(job.previous, job.resume_end, frames, job.generation)


class CatalogJournal:
    """Writes one tier's catalog changes to its root in the background."""

    def __init__(
        self, name: str, files: JournalFiles, entries: Callable[[], list[tuple[str, int]]]
    ) -> None:
        """``entries``: the catalog's entries, least recently used first (``Catalog.entries``)."""
        self.name = name
        self.state = JournalState()
        self._files = files
        self._entries = entries
        self._lock = anyio.Lock()  # one write at a time, in order
        self.stopped = False  # a write hung: nothing more is written
        self.checkpoints = 0
        self.appends = 0
        self.failures = 0
        self._writing = 0  # changes in the write under way
        self._log = BurstLogger(logger)

    @property
    def unwritten(self) -> int:
        """Changes noted and not yet written (a checkpoint due counts one): what a kill -9
        would lose of the LRU order now."""
        state = self.state
        return state.pending + state.due + self._writing

    # ``Catalog.changes``
    def note(self, change: Change, name: str, size: int) -> None:
        self.state.note(change, name, size)

    def replaced(self) -> None:
        self.state.replaced()

    async def run(self) -> None:
        """Flush every ``FLUSH_SECONDS`` until cancelled (the tier's close)."""
        while True:
            await anyio.sleep(FLUSH_SECONDS)
            await self.flush()

    async def flush(self, *, final: bool = False) -> None:
        """Write what was noted (with ``final``, a checkpoint if anything changed). Shielded:
        a write that began ends and is accounted for, within ``WRITE_SECONDS``."""
        with anyio.CancelScope(shield=True):
            async with self._lock:
                if self.stopped:
                    return
                job = self.state.take(self._entries, final)
                if job is None:
                    return
                self._writing = max(1, len(job.then if isinstance(job, Rewrite) else job.changes))
                try:
                    await self._write(job)
                finally:
                    self._writing = 0

    async def _write(self, job: Job) -> None:
        """One write in a worker thread, bounded by ``WRITE_SECONDS``; its outcome booked."""
        with anyio.move_on_after(WRITE_SECONDS) as scope:
            try:
                entries = await anyio.to_thread.run_sync(
                    functools.partial(_write, self._files, job), abandon_on_cancel=True
                )
            except Exception as exc:  # counted and logged; the next flush rewrites
                self.state.failed()
                self.failures += 1
                self._log.warning("journal", "%s: writing its catalog failed: %r", self.name, exc)
                return
        if scope.cancelled_caught:
            self.stopped = True
            self.state.replaced()  # notes are not kept any more
            self.failures += 1
            self._log.warning(
                "journal",
                "%s: writing its catalog took over %.0f s: no longer kept",
                self.name,
                WRITE_SECONDS,
            )
            return
        if isinstance(job, Append):
            self.appends += 1
            return
        self.checkpoints += 1
        if isinstance(job, Compact):
            self.state.compacted(entries)

    async def aclose(self) -> None:
        """The tier closes cleanly: a last checkpoint, so the next open replays nothing."""
        await self.flush(final=True)
        if self.state.log_changes:  # that checkpoint was of a walk, its log holds the rest
            await self.flush(final=True)
        if not self.stopped:
            self._files.close()

    def __repr__(self) -> str:
        state = self.state
        return (
            f"<CatalogJournal generation={state.generation:x} pending={state.pending} "
            f"log_changes={state.log_changes} checkpoints={self.checkpoints} "
            f"failures={self.failures} stopped={self.stopped}>"
        )
