"""What an ``S3Tier`` knows, as a synchronous state machine: the core under the async shell.

The core holds the tier's state and its rules, and never awaits: the existence index, the
circuit breaker, the verdicts of the ask mode, the counters behind ``statistics()``, whether
the server takes conditional puts, the corrupt objects being deleted, this writer's id and
pack sequence, the names of objects, and the events it tells routers (``kvtier.common._events``).
``S3Tier`` and its helpers (``_blocks``, ``_sync``, ``_listing``) do the I/O around it and
tell it what happened, so a cancellation cannot leave it half updated. The clock is injected
(the index's suppressions, the breaker's reset, the ask mode's miss TTL), so it is tested
without an event loop.

Events: a block is ``STORED`` (``LOCAL``) once this node's PUT of it succeeded (its own object
or a pack's section; or the conditional PUT found it there already): a GET finds it from then
on. It is ``REMOVED`` when this node stops holding it: ``corrupt`` when a load found it
damaged, ``not_found`` when a load found it gone (and published in the journal as a removal,
so the other nodes drop it too), ``deleted`` on ``delete``. Only a key this
tier held (indexed, or answered present in the ask mode) is removed: a miss of a key nobody
announced says nothing. The S3 tier never evicts for capacity. Other nodes' stores and
deletes arrive through the journal as ``REMOTE`` events (``_sync``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.common._buffers import LOOP_COPY_BYTES
from kvtier.common._errors import CorruptBlockError
from kvtier.common._events import EventBuffer, EventKind
from kvtier.common._format import IntegrityKey, header_size
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import MissReason
from kvtier.common._resilience import CircuitBreaker
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import LookupStatistics, TierMeter, TierStatistics
from kvtier.tiers.s3._codec import is_newer_format, is_signed
from kvtier.tiers.s3._config import S3Config, pack_blocks
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index._existence import ExistenceIndex, object_name
from kvtier.tiers.s3.index._journal_format import writer_id

__all__ = ["S3Core", "S3TierStatistics"]

logger = logging.getLogger("kvtier.tiers.s3")

# Building and verifying objects: on the event loop when small, in a worker thread above
# these sizes, where the hop costs less than the work; signed objects cost more to build, so
# their limit is lower (figures: docs/design.md, "Measurements behind the defaults"). A load
# streamed from aiohttp checks each chunk as it lands and never hops (``_codec``); the verify
# threshold applies to a body read whole.
_THREAD_BUILD_BYTES = LOOP_COPY_BYTES
_THREAD_VERIFY_BYTES = LOOP_COPY_BYTES + 4096  # a 1 MiB payload and its header
_THREAD_SIGNED_BYTES = 512 << 10


@dataclass(frozen=True, slots=True)
class S3TierStatistics(TierStatistics):
    """``TierStatistics`` plus what is particular to a remote store."""

    # ``blocks`` and ``bytes_stored`` stay 0: counting a shared bucket would need a listing.
    breaker_state: str = "closed"
    breaker_opened: int = 0
    requests_rejected_by_breaker: int = 0
    retries: int = 0
    stores_skipped_existing: int = 0
    corrupt_deleted: int = 0
    conditional_put: bool = True
    lookup_mode: str = "index"
    index_keys: int = 0
    index_listed: int = 0
    index_learnt: int = 0
    index_forgotten: int = 0  # keys dropped because another node published their removal
    index_removals_kept: int = 0  # removals not applied: the block was found stored again
    index_listing_complete: bool = False
    index_loading: bool = False  # a background load is filling the index (it answers meanwhile)
    index_load_skipped: int = 0  # keys a background load found gone since it began: not indexed
    # Requests sent because lookup() was asked about a key while the index was still loading
    # (HEADs of keys' own objects, GETs of the snapshot chunks that hold them); counted
    # apart from request_path_requests, which an index-mode tier keeps at 0 once loaded.
    index_load_requests: int = 0
    index_refreshes: int = 0
    journal_segments_published: int = 0
    journal_segments_read: int = 0
    packs_written: int = 0  # PUTs that carried more than one block
    blocks_packed: int = 0  # blocks those PUTs carried
    pack_gets: int = 0  # ranged GETs of packs
    pack_sections_read: int = 0  # blocks those GETs served
    pack_bytes_read: int = 0  # bytes those GETs fetched (never more than their sections)
    index_evictions: int = 0  # keys evicted from a full index (index_max_keys), oldest first
    index_locations_rejected: int = 0  # pack locations not a block's size: never fetched
    index_refresh_failures: int = 0  # journal rounds that failed (retried at the next)
    journal_segments_rejected: int = 0  # unparsable, unauthenticated or oversized segments
    journal_entries_rejected: int = 0  # entries naming no pack of this prefix, or a bad key
    journal_clock_skew: float = 0.0  # this node's wall clock minus the server's, seconds
    index_audits: int = 0  # audits of the index against a listing this node ran (its turns)
    index_audit_failures: int = 0  # audits cut short: a request failed, or the listing's bound
    index_audit_removed: int = 0  # keys an audit's listing lacked, found gone: dropped, published
    index_audit_learnt: int = 0  # blocks an audit's listing had that the index lacked: indexed
    index_audit_seconds: float = 0.0  # how long this node's last whole audit took (list, compare)


class S3Core:
    """The state and rules of one S3 tier (see the module docstring)."""

    def __init__(
        self,
        config: S3Config,
        *,
        integrity_key: IntegrityKey | None,
        lookups: AsyncLookupManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = config.name
        self.bucket = config.bucket
        self.prefix = config.prefix
        self.integrity_key = integrity_key
        self.index_mode = config.lookup_mode == "index"
        self.pack_blocks = pack_blocks(config)
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_reset, clock=clock)
        self.index = ExistenceIndex(
            miss_ttl=config.miss_ttl, max_keys=config.index_max_keys, clock=clock, name=self.name
        )
        self.lookups = lookups  # the ask mode's verdicts (batched HEADs behind them)
        self.events = EventBuffer(self.name)  # what it holds, for routers: see the module doc
        self.meter = TierMeter()
        self.log = BurstLogger(logger)
        self.writer = writer_id()
        self.conditional_put = True  # until the server rejects one as not implemented
        self.deleting: set[str] = set()  # corrupt objects being deleted in the background
        self.packs_sent = 0
        self.breaker_misses = 0
        self.skipped_existing = 0
        self.corrupt_deleted = 0
        self.locations_rejected = 0
        self.request_path_requests = 0
        self.index_load_requests = 0
        signed = integrity_key is not None
        self.build_thread_bytes = _THREAD_SIGNED_BYTES if signed else _THREAD_BUILD_BYTES
        self.verify_thread_bytes = _THREAD_SIGNED_BYTES if signed else _THREAD_VERIFY_BYTES
        self.join_thread_bytes = _THREAD_BUILD_BYTES  # a pack's blocks are built already

    # -- names ---------------------------------------------------------------------------------

    def object_key(self, key: bytes) -> str:
        """The object name of ``key``: ``<prefix>/<2 hex>/<hex key>``."""
        return object_name(self.prefix, key)

    def next_pack_name(self, first_key: bytes) -> str:
        """A name for this writer's next pack, unique to it (so never overwritten)."""
        self.packs_sent += 1
        return pack_name(self.prefix, first_key, self.writer, self.packs_sent)

    @property
    def where(self) -> str:
        """``s3://bucket/prefix``, for messages."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    # -- answers and feedback ------------------------------------------------------------------

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self.lookups.record(key, False, reason)
        self.index.suppress(key, reason)

    def record_hit(self, key: bytes) -> None:
        self.lookups.record(key, True)
        self.index.add(key)

    def wrote(self, key: bytes, where: Location | None = None) -> None:
        """``key`` is in the bucket now: indexed, published in the next journal segment."""
        self.index.wrote(key, where)
        self.lookups.record(key, True)
        self.events.emit(EventKind.STORED, (key,))

    def holds(self, key: bytes) -> bool:
        """Whether this tier answers HIT for ``key`` (its index, or the ask mode's verdict)."""
        return key in self.index if self.index_mode else self.lookups.holds(key)

    def lost(self, key: bytes, reason: MissReason) -> None:
        """A load found ``key``'s block gone or corrupt (``reason``): a miss from now on,
        and removed if this tier held it. (Any other failure only suppresses it a while.)

        A held block found gone was removed behind kvtier's back (a lifecycle rule, a
        person): nobody else will publish that, so this node does, in its next removal
        segment, as ``deleted`` (the reason codes every reader knows). The other nodes
        check the bucket before they drop the key, so one stored again meanwhile stays. A
        block found corrupt is published once its delete succeeds (``end_delete``); one
        left in place (a newer format, signed) may be valid to others: not published. A
        key this node did not hold is not published: in the index mode a load follows a
        HIT, so a miss of an unheld key is a caller's guess (or a key in a pack the index
        has not brought yet), and a removal costs every node that holds the key a HEAD."""
        held = self.holds(key)
        self.record_miss(key, reason)
        if held and reason in (MissReason.NOT_FOUND, MissReason.CORRUPT):
            self.events.emit(EventKind.REMOVED, (key,), reason=reason.value)
        if held and reason is MissReason.NOT_FOUND:
            self.index.deleted(key, "deleted")

    def deleted(self, key: bytes, why: str) -> None:
        """This node deleted ``key``'s object (``why``: "deleted" on request, "corrupt"):
        forgotten here, published as removed at the next refresh, removed if held."""
        held = self.holds(key)
        self.lookups.forget(key)
        self.index.deleted(key, why)
        if held:
            self.events.emit(EventKind.REMOVED, (key,), reason=why)

    def should_skip_store(self, key: bytes) -> bool:
        """Whether a store of ``key`` has nothing to send: the index knows it is in the
        bucket (written here, listed, or published by another node), and a key always names
        the same bytes. If the object was deleted meanwhile, the next GET finds out and
        drops it from the index."""
        if self.index_mode and key in self.index:
            self.skipped_existing += 1
            return True
        return False

    # -- what the bucket holds is untrusted ----------------------------------------------------

    def check_location(self, key: bytes, where: Location, block_bytes: int) -> None:
        """Refuse, before any GET, a location that is not exactly a header and a block of
        ``block_bytes``: locations come from journal segments and pack tables, which anyone
        who can write the bucket can forge, and one claiming 2**40 bytes would otherwise make
        the load of one block download a whole object. A corrupt miss (the caller drops the
        entry); the pack is not touched."""
        expected = header_size(len(key), integrity_key=self.integrity_key) + block_bytes
        if where.length == expected:
            return
        self.locations_rejected += 1
        self.log.warning(
            "location",
            "%s: ignoring the index's location of %s: %d bytes at %s+%d, not a block's %d",
            self.name,
            key.hex(),
            where.length,
            where.pack,
            where.offset,
            expected,
        )
        raise CorruptBlockError(
            f"the index locates this block in {where.length} bytes, not {expected}",
            tier=self.name,
            operation="load",
            key=key,
        )

    def keep_corrupt(self, head: bytes) -> str:
        """Why a corrupt object with this ``head`` is left in place ("" to delete it): it may
        be valid to other nodes (a newer format; signed while this tier has no key)."""
        if is_newer_format(head):
            return "; newer format, left in place"
        if self.integrity_key is None and is_signed(head):
            return "; signed, and this tier has no integrity key: left in place"
        return ""

    def start_delete(self, name: str) -> bool:
        """Whether to start deleting the corrupt object ``name`` now: at most
        ``max_concurrency`` at once, and one delete per name. ``end_delete`` when done."""
        if len(self.deleting) >= self.config.max_concurrency or name in self.deleting:
            return False
        self.deleting.add(name)
        return True

    def end_delete(self, name: str, key: bytes, *, deleted: bool) -> None:
        """The background delete of ``key``'s corrupt object ``name`` ended."""
        self.deleting.discard(name)
        if deleted:
            self.corrupt_deleted += 1
            self.deleted(key, "corrupt")

    # -- statistics ----------------------------------------------------------------------------

    def lookup_statistics(self) -> LookupStatistics:
        """The lookups of this tier's mode, breaker refusals counted as ``unavailable`` (in
        the index mode, with the existence checks asked while the index loaded)."""
        asked = self.lookups.statistics()
        lookups = _with_asked(self.index.statistics(), asked) if self.index_mode else asked
        if self.breaker_misses:
            reasons = dict(lookups.misses_by_reason)
            reasons["unavailable"] = reasons.get("unavailable", 0) + self.breaker_misses
            lookups = dataclasses.replace(
                lookups, misses=lookups.misses + self.breaker_misses, misses_by_reason=reasons
            )
        return lookups

    def statistics(self, **io: Any) -> S3TierStatistics:
        """The tier's statistics: the core's own, and ``io``, the fields its I/O helpers
        count (retries, journal rounds, packs and pack reads)."""
        base = self.meter.snapshot(
            self.name,
            self.lookup_statistics(),
            request_path_requests=self.request_path_requests,
        )
        return S3TierStatistics(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(TierStatistics)},
            breaker_state=self.breaker.state.value,
            breaker_opened=self.breaker.times_opened,
            requests_rejected_by_breaker=self.breaker.rejected,
            stores_skipped_existing=self.skipped_existing,
            corrupt_deleted=self.corrupt_deleted,
            conditional_put=self.conditional_put,
            lookup_mode=self.config.lookup_mode,
            index_keys=len(self.index),
            index_listed=self.index.listed,
            index_learnt=self.index.learnt,
            index_forgotten=self.index.forgotten,
            index_removals_kept=self.index.removals_kept,
            index_audit_removed=self.index.audit_removed,
            index_evictions=self.index.evictions,
            index_loading=self.index.loading,
            index_load_skipped=self.index.load_skipped,
            index_load_requests=self.index_load_requests,
            index_locations_rejected=self.locations_rejected,
            **io,
        )

    def __repr__(self) -> str:
        return (
            f"<S3Core {self.name!r} {self.where} mode={self.config.lookup_mode} "
            f"index_keys={len(self.index)} breaker={self.breaker.state.value} "
            f"deleting={len(self.deleting)}>"
        )


def _with_asked(index: LookupStatistics, asked: LookupStatistics) -> LookupStatistics:
    """The index's answers and those of the existence checks it left to the bucket while it
    loaded (none without a background load), as one tier's."""
    if not (asked.hits or asked.misses or asked.retries or asked.pending or asked.in_flight):
        return index
    reasons = dict(index.misses_by_reason)
    for reason, count in asked.misses_by_reason.items():
        reasons[reason] = reasons.get(reason, 0) + count
    return dataclasses.replace(
        asked,
        hits=index.hits + asked.hits,
        misses=index.misses + asked.misses,
        misses_by_reason=reasons,
        cached_verdicts=index.cached_verdicts,
    )
