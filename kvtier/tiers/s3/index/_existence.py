"""The existence index of the S3 tier: ``lookup()`` without a round trip (docs/design.md, "The S3
tier shared by several nodes").

A synchronous state machine, no I/O: which keys the bucket is known to hold, learnt from this
node's own writes, the listing made at open and the journal segments other nodes publish
(``_journal_format``). A key it holds answers HIT; a key it does not hold answers MISS
(``not_found``) at once, so the request path never waits on the object store for a block that
cannot be there. A load that finds an indexed object gone or corrupt removes it; a load that
fails for another reason (timeout, unavailable) suppresses the key for ``miss_ttl`` seconds so
the manager does not promote it again at every wake.

The index also keeps the journal's bookkeeping: keys this node wrote that are not published
yet, keys it deleted that are not published as removed yet, and which segments of other
writers it has read (forgotten once older than the lookback). A key is in at most one of the
two queues (the later of a store and a delete wins), so the order in which one refresh
publishes them does not matter.

A removal another node published does not drop the key at once: it is *doubted* (``doubt``),
and dropped only once a check of the bucket finds its object gone (``take_doubts``, then
``settle``; ``_rechecks`` sends the HEADs, off the lookup path). Segments are ordered by their
names, which carry their writers' wall clocks and say when a segment was published, not when
its delete or store happened: node A may delete K, node B store K again and publish first,
and A's removal, read later, must not hide B's block. So rather than trusting an order, the
check asks the one party that saw both acts in their real order, the object store, after
the removal was read: an object there now was stored after that delete (or the delete
failed), and stays; one gone now is dropped. No clock is compared, skewed or not. A key this
node stores after the removal was read is not dropped by a check that raced with its PUT
(``wrote`` ends the doubt); a key it deletes, or finds gone, is dropped at once as before.

Memory: the keys and their pack locations live in a ``KeyTable`` (``_keytable``): packed
columns, no Python object per key, so the collector never walks the index and a key costs
its bytes plus a few dozen more. ``max_keys`` bounds it: a new key past the bound evicts the
oldest one, a warning is logged once per burst and ``evictions`` counts them. New keys, this
node's own writes first, are always indexed: a full index that stopped learning would answer
MISS for the blocks this node just wrote, and every repeated store would write another copy.
An evicted key answers MISS, as before a refresh. Keys waiting to be published are bounded by
``max_keys`` too (more are counted in ``unpublished_dropped``: other nodes then learn them at
their next listing; a removal not published leaves them a stale HIT, which their next load
of it corrects). A key dropped and indexed again is the newest: the table keeps the order in
which keys were indexed.

While the tier loads its index in the background (``begin_load``, ``end_load``), the bulk of
keys arrives through ``load_many``, which skips every key this node found gone, deleted or
saw another node remove since the load began (``_gone``): the snapshot or listing being read
is older than those facts, and must not turn a key answered MISS for them back into a HIT.
``loading`` tells the tier to ask the bucket about keys not indexed yet.

The audit (``_audit``) compares the index with a listing of the bucket: a key the listing
lacks is doubted as a removal is (``audit_doubt``), and when its check finds it gone it is
also queued for this node's removal segment, since no node announced it; a block the listing
has that the index lacks is indexed and queued for the next store segment (``audit_learn``),
unless this node learnt it gone while the listing ran (``begin_audit``, ``_gone`` as for a
load).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import HIT, MISS, LookupResult, MissReason
from kvtier.common._verdicts import VerdictStore, code_of, reason_of_code
from kvtier.tiers._base import CountedLookups, LookupStatistics
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3.index._keytable import KeyTable

__all__ = ["ExistenceIndex", "key_from_object", "object_name"]

logger = logging.getLogger(__name__)
_NOT_FOUND = MissReason.NOT_FOUND.value
AUDITED = "audited"
"""The doubt of a key the audit's listing lacked (no removal segment carries this reason)."""
_V = TypeVar("_V")


def object_name(prefix: str, key: bytes) -> str:
    """The name of ``key``'s block object: ``<prefix>/<2 hex>/<hex key>``."""
    hexkey = key.hex()
    shard = f"{hexkey[:2]}/{hexkey}"
    return f"{prefix}/{shard}" if prefix else shard


def key_from_object(name: str, prefix: str) -> bytes | None:
    """The key of a block object ``<prefix>/<2 hex>/<hex key>``; None for anything else."""
    rest = name[len(prefix) + 1 :] if prefix else name
    if prefix and not name.startswith(prefix + "/"):
        return None
    if len(rest) < 3 + 32 or rest[2] != "/":
        return None
    hexkey = rest[3:]
    if hexkey[:2] != rest[:2]:
        return None
    try:
        return bytes.fromhex(hexkey)
    except ValueError:
        return None


