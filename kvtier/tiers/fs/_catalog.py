"""What an ``FSTier`` knows about its folder, as a synchronous state machine.

The catalog holds the tier's bookkeeping and nothing else: which block files it knows (name
and size, least recently used first), the bytes they use and the bytes that stores in flight
have reserved against the capacity, which victims a store evicts, the keys being stored (and
which of them ``lookup`` answered ``RETRY`` for), and the epochs that keep a stale "no such
file" from dropping a block stored while the check ran. It never awaits and never touches the
file system: ``FSTier`` does the I/O around it and tells it what happened, so a cancellation
cannot leave it half updated, and it is tested without an event loop. No rule here depends on
time, so it needs no clock; the failures that expire are remembered by the lookup helpers
(``_index``), which take one. An owner keeps its catalog across restarts: every change to
the index is told, in order, to ``changes`` (``_catalog_journal`` writes them down), and an
index read back at open is ``build``-t in a worker thread and taken over by ``reset``.

Generic in ``W``, what a store in flight is waited on with (``anyio.Event`` in the tier), so
a second store of a key can wait for the first without the catalog knowing about the loop.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from kvtier.tiers.fs._catalog_format import Change
from kvtier.tiers.fs._idents import MAX_HEX_KEY, ident_of_key, ident_of_name, name_of_ident
from kvtier.tiers.fs._packed import PackedOrder
from kvtier.tiers.fs._packed_build import Columns, from_names, snapshot

__all__ = ["Built", "Catalog", "Changes", "NoRoom", "Reservation"]

W = TypeVar("W")


class NoRoom(Exception):
    """A block larger than the whole capacity: no eviction can make room for it."""

    def __init__(self, size: int, capacity: int) -> None:
        super().__init__(f"a block of {size} bytes is larger than capacity_bytes={capacity}")
        self.size = size
        self.capacity = capacity


class Changes(Protocol):
    """Who hears every change to the index, in order (``_catalog_journal``): replaying them
    onto the entries it had reproduces the index and its LRU order exactly."""

    def note(self, change: Change, name: str, size: int) -> None: ...

    def replaced(self) -> None:
        """The index was replaced as a whole (``reset``)."""


@dataclass(frozen=True, slots=True)
class Built:
    """An index built for ``Catalog.reset`` off the event loop, and the bytes it holds."""

    index: PackedOrder
    used: int


@dataclass(slots=True)
class Reservation:
    """Room held for one store: its file's size, and the files chosen to make room for it
    (taken out of the index, not yet removed from the folder)."""

    key: bytes
    name: str
    size: int
    victims: list[tuple[str, int]]

    @property
    def victim_names(self) -> list[str]:
        return [v for v, _ in self.victims]


class Catalog(Generic[W]):
    """Index, LRU order, capacity, stores in flight and watcher epochs of one FS tier."""

    def __init__(self, capacity_bytes: int | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.ready = False  # the root is usable and the index was read from it
        # Block file (by ident: ``_idents``) -> size, least recently used first. A file whose
        # name no key has (odd length) is never indexed: no lookup could find it.
        self._index = PackedOrder()
        self.used = 0  # bytes of the files in the index
        self.reserved = 0  # bytes of stores in flight, counted against the capacity
        # Keys being stored or deleted (a second store or delete of one waits for the first),
        # the ones among them ``lookup`` answered RETRY for (they are told when their store
        # ends), and how many lookups were answered so.
        self.storing: dict[bytes, W] = {}
        # Names whose files operations in flight are changing (``changing``), with how many
        # each: a store's own name (its file renamed into place before the catalog adds it),
        # its victims (out of the index before their files are removed) and a delete's name
        # (its file removed before the name is dropped).
        self._changing: collections.Counter[str] = collections.Counter()
        self._retried: set[bytes] = set()
        self.writing_retries = 0
        # A check (or load) that finds no file must not drop a name stored while it ran: the
        # names added since each watcher started are kept, by epoch, while any watcher runs.
        self._epoch = 0
        self._watchers = 0
        self._added: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self.changes: Changes | None = None  # told every change, when the catalog is kept

    # -- contents ------------------------------------------------------------------------------

    @property
    def blocks(self) -> int:
        return len(self._index)

    @staticmethod
    def build(entries: Iterable[tuple[str, int]], used: int | None = None) -> Built:
        """An index of ``entries`` (oldest first) for ``reset``, built where it costs the
        event loop nothing (a worker thread: it touches no catalog). ``used``: their bytes,
        when the caller has them at hand (the index sums them anyway)."""
        pairs = list(entries)
        sizes = np.fromiter((size for _, size in pairs), dtype=np.uint64, count=len(pairs))
        index = from_names([name for name, _ in pairs], sizes)
        return Built(index, index.total)

    def reset(
        self, entries: Iterable[tuple[str, int]] | Built, since: int | None = None
    ) -> list[str]:
        """The folder was (re)read: ``entries`` are its files, oldest first (or their index,
        ``build``-t off the loop, which the catalog takes over). Returns the
        names held before that the folder no longer has (removed while the tier was closed,
        or while its root was unusable).

        ``since``: the epoch the read began at (``watch``). A store or load that added a
        name after it, or a delete or eviction that dropped one, happened while the folder
        was read and may be missing from ``entries`` or stale in them: the catalog's own
        knowledge of such a name wins over the read."""
        built = entries if isinstance(entries, Built) else self.build(entries)
        fresh = built.index
        if since is not None:
            for name, epoch in self._dropped.items():
                ident = ident_of_name(name)
                if ident is not None and epoch > since and self._added.get(name, -1) < epoch:
                    fresh.pop(ident, 0)
            for name, epoch in self._added.items():
                ident = ident_of_name(name)
                size = None if ident is None else self._index.get(ident)
                if ident is not None and epoch > since and size is not None:
                    fresh.pop(ident, 0)
                    fresh[ident] = size  # the most recently used end, where it was put
        before, self._index = self._index, fresh
        self.used = fresh.total
        self.ready = True
        if self.changes is not None:
            self.changes.replaced()
        return [name_of_ident(i) for i in before if i not in fresh]

    def holds(self, key: bytes) -> bool:
        """Whether the root is usable and the index has ``key``'s file (asked with the key
        itself: no name is made)."""
        if len(key) > MAX_HEX_KEY or not key:
            return self.ready and self._index.find(ident_of_key(key)) >= 0
        return self.ready and self._index.has_key(key)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and ident_of_name(name) in self._index

    def names(self) -> list[str]:
        """File names, least recently used first."""
        return list(map(name_of_ident, self._index))

    def keys_reader(self) -> Callable[[], list[bytes]]:
        """A function returning the keys of the block files named by their key, to run in a
        worker thread (``PackedOrder.keys_reader``: the catalog as it is now)."""
        return self._index.keys_reader()

    def columns(self) -> Columns:
        """A copy of the entries as columns, oldest first (a fraction of the index's memory,
        made in a few array copies): what a walk of the folder compares it with."""
        return snapshot(self._index)

    def entries(self) -> list[tuple[str, int]]:
        """File names and sizes, least recently used first (a checkpoint's contents)."""
        return [(name_of_ident(i), size) for i, size in self._index.items()]

    def size_of(self, name: str) -> int | None:
        ident = ident_of_name(name)
        return None if ident is None else self._index.get(ident)

    def changing(self, name: str) -> bool:
        """Whether an operation in flight is changing ``name``'s file (a store writing it or
        evicting it, a delete): a walk of the folder meanwhile leaves it to that operation."""
        return name in self._changing

    def change(self, name: str) -> None:
        """A delete of ``name`` begins (stores say so in ``reserve``)."""
        self._changing[name] += 1

    def changed(self, names: Iterable[str]) -> None:
        """The operation that was changing ``names`` ended (``settle`` says so for stores)."""
        changing = self._changing
        for name in names:
            changing[name] -= 1
            if changing[name] <= 0:
                del changing[name]

    def changed_since(self, name: str, since: int) -> bool:
        """Whether a store, load, delete or eviction added or dropped ``name`` after epoch
        ``since`` (known while a watcher that began at ``since`` runs)."""
        return self._added.get(name, -1) > since or self._dropped.get(name, -1) > since

    def _note(self, change: Change, name: str, size: int) -> None:
        if self.changes is not None:
            self.changes.note(change, name, size)

    def add(self, name: str, size: int) -> None:
        """A file is there (stored, loaded, or found): it becomes the most recently used."""
        ident = ident_of_name(name)
        if ident is None:  # no key has this name: nothing can look it up
            self.drop(name)
            return
        held = self._index.put_last(ident, size)  # as ``drop`` and a store leave it
        changes, watchers = self.changes, self._watchers
        if watchers:  # ``_taken``
            self._epoch += 1
            self._dropped[name] = self._epoch
        if held is not None:
            self.used -= held
            if changes is not None:
                changes.note(Change.DROP, name, 0)
        self.used += size
        if changes is not None:
            changes.note(Change.ADD, name, size)
        self._epoch += 1
        if watchers:
            self._added[name] = self._epoch

    def drop(self, name: str) -> bool:
        """Forget ``name``'s file; whether it was held."""
        ident = ident_of_name(name)
        size = None if ident is None else self._index.pop(ident, None)
        if self._watchers:  # ``_taken``
            self._epoch += 1
            self._dropped[name] = self._epoch
        if size is None:
            return False
        self.used -= size
        if self.changes is not None:
            self.changes.note(Change.DROP, name, 0)
        return True

    def loaded(self, name: str, size: int) -> None:
        """A load read the file, of ``size`` bytes: it is the most recently used (and known,
        if it was not). A size that differs from the one held is corrected: the reconcile
        takes a known name's file as it is, so one another writer replaced with a block of
        another size is accounted right from its first load."""
        ident = ident_of_name(name)
        held = None if ident is None else self._index.touch(ident)
        if ident is None or held is None:
            self.add(name, size)
            return
        if held != size:
            self._index[ident] = size
            self.used += size - held
        if self.changes is not None:
            self.changes.note(Change.ADD, name, size)

    def demote(self, names: Iterable[str]) -> int:
        """Make ``names`` (a prefix's, head first) the least recently used, the tail evicted
        first; how many are held. Not logged: after a restart a demoted block stands where its
        last use put it."""
        index = self._index
        demoted = 0
        for name in names:  # each to the front: the last, the tail, ends up first
            ident = ident_of_name(name)
            if ident is not None and ident in index:
                index.move_to_end(ident, last=False)
                demoted += 1
        return demoted

    def checked(self, name: str, size: int | None, since: int) -> bool:
        """An existence check that began at epoch ``since`` found the file (``size``) or
        found none (``None``). A file another process wrote is counted from now on.
        Returns whether a file the catalog held is gone."""
        if size is None:
            return self.drop_unless_newer(name, since)
        if name not in self:
            self.add(name, size)
        return False

    def _taken(self, name: str) -> None:
        """``name`` left the index: a folder read running meanwhile must not bring it back."""
        if self._watchers:
            self._epoch += 1
            self._dropped[name] = self._epoch

    # -- watchers ------------------------------------------------------------------------------

    def watch(self) -> int:
        """Start a check whose "no such file" may be stale by the time it returns; the epoch
        it began at."""
        self._watchers += 1
        return self._epoch

    def unwatch(self) -> None:
        self._watchers -= 1
        if not self._watchers:
            self._added.clear()
            self._dropped.clear()

    @contextlib.contextmanager
    def watching(self) -> Iterator[int]:
        """``watch`` for the length of a ``with`` block."""
        since = self.watch()
        try:
            yield since
        finally:
            self.unwatch()

    def drop_unless_newer(self, name: str, since: int) -> bool:
        """Drop ``name`` unless a store (or a load) added it after epoch ``since``; whether
        a held name was dropped."""
        return self._added.get(name, -1) <= since and self.drop(name)

    # -- capacity ------------------------------------------------------------------------------

    def fits(self, size: int) -> bool:
        """Whether room for ``size`` more bytes can be made now: beside the bytes that stores
        in flight hold, evicting published blocks if need be. A batch plans another block
        into its current wave only then: room that only that wave's own blocks could give
        waits until they are published."""
        cap = self.capacity_bytes
        return cap is None or self.reserved + size <= cap

    def reserve(self, key: bytes, name: str, size: int) -> Reservation:
        """Hold ``size`` bytes for storing ``key`` as ``name``, taking least recently used
        files out of the index until they fit; raises ``NoRoom`` when they never can."""
        victims: list[tuple[str, int]] = []
        cap = self.capacity_bytes
        if cap is not None:
            if size > cap:
                raise NoRoom(size, cap)
            budget = cap - self.reserved - size
            index = self._index
            while self.used > budget and index:
                ident, victim_size = index.popitem(last=False)
                victim = name_of_ident(ident)
                if victim == name:  # it is there already: it needs no room
                    index[ident] = victim_size
                    self._note(Change.ADD, victim, victim_size)
                    if len(index) == 1:
                        break
                    continue
                self.used -= victim_size
                self._taken(victim)
                self._changing[victim] += 1
                self._note(Change.DROP, victim, 0)
                victims.append((victim, victim_size))
        self.reserved += size
        self._changing[name] += 1
        return Reservation(key, name, size, victims)

    def evict_more(self, res: Reservation, size: int) -> int:
        """The disk is full (whatever the capacity says): take least recently used files
        out of the index as more victims of ``res``, at least ``size`` bytes of them while
        there are any; how many were taken."""
        taken = freed = 0
        index = self._index
        while freed < size and index:
            ident, victim_size = index.popitem(last=False)
            victim = name_of_ident(ident)
            if victim == res.name:  # it is there already: it needs no room
                index[ident] = victim_size
                self._note(Change.ADD, victim, victim_size)
                if len(index) == 1:
                    break
                continue
            self.used -= victim_size
            self._taken(victim)
            self._changing[victim] += 1
            self._note(Change.DROP, victim, 0)
            res.victims.append((victim, victim_size))
            freed += victim_size
            taken += 1
        return taken

    def settle(
        self, res: Reservation, landed: int | None, *, written: bool, touched: bool
    ) -> list[tuple[str, int]]:
        """A store ended: release its room and account for its victims and its file.

        ``landed``: the size of the file now in place (written, or there already), None when
        none is. ``written``: this store wrote it. ``touched``: the store may have reached the
        file system. Returns the victims that are gone (they were removed, or may have been:
        never count them again); the others go back where they were in the LRU order.
        """
        self.reserved -= res.size
        self.changed([res.name, *(victim for victim, _ in res.victims)])
        if written or (landed is None and touched):
            gone = res.victims
            for victim, _ in gone:  # removed just now: a walk begun before must not revive it
                ident = ident_of_name(victim)
                if ident is not None and ident not in self._index:  # not stored again since
                    self._taken(victim)
        else:  # nothing happened on disk, or the file was there and needed no room
            gone = []
            for victim, victim_size in reversed(res.victims):
                ident = ident_of_name(victim)
                if ident is not None and ident not in self._index:
                    self._index[ident] = victim_size
                    self._index.move_to_end(ident, last=False)
                    self.used += victim_size
                    self._dropped.pop(victim, None)  # back as it was: a read's copy holds
                    self._note(Change.BACK, victim, victim_size)
        if landed is not None:
            self.add(res.name, landed)
        return gone

    # -- stores in flight ----------------------------------------------------------------------

    def begin_store(self, key: bytes, waiter: W) -> None:
        """``key`` is being stored; a second store of it waits on ``waiter``."""
        assert key not in self.storing, "one store per key at a time"
        self.storing[key] = waiter

    def end_store(self, key: bytes) -> W:
        """``key``'s store ended; its waiter, for the caller to wake."""
        return self.storing.pop(key)

    def retry_while_writing(self, key: bytes) -> bool:
        """``lookup``'s question: is ``key`` being stored and not in the index yet? Then its
        answer is RETRY (not a miss), and ``told_after`` names it when its store ends."""
        if key in self.storing and not self.holds(key):
            self.writing_retries += 1
            self._retried.add(key)
            return True
        return False

    def told_after(self, keys: Iterable[bytes]) -> list[bytes]:
        """The stores of ``keys`` ended: those that ``lookup`` answered RETRY for while they
        were written, which must be told that the answer changed."""
        retried = self._retried
        if not retried:
            return []
        told = [k for k in keys if k in retried]
        retried.difference_update(told)
        return told

    def __repr__(self) -> str:
        return (
            f"<Catalog ready={self.ready} blocks={len(self._index)} used={self.used} "
            f"reserved={self.reserved} capacity={self.capacity_bytes} "
            f"storing={len(self.storing)} watchers={self._watchers}>"
        )
