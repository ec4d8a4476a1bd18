"""The files at the top of an FS tier's folder, from open to close: ``FolderKeeper``.

At open the keeper makes the root, checks or writes the format marker and the identity
manifest (``_marker``), lists the blocks, probes O_DIRECT and takes the folder's locks
(``_ownership``). A folder that lost its marker but holds only kvtier's files is not foreign:
the opener waits for the process that uses it to write the marker back, or, when nobody
does, adopts it once a sample of its blocks shows they were written with this tier's
settings (a tier of another configuration would call them corrupt and remove them).

While the tier runs it keeps them, because the folder is shared with people and processes:
someone may empty it (``rm -rf cache/*`` takes marker, manifest and lock file with the
blocks), remove the marker, delete the lock file, or start another kvtier on it. A ``check``
writes back what is gone (created exclusively, as at open: a tier that took the folder meanwhile
keeps its marker, and one that disagrees makes the folder refused), takes the locks again,
and gives up ownership when another process uses the folder.

``FSTier`` checks every ``CHECK_SECONDS`` (the bound on how long an owner may miss another
writer's blocks, or a folder may go without its marker), and a store checks when it has to
make a shard folder, which is the first thing a store into an emptied folder does, so a
folder that is written to is marked again before its first new block lands.

Synchronous and thread-safe: it runs in worker threads. What a check found is queued
(``reports``) for the tier to act on, on the event loop: a log line, lookups that check the
disk once the folder is shared, a folder refused.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import IntegrityKey
from kvtier.common._identity import CacheIdentity
from kvtier.tiers.fs import _root
from kvtier.tiers.fs._layout import IDENTITY_NAME, MARKER_NAME, Entry, IncompatibleRoot
from kvtier.tiers.fs._marker import (
    Unmarked,
    check_marker,
    claim_identity,
    marker_for,
    read_identity,
    restore_marker,
)
from kvtier.tiers.fs._ownership import Claim, Sharing, claim, in_use
from kvtier.tiers.fs._read import unlike

__all__ = [
    "CHECK_SECONDS",
    "MARKER_WAIT_SECONDS",
    "SAMPLE_BLOCKS",
    "FolderKeeper",
    "Prepared",
    "Report",
]

logger = logging.getLogger("kvtier.tiers.fs")

CHECK_SECONDS = 1.0
"""How often a running tier checks its folder (a ``stat`` or two and a lock query per lock)."""
MARKER_WAIT_SECONDS = 5 * CHECK_SECONDS
"""How long an opener waits for the process that uses a folder to write its lost marker back
(its next check, with room for a busy machine) before adopting the folder itself."""
SAMPLE_BLOCKS = 16
"""How many of its blocks an opener reads whole before adopting a folder that lost its marker:
enough to tell another configuration's folder, bounded so an open stays quick."""
_MARKER_POLL_SECONDS = CHECK_SECONDS / 20


@dataclass(frozen=True, slots=True)
class Prepared:
    """A root made ready: its blocks (oldest first), why O_DIRECT is refused there (falsy:
    it is not), the claim taken now (None when the tier held one already), and whether the
    catalog kept in the root was loaded instead of listing the blocks."""

    entries: list[Entry]
    direct_refused: str | bool | None
    claimed: Claim | None
    loaded: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """What a check found: files written back or locked again, why the tier stopped owning
    the folder, why the folder is no longer this tier's to use, and why the check itself
    failed, when a store made it (None: nothing)."""

    restored: tuple[str, ...] = ()
    gave_up: str | None = None
    refused: str | None = None
    failed: str | None = None

    def __bool__(self) -> bool:
        return bool(self.restored or self.gave_up or self.refused or self.failed)


