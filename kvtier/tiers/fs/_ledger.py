"""What an FS tier operation's outcome means: state, counters, verdicts, notices and errors.

``FSTier``'s single-block operations and the batch runs in ``_batch`` end the same way: a
block loaded, missing, corrupt or failed; a store landed, found its block there already, or
failed (perhaps after its victims were removed). The ``Ledger`` books each outcome once, the
same way for both: it updates the ``Catalog``, counts it in the tier's meter, records the
verdict ``lookup`` answers from, tells listeners which keys changed, announces the change as
an event, and turns an ``OSError`` (or a hung file system) into the kvtier error the caller
raises, logging once per burst. It is the one place where native errors become kvtier errors.
Synchronous: it runs on the event loop after the worker thread has returned.

Events (``kvtier.common._events``): a block that landed (renamed into place: visible, as durable as
``fsync`` makes it) is stored. A block the catalog held is removed when a store evicts it
(``evicted``), a load finds it corrupt (``corrupt``; the file is removed) or gone
(``not_found``), an existence check finds it gone, or a rescan of the folder (at open, or when
a root that was unusable comes back) no longer finds it (``not_found``: another process, or
someone by hand, removed it). A key the catalog never held is never removed: a miss of a key
nobody announced (a load or a check of an unknown key) says nothing to a router. The walk
after an open from a kept catalog (``_reconcile``) tells both ways what the catalog as loaded
got wrong: a file it lacked is stored, an entry without a file removed (``not_found``).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from kvtier.common._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    TierError,
    TierNoSpaceError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvtier.common._events import EventBuffer, EventKind
from kvtier.common._format import IntegrityKey, header_size
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import MissReason
from kvtier.tiers._base import TierMeter
from kvtier.tiers.fs._calls import Abandoned, OnLate, Stuck
from kvtier.tiers.fs._catalog import Built, Catalog, NoRoom, Reservation
from kvtier.tiers.fs._geometry import region_size
from kvtier.tiers.fs._layout import key_of
from kvtier.tiers.fs._write import WriteOutcome

__all__ = ["Ledger", "Verdicts"]

logger = logging.getLogger("kvtier.tiers.fs")

_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # what removing files can cure
# How many times one store makes room on a full disk, each time twice as much as before.
_ROOM_ATTEMPTS = 4


class Verdicts(Protocol):
    """What the ledger tells the lookup helper (``AsyncLookupManager`` or ``IndexLookups``)."""

    def record(self, key: bytes, present: bool, reason: MissReason = ...) -> None: ...


@dataclass(eq=False, repr=False, slots=True)
class Ledger:
    """Books the outcomes of one FS tier's operations; see the module docstring."""

    name: str
    catalog: Catalog[anyio.Event]
    verdicts: Verdicts
    notify: Callable[[Iterable[bytes]], None]
    integrity_key: IntegrityKey | None
    events: EventBuffer
    meter: TierMeter = field(default_factory=TierMeter, init=False)
    # Blocks evicted because the disk was full (not the capacity): also in ``evictions``.
    disk_full_evictions: int = field(default=0, init=False)
    folder_check_failures: int = field(default=0, init=False)  # the folder's checks that raised
    _log: BurstLogger = field(default_factory=lambda: BurstLogger(logger), init=False)

    def file_size(self, key: bytes, nbytes: int) -> int:
        """The size of the file that holds ``key``'s block of ``nbytes``."""
        header = header_size(len(key), integrity_key=self.integrity_key)
        return region_size(header, nbytes) + nbytes

    # -- loads ---------------------------------------------------------------------------------

    def loaded(self, key: bytes, name: str, nbytes: int, seconds: float) -> None:
        self.catalog.loaded(name, self.file_size(key, nbytes))
        self.meter.read(nbytes, seconds)

    def missing(self, key: bytes, name: str, since: int) -> BlockNotFoundError:
        """A load found no file (a check that began at epoch ``since`` may be stale)."""
        if self.catalog.drop_unless_newer(name, since):
            self.removed([key], MissReason.NOT_FOUND)
        self.fail(key, MissReason.NOT_FOUND, "load", None)
        return BlockNotFoundError("no such block", tier=self.name, operation="load", key=key)

    def corrupt(self, key: bytes, name: str, since: int, detail: str) -> CorruptBlockError:
        """A load found a file that failed verification (it has been removed)."""
        if self.catalog.drop_unless_newer(name, since):
            self.removed([key], MissReason.CORRUPT)
        self.fail(key, MissReason.CORRUPT, "load", detail)
        return CorruptBlockError(detail, tier=self.name, operation="load", key=key)

    def load_failed(self, exc: OSError | Stuck, key: bytes) -> TierError:
        error = self.error(exc, "load", key)
        self.verdicts.record(key, False, error.reason)
        return error

    # -- stores --------------------------------------------------------------------------------

    def reserve(self, key: bytes, name: str, nbytes: int) -> Reservation:
        """Room for storing ``key``'s block of ``nbytes``; ``TierNoSpaceError`` (counted) for
        a block larger than the whole capacity."""
        try:
            return self.catalog.reserve(key, name, self.file_size(key, nbytes))
        except NoRoom as exc:
            self.meter.failed(MissReason.NO_SPACE)
            raise TierNoSpaceError(str(exc), tier=self.name, operation="store", key=key) from None

    def settle(
        self, res: Reservation, result: tuple[WriteOutcome, int] | None, *, touched: bool
    ) -> None:
        """Account for a store that ended: its room, its victims and, when it landed, its
        file. ``result``: what the write returned, None when it did not return one;
        ``touched``: it may have reached the file system."""
        written = result is not None and result[0] is WriteOutcome.WRITTEN
        landed = None if result is None else result[1]
        gone = self.catalog.settle(res, landed, written=written, touched=touched)
        if gone:
            self.meter.evictions += len(gone)
            keys = [k for v, _ in gone if (k := key_of(v)) is not None]
            for k in keys:
                self.verdicts.record(k, False, MissReason.EVICTED)
            if keys:
                self.removed(keys, MissReason.EVICTED)
                self.notify(keys)
        if landed is not None:
            self.verdicts.record(res.key, True)
            self.events.emit(EventKind.STORED, (res.key,))

    def late_store(self, res: Reservation) -> OnLate[tuple[WriteOutcome, int]]:
        """What settles a write abandoned at a deadline once it has finished."""

        def late(result: tuple[WriteOutcome, int] | None, error: BaseException | None) -> None:
            self.settle(res, result, touched=not isinstance(error, Abandoned))

        return late

    def stored(
        self,
        res: Reservation,
        result: tuple[WriteOutcome, int],
        nbytes: int,
        seconds: float,
    ) -> None:
        """A write returned: settle it, and count it when it wrote the file."""
        self.settle(res, result, touched=True)
        if result[0] is WriteOutcome.WRITTEN:
            self.meter.wrote(nbytes, seconds)

    def disk_full(self, exc: OSError) -> bool:
        """Whether a store that failed with ``exc`` found the disk full while the tier holds
        blocks it could evict to make room."""
        return exc.errno in _FULL and self.catalog.blocks > 0

    def make_room(self, res: Reservation, exc: OSError, attempt: int) -> bool:
        """A write for ``res`` failed with ``exc``: on a full disk, evict more least recently
        used blocks with it (twice as much at each ``attempt``, at most ``_ROOM_ATTEMPTS``)
        and say so, once per burst; whether the write should be tried again. A cache on a
        full disk gives up its oldest blocks rather than every new one."""
        if attempt >= _ROOM_ATTEMPTS or not self.disk_full(exc):
            return False
        taken = self.catalog.evict_more(res, res.size << attempt)
        if not taken:
            return False
        self.disk_full_evictions += taken
        self._log.warning(
            "disk_full",
            "%s: its file system is full: evicted %d least recently used blocks to make room "
            "and stored again (%s)",
            self.name,
            taken,
            exc.strerror or exc,
        )
        return True

    def stores_ended(self, keys: Iterable[bytes]) -> None:
        """The stores of ``keys`` ended (the catalog no longer holds them as being stored):
        tell whoever was answered RETRY for one that it answers HIT or MISS now."""
        told = self.catalog.told_after(keys)
        if told:
            self.notify(told)

    # -- blocks that went behind the tier's back ----------------------------------------------

    def checked(
        self, keys: list[bytes], names: list[str], sizes: list[int | None], since: int
    ) -> None:
        """An existence check that began at epoch ``since`` found ``names``' files (their
        ``sizes``) or none (None): a file the catalog held that it found gone is removed."""
        gone = [
            key
            for key, name, size in zip(keys, names, sizes, strict=True)
            if self.catalog.checked(name, size, since)
        ]
        self.forget(gone)

    def rescanned(self, entries: Iterable[tuple[str, int]] | Built, since: int) -> None:
        """The folder was (re)read from epoch ``since`` on: ``entries`` are its files, oldest
        first; a file the catalog held that is not among them (nor stored meanwhile) is
        removed."""
        gone = self.catalog.reset(entries, since)
        self.forget([k for name in gone if (k := key_of(name))])

    def found_files(self, names: list[str]) -> None:
        """The files ``names``, which the catalog did not hold, are there (the walk after an
        open from a kept catalog found them): hits from now on, stored."""
        keys = [k for name in names if (k := key_of(name)) is not None]
        for key in keys:
            self.verdicts.record(key, True)
        if keys:
            self.events.emit(EventKind.STORED, keys)
            self.notify(keys)

    def forget_files(self, names: list[str]) -> None:
        """``forget`` the keys of the files ``names``."""
        self.forget([k for name in names if (k := key_of(name)) is not None])

    def forget(self, keys: list[bytes]) -> None:
        """Files the catalog held are gone: misses from now on, removed (``not_found``)."""
        for key in keys:
            self.verdicts.record(key, False, MissReason.NOT_FOUND)
        if keys:
            self.removed(keys, MissReason.NOT_FOUND)
            self.notify(keys)

    def removed(self, keys: list[bytes], reason: MissReason) -> None:
        self.events.emit(EventKind.REMOVED, keys, reason=reason.value)

    # -- failures ------------------------------------------------------------------------------

    def timed_out(self, key: bytes, operation: str) -> TierTimeoutError:
        """A block of a batch that its deadline stopped (before it started, or abandoned)."""
        self.meter.failed(MissReason.TIMEOUT)
        if operation == "load":
            self.verdicts.record(key, False, MissReason.TIMEOUT)
        return TierTimeoutError(
            "the batch's timeout passed first", tier=self.name, operation=operation, key=key
        )

    def fail(self, key: bytes, reason: MissReason, operation: str, detail: str | None) -> None:
        self.meter.failed(reason)
        self.verdicts.record(key, False, reason)
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

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log once per burst of ``kind``."""
        self._log.warning(kind, message, *args)

    def refused(self, reason: str, operation: str) -> TierUnavailableError:
        """The folder stopped being this tier's while it ran (``reason``: another tier's
        marker or identity is there now): counted, logged once per burst, and the error to
        raise for ``operation``."""
        self.meter.failed(MissReason.UNAVAILABLE)
        self._log.warning("refused", "%s: stopped using its folder: %s", self.name, reason)
        return TierUnavailableError(reason, tier=self.name, operation=operation)

    def folder_check_failed(self, exc: BaseException) -> None:
        """A check of the folder raised: counted, logged once per burst."""
        self.folder_check_failures += 1
        self._log.warning("check", "%s: checking its folder failed: %r", self.name, exc)

    def error(self, exc: OSError | Stuck, operation: str, key: bytes | None = None) -> TierError:
        """The one place an ``OSError`` becomes a kvtier error; counts and logs it."""
        if isinstance(exc, Stuck):
            self.meter.failed(MissReason.UNAVAILABLE)
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
        self.meter.failed(cls.reason)
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._log.warning(
            f"{operation}:{code}", "%s: %s failed: %s (%s)", self.name, operation, code, exc
        )
        return cls(f"{code}: {exc.strerror or exc}", tier=self.name, operation=operation, key=key)