class ExistenceIndex(CountedLookups):
    """Known keys, short suppressions and the journal's bookkeeping; its answers are counted
    (``CountedLookups``), so ``lookup_with_reason`` says why a miss is one."""

    def __init__(
        self,
        *,
        miss_ttl: float,
        max_keys: int,
        clock: Callable[[], float] = time.monotonic,
        name: str = "s3",
    ) -> None:
        super().__init__()
        self._miss_ttl = miss_ttl
        self._max_keys = max_keys
        self._name = name
        self._log = BurstLogger(logger)
        self._table = KeyTable(max_keys)  # the indexed keys and where packed ones live
        self._find = self._table.find  # bound once: lookup() is on the request path
        # Indexed keys whose load failed lately (bounded by max_keys: only indexed keys are
        # suppressed, and a key leaving the index is forgotten here too).
        self._suppressed = VerdictStore(max_keys, clock=clock)
        self._suppressing = False  # whether any key was ever suppressed (lookup skips them)
        self._unpublished: dict[bytes, Location | None] = {}
        self._removals: dict[bytes, str] = {}  # deleted here, not published yet: key -> why
        # Removals other nodes published, of keys indexed here: key -> why, to check (both
        # bounded by max_keys: only indexed keys enter, and a key leaving the index leaves).
        self._doubts: dict[bytes, str] = {}
        self._checking: dict[bytes, str] = {}  # taken for a check that has not settled
        self._seen: dict[str, int] = {}  # segment name -> its wall ms
        self.loading = False  # a background load is filling the index (see the module doc)
        self.auditing = False  # an audit's listing runs (see the module doc)
        self._gone: set[bytes] = set()  # keys the running load must not bring back
        self.full = False  # max_keys reached at least once
        self.evictions = 0  # keys evicted to make room for newer ones
        self.unpublished_dropped = 0  # written here, never published (backlog at max_keys)
        self.listed = 0  # keys found by the listing at open
        self.learnt = 0  # keys learnt from other writers' journals
        self.forgotten = 0  # keys dropped because another writer published their removal
        self.removals_kept = 0  # removals whose key's object was found in the bucket
        self.audit_removed = 0  # keys an audit's listing lacked, found gone by their check
        self.load_skipped = 0  # keys a background load did not bring back (``_gone``)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._find(key) >= 0

    def location(self, key: bytes) -> Location | None:
        """The pack section holding ``key``; None for a key stored as its own object."""
        return self._table.location(key)

    def entries_reader(self) -> Callable[[], list[tuple[bytes, Location | None]]]:
        """A function returning every key the index holds with its pack location, to run in a
        worker thread (the table's columns are copied here, on the event loop, at memory
        speed: the index changes under the loop while the thread runs)."""
        return self._table.entries_reader()

    # -- answers -------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if self._find(key) >= 0:
            if self._suppressing and (code := self._suppressed.get(key)) is not None:
                return self._miss(reason_of_code(code))
            self._hits += 1
            return HIT
        # ``_miss(MissReason.NOT_FOUND)``, without reading the enum's value at every miss
        self._misses += 1
        reasons = self._miss_reasons
        reasons[_NOT_FOUND] = reasons.get(_NOT_FOUND, 0) + 1
        self._last_miss = MissReason.NOT_FOUND
        return MISS

    def miss(self, reason: MissReason) -> LookupResult:
        """Count a miss the tier answers without asking the index (it is not open)."""
        return self._miss(reason)

    # -- updates -------------------------------------------------------------------------------

    def add(self, key: bytes, where: Location | None = None) -> bool:
        """Index ``key`` (in the pack section ``where``, or as its own object); True if it
        was not known (and there was room). A key known in a pack keeps its location when
        its own object is found too: reading it with its pack's neighbours costs less."""
        table = self._table
        if table.count >= self._max_keys and table.find(key) < 0:
            self._evict_oldest()
        rid = table.put(key, where)
        if rid >= 0:  # known already
            if self._suppressing:
                self._suppressed.forget(key)
            if where is not None:
                table.set_location(rid, where)
            return False
        if self._gone:
            self._gone.discard(key)  # known again by a newer fact than the load's
        return True

    def _evict_oldest(self) -> None:
        """Make room for one key: drop the oldest indexed one, and say so once per burst."""
        self.full = True
        key = self._table.pop_oldest()
        if key is not None:
            self._suppressed.forget(key)
            self._doubts.pop(key, None)
            self.evictions += 1
        self._log.warning(
            "evict",
            "%s: existence index full (index_max_keys=%d): evicting the oldest keys, which "
            "answer MISS until written or listed again; raise index_max_keys if memory allows",
            self._name,
            self._max_keys,
        )

    def add_many(self, entries: Iterable[tuple[bytes, Location | None]]) -> list[bytes]:
        return [key for key, where in entries if self.add(key, where)]

    # -- a background load ---------------------------------------------------------------------

    def begin_load(self) -> None:
        """A background load starts: unknown keys are asked of the bucket until it ends."""
        self.loading = True
        self._gone.clear()

    def end_load(self) -> None:
        """The background load ended (complete, cut short, failed or cancelled)."""
        self.loading = False
        self._gone.clear()

    def load_one(self, key: bytes, where: Location | None = None) -> bool:
        """Index what a snapshot or a listing read, which is older than what this node learnt
        since the load began: a key found gone or removed meanwhile is skipped. Whether it
        was new."""
        if self._gone and key in self._gone:
            self.load_skipped += 1
            return False
        return self.add(key, where)

    def load_many(self, entries: Iterable[tuple[bytes, Location | None]]) -> int:
        """``load_one`` of each entry; how many were new."""
        load = self.load_one
        return sum(load(key, where) for key, where in entries)

    def _went(self, key: bytes) -> None:
        """``key`` is gone by a fact newer than a running load or audit: it skips it."""
        if (self.loading or self.auditing) and len(self._gone) < self._max_keys:
            self._gone.add(key)

    # -- an audit ------------------------------------------------------------------------------

    def begin_audit(self) -> None:
        """An audit's listing starts: keys found gone from now on are not learnt from it."""
        if not self.loading:
            self._gone.clear()
        self.auditing = True

    def end_audit(self) -> None:
        self.auditing = False
        if not self.loading:
            self._gone.clear()

    def audit_doubt(self, keys: Iterable[bytes]) -> int:
        """The audit's listing lacked ``keys``: those still indexed are checked (and, found
        gone, published as removed: ``settle``); how many."""
        return self.doubt(keys, AUDITED)

    def audit_learn(self, key: bytes, where: Location | None) -> bool:
        """The audit's listing found ``key`` (in the pack section ``where``) and the index
        lacked it: index it and queue it for the next store segment, unless it went while
        the listing ran. Whether it was learnt."""
        if key in self._gone or not self.add(key, where):
            return False
        self._queue_store(key, where)
        return True

    def _queue_store(self, key: bytes, where: Location | None) -> None:
        """Queue ``key`` for the next store segment (bounded by ``max_keys``)."""
        if len(self._unpublished) < self._max_keys or key in self._unpublished:
            self._unpublished[key] = where
        else:
            self.unpublished_dropped += 1

    def wrote(self, key: bytes, where: Location | None = None) -> None:
        """This node stored ``key``: index it and queue it for the next journal segment. A
        removal read before the PUT ended is older than this store: no longer doubted."""
        self.add(key, where)
        self._removals.pop(key, None)
        self._doubts.pop(key, None)
        self._checking.pop(key, None)
        self._queue_store(key, where)

    def deleted(self, key: bytes, why: str) -> None:
        """This node deleted ``key``'s object (``why``: "deleted" or "corrupt"): drop it and
        queue it for the next removal segment."""
        self.discard(key)
        self._unpublished.pop(key, None)
        if len(self._removals) < self._max_keys or key in self._removals:
            self._removals[key] = why
        else:
            self.unpublished_dropped += 1

    def doubt(self, keys: Iterable[bytes], why: str) -> int:
        """Another writer published the removal of ``keys`` (``why``: as it published): those
        indexed here are checked before they are dropped (see the module docstring); how many.
        A key being checked is checked again: that check may have started before this
        delete."""
        queued = 0
        for key in keys:
            if key in self:
                self._doubts[key] = why
                queued += 1
            else:
                self._went(key)  # not indexed yet: a running load must not bring it back
        return queued

    def take_doubts(self, limit: int) -> list[tuple[bytes, str, Location | None]]:
        """The oldest ``limit`` doubted keys still indexed, each with why it was removed and
        where the index finds it; each is being checked until ``settle``."""
        taken, self._doubts = _take(self._doubts, limit)
        table = self._table
        batch = [(key, why, table.location(key)) for key, why in taken if key in self]
        self._checking.update((key, why) for key, why, _ in batch)
        return batch

    def settle(self, key: bytes, exists: bool | None, stale: Location | None = None) -> str | None:
        """The check of doubted ``key`` ended: its object ``exists``, or None when the check
        failed (it is checked again later). ``stale``: a pack location found gone while the
        key's own object is there (forgotten, unless a newer one replaced it). Returns why
        the key was removed if the check dropped it (``not_found`` for an audit's doubt,
        which is also queued for the removal segment); None if it stays, or if this node
        stored, deleted or dropped it meanwhile (that is newer than the check)."""
        why = self._checking.pop(key, None)
        if why is None or key not in self:
            return None
        if exists is None:
            self._doubts.setdefault(key, why)
            return None
        if exists:
            if stale is not None and self._table.location(key) == stale:
                self._table.set_location(self._table.find(key), None)
            self.removals_kept += why != AUDITED
            return None
        if why == AUDITED:  # nobody announced it: this node publishes it, as a load would
            self.deleted(key, "deleted")
            self.audit_removed += 1
            return _NOT_FOUND
        self.discard(key)
        self._unpublished.pop(key, None)  # gone since this node wrote it: not a store to tell
        self.forgotten += 1
        return why

    def discard(self, key: bytes) -> None:
        """The object is gone (a GET found nothing, it was corrupt, or deleted)."""
        self._table.remove(key)
        self._went(key)
        self._suppressed.forget(key)
        self._doubts.pop(key, None)
        self._checking.pop(key, None)

    def suppress(self, key: bytes, reason: MissReason) -> None:
        """A load failed for ``reason``: answer MISS for ``key`` for ``miss_ttl`` seconds.
        While a load runs, a key not indexed yet that a GET by its own name did not find is
        not taken as gone: it may live in a pack the load has not brought."""
        if reason in (MissReason.NOT_FOUND, MissReason.CORRUPT):
            if self.loading and reason is MissReason.NOT_FOUND and self._find(key) < 0:
                return
            self.discard(key)
        elif key in self:
            self._suppressing = True
            self._suppressed.set(key, code_of(reason), self._miss_ttl)

    # -- journal bookkeeping ---------------------------------------------------------------

    def take_unpublished(self, limit: int | None = None) -> list[tuple[bytes, Location | None]]:
        """The oldest ``limit`` (default: all) keys written here and not published yet."""
        entries, self._unpublished = _take(self._unpublished, limit)
        return entries

    def requeue(self, entries: list[tuple[bytes, Location | None]]) -> None:
        """A segment could not be published: its keys go first in the next one (a key
        deleted meanwhile stays deleted)."""
        fresh = [(key, where) for key, where in entries if key not in self._removals]
        self._unpublished = _requeue(fresh, self._unpublished)

    def take_removals(self, limit: int | None = None) -> list[tuple[bytes, str]]:
        """The oldest ``limit`` (default: all) keys deleted here and not published yet."""
        entries, self._removals = _take(self._removals, limit)
        return entries

    def requeue_removals(self, entries: list[tuple[bytes, str]]) -> None:
        """A removal segment could not be published: its keys go first in the next one
        (a key written again meanwhile stays written)."""
        fresh = [(key, why) for key, why in entries if key not in self._unpublished]
        self._removals = _requeue(fresh, self._removals)

    def unseen(self, names: Iterable[str]) -> list[str]:
        return [name for name in names if name not in self._seen]

    def seen(self, name: str, wall_ms: int) -> None:
        self._seen[name] = wall_ms

    def forget_seen_before(self, wall_ms: int) -> None:
        """Segments older than the lookback are never listed again: drop their names."""
        for name in [n for n, t in self._seen.items() if t < wall_ms]:
            del self._seen[name]

    def statistics(self) -> LookupStatistics:
        return LookupStatistics(
            hits=self._hits,
            misses=self._misses,
            misses_by_reason=dict(self._miss_reasons),
            cached_verdicts=len(self._table),
        )


def _take(
    queue: dict[bytes, _V], limit: int | None
) -> tuple[list[tuple[bytes, _V]], dict[bytes, _V]]:
    """The oldest ``limit`` (default: all) entries of ``queue``, and the queue left."""
    if limit is None or limit >= len(queue):
        return list(queue.items()), {}
    rest = dict(itertools.islice(queue.items(), limit, None))
    return list(itertools.islice(queue.items(), limit)), rest


def _requeue(entries: list[tuple[bytes, _V]], queue: dict[bytes, _V]) -> dict[bytes, _V]:
    """``entries`` first, then the rest of ``queue``."""
    out = dict(entries)
    for key, value in queue.items():
        out.setdefault(key, value)
    return out