class FolderKeeper:
    """Prepares an FS tier's root at open and keeps its marker, manifest and locks."""

    def __init__(
        self,
        root: Path,
        integrity_key: IntegrityKey | None,
        identity: CacheIdentity | None,
        container: Path | None,
        shared: Sharing,
    ) -> None:
        self.root = root
        self._integrity_key = integrity_key
        self._marker = marker_for(integrity_key)
        self._identity = identity
        self._container = container  # the root that holds one folder per identity
        self._shared = shared
        self._lock = threading.Lock()  # one prepare or check at a time
        self.claim: Claim | None = None  # the folder's locks, once taken
        self._generation = 0  # moved on at each close: a prepare begun before claims nothing
        self._marker_inode: tuple[int, int] | None = None  # the marker checked last
        self.refused: str | None = None  # why the folder stopped being this tier's
        self.reports: deque[Report] = deque()  # for the tier, on the event loop

    @property
    def owner(self) -> bool | None:
        """Whether the tier owns the folder (None: it has not claimed it)."""
        held = self.claim
        return None if held is None else held.owner

    @property
    def generation(self) -> int:
        """Which open of the tier this is, for ``prepare`` (read it on the event loop)."""
        return self._generation

    def prepare(
        self, probe_direct: bool, generation: int, load: Callable[[], bool] | None = None
    ) -> Prepared:
        """Make the root ready (``_root.ready_root``), check its identity, probe O_DIRECT,
        claim the folder unless this tier holds it already, or was closed since
        ``generation`` (a prepare that hung until after the close claims nothing), and list
        its blocks (``_root.list_blocks``), unless the claim made the tier the owner and
        ``load`` read the catalog it kept (``Prepared.loaded``: the blocks are listed in the
        background instead). Raises ``OSError``, ``IncompatibleRoot``, ``FolderBusy`` and the
        identity errors."""
        with self._lock:
            if self._container is not None:
                _root.make_root(self._container)
            try:
                _root.ready_root(self.root, self._marker)
            except Unmarked:
                self._unmarked(generation)
                _root.ready_root(self.root, self._marker)  # checks the marker now
            if self._identity is not None:
                claim_identity(self.root, self._identity)
            self._marker_inode = _inode(self.root / MARKER_NAME)
            refused = probe_direct and _root.direct_refused(self.root)
            self.refused = None
            claimed = None
            if self.claim is None and generation == self._generation:
                self.claim = claimed = claim(self.root, self._shared)
            try:
                if claimed is not None and claimed.owner and load is not None and load():
                    return Prepared([], refused, claimed, loaded=True)
                return Prepared(_root.list_blocks(self.root), refused, claimed)
            except BaseException:
                if claimed is not None:  # not this tier's after all: let go of it
                    self.claim = None
                    claimed.release()
                raise

    def check(self) -> Report:
        """Write back the marker and manifest when they are gone, check a marker another
        process replaced, take the locks again where the lock file was removed, and give up
        ownership when another process uses the folder. The report is also queued. Raises
        ``OSError`` when the folder cannot be reached."""
        with self._lock:
            held = self.claim
            if held is None:
                return Report()
            restored: list[str] = []
            try:
                self._keep_marker(restored)
                if self._identity is not None and not os.path.lexists(self.root / IDENTITY_NAME):
                    claim_identity(self.root, self._identity)
                    restored.append(IDENTITY_NAME)
            except (IncompatibleRoot, InvalidArgumentError) as exc:
                self.refused = str(exc)
                return self._queued(Report(refused=self.refused))
            renewed, gave_up = held.check()
            return self._queued(Report((*restored, *renewed), gave_up))

    def shard_made(self) -> None:
        """A store made a shard folder (in its worker thread): ``check``, whose report is
        queued; an error is queued too, never raised into the store."""
        try:
            self.check()
        except OSError as exc:
            self.reports.append(Report(failed=str(exc)))

    def close(self) -> Claim | None:
        """The tier closes (on the event loop, without waiting for a prepare or a check in
        flight, which may hang on a dead mount): the claim to release, in a worker thread."""
        self._generation += 1
        held, self.claim = self.claim, None
        return held

    def _unmarked(self, generation: int) -> None:
        """The folder lost its marker but holds only kvtier's files. While another process
        uses it, that process writes the marker back within ``CHECK_SECONDS``: wait for it
        (``MARKER_WAIT_SECONDS`` at most), so its marker is the one checked. Else (every user
        is gone, or the marker was removed from an idle folder) adopt the folder: check a
        few of its blocks against this tier's settings, then write the manifest and the
        marker, exclusively as a first open does. Raises ``IncompatibleRoot`` when a block
        was written with other settings (signed, unsigned, another key): such a tier would
        call every block corrupt and remove it. A prepare that outlived the tier's close
        (``generation``) writes nothing."""
        root, path = self.root, self.root / MARKER_NAME
        deadline = time.monotonic() + MARKER_WAIT_SECONDS
        used = in_use(root, self.claim)
        while used and not os.path.lexists(path) and time.monotonic() < deadline:
            time.sleep(_MARKER_POLL_SECONDS)  # a worker thread: the event loop runs on
            used = in_use(root, self.claim)
        if os.path.lexists(path):
            return  # written back by its user (or by another opener): checked as usual
        if found := unlike(root, self._integrity_key, SAMPLE_BLOCKS):
            where, why = found
            raise IncompatibleRoot(
                f"{root} lost its {MARKER_NAME} marker and holds blocks this tier cannot read "
                f"as its own ({where}: {why}): not adopting the folder, whose blocks were "
                "written with other settings. Open it with the integrity key (or none) its "
                f"blocks were written with, which writes {MARKER_NAME} back, point FSTier at "
                "another folder, or empty this one to start a fresh cache"
            )
        if generation != self._generation:
            return  # the tier closed while this waited: ready_root refuses the folder
        written: list[str] = []
        if self._identity is not None:  # another identity's manifest refuses the folder here
            if read_identity(root) is None:
                written.append(IDENTITY_NAME)
            claim_identity(root, self._identity)
        if restore_marker(root, self._marker):
            written.append(MARKER_NAME)
        logger.warning(
            "FS tier adopted %s, which had lost its %s marker (%s): it holds only kvtier's "
            "files and the blocks read match this tier's settings; wrote %s",
            root,
            MARKER_NAME,
            "another process uses it and did not write the marker back in time"
            if used
            else "no other process uses it",
            " and ".join(written) or "nothing (another opener wrote the marker first)",
        )

    def _keep_marker(self, restored: list[str]) -> None:
        """The marker: written back when gone, read and checked when another file took its
        name since the last check (a tier that opened the folder emptied meanwhile)."""
        path = self.root / MARKER_NAME
        inode = _inode(path)
        if inode is None:
            if restore_marker(self.root, self._marker):
                restored.append(MARKER_NAME)
            inode = _inode(path)
        elif inode != self._marker_inode:
            try:
                check_marker(self.root, self._marker)
            except Unmarked:  # gone again since: written back, as above
                if restore_marker(self.root, self._marker):
                    restored.append(MARKER_NAME)
            inode = _inode(path)
        self._marker_inode = inode

    def _queued(self, report: Report) -> Report:
        if report:
            self.reports.append(report)
        return report


def _inode(path: Path) -> tuple[int, int] | None:
    """The file ``path`` names (device and inode), or None when there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
