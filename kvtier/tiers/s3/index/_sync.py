"""Keeping the S3 tier's existence index current: the listing at open and the journal loop.

The I/O around ``ExistenceIndex`` (a synchronous state machine): list the prefix once when
the tier opens (``_listing``, bounded by ``index_list_timeout``), then every ``index_refresh``
seconds publish this node's new keys as one journal segment (and the keys it deleted as one
removal segment: ``_publishing``) and read the segments other nodes published (``_journal_format``
documents the names, the formats and the cost).

Staleness bound: a block another node stores becomes a HIT here at most about
``2 x index_refresh`` seconds later (it waits up to ``index_refresh`` in the writer's buffer,
then up to ``index_refresh`` for this node's next poll), plus the two requests' latency.
Faults are logged once per burst and retried at the next refresh: the index only ever lags,
it is never wrong in the direction that matters (a stale HIT costs one GET and corrects
itself). A block another node deletes (on request, or as corrupt) stops being a HIT here
within the same bound: its removal is published at that node's next refresh, read at this
node's next poll, checked against the bucket in the same round (``_rechecks``: a block
stored again since stays, whatever order the segments' names give), and told as a REMOTE
removed event (``forgot``). A block deleted by anything but a kvtier node (a lifecycle
rule, a person) stays a HIT on every node until a load on one of them finds it gone (one
GET, a ``not_found`` event); that node then publishes the removal as it publishes a delete
(``S3Core.lost``), and the others drop it within the same bound.

The loop catches every ``Exception`` (a botocore error kvtier does not translate, such as a
failing credential provider, included) and counts it: it runs in a task group entered in the
engine's task, which an escaping error would cancel.

What the bucket holds is untrusted (``_journal_format``, ``_journal``): a segment is read with one
GET bounded by ``max_segment_bytes`` (one the listing shows as larger is not read at all).
Clock skew: every journal response's ``Date`` is compared with this node's clock (``_skew``).
A writer deletes its own segments once they are older than twice the lookback; one whose
DELETE failed stays first in line and is tried again at the next refresh.

With ``index_background_load`` (the default) the tier opens at once and the loop starts with
that load (``load_in_background``, ``_loading``): the newest snapshot's manifest and directory,
the journal's last lookback, then the snapshot's body or the listing; lookups of keys it has
not brought yet meanwhile fetch the snapshot chunk that holds them (``bring``).

Index snapshots (``_snapshot``, ``index_snapshots``): at open the newest snapshot, when one is
usable, replaces the listing, and the first poll lists from its cover minus the lookback. A
poll lists from the start of the last successful one (minus the lookback), so a node that
missed a few refreshes reads what it missed; one that missed more than the lookback may have
lost segments their writers deleted, so its view has a gap (``view_complete``) until it loads
a newer snapshot. Every ``index_snapshot_every`` seconds a node looks at the snapshot folder
and, if its view is complete, compacts when one is due.

The audit (``_audit``, every ``index_audit_every``, one node at a time) runs beside the
journal loop once the index is whole: it lists the prefix and finds what no journal says, an
object removed behind kvtier's back or a store whose node was killed before it published.

Journal digests (``_digest``, ``index_digests``): the refresh reads one digest per
interval by name instead of listing the journal and reading every writer's segments, and
falls back to that reading when a digest is missing for a whole interval or rejected
(``refresh_once(full=True)`` reads the journal at once); see ``_run_digests`` for when.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from kvtier.common._errors import TierError
from kvtier.common._format import IntegrityKey
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._config import S3Config
from kvtier.tiers.s3._requests import Call
from kvtier.tiers.s3.index._audit import BucketAudit
from kvtier.tiers.s3.index._digest import CARRY_INTERVALS, Digests
from kvtier.tiers.s3.index._digest_format import Digest
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._journal import SegmentReader
from kvtier.tiers.s3.index._journal_format import segment_time_ms, segment_writer
from kvtier.tiers.s3.index._listing import Listing
from kvtier.tiers.s3.index._loading import IndexLoad
from kvtier.tiers.s3.index._publishing import Publisher
from kvtier.tiers.s3.index._rechecks import RemovalChecks
from kvtier.tiers.s3.index._skew import ClockSkew
from kvtier.tiers.s3.index._snapshot import SnapshotLink, Snapshots, Survey
from kvtier.tiers.s3.index._upkeep import Upkeep

__all__ = ["IndexSync"]

logger = logging.getLogger(__name__)
_LOAD_GETS = 8  # segments the first poll of a background load reads at once


class IndexSync:
    """Fills and refreshes an ``ExistenceIndex`` from the bucket (owned by an ``S3Tier``)."""

    def __init__(
        self,
        index: ExistenceIndex,
        config: S3Config,
        *,
        name: str,
        writer: str,
        call: Call,
        client: Callable[[], Any],
        notify: Callable[[list[bytes]], None],
        forgot: Callable[[list[bytes], str], None] = lambda keys, why: None,
        read_journal: bool = True,
        integrity_key: IntegrityKey | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Keep ``index`` for the bucket and prefix of ``config``, with its ``index_refresh``,
        ``index_lookback`` and ``index_list_timeout``; ``writer`` names this node's segments.
        ``notify(keys)``: keys other nodes stored, learnt at a poll; ``forgot(keys, why)``:
        keys other nodes deleted, dropped from the index once checked (``_rechecks``)."""
        self._index, self.name, self._writer = index, name, writer
        self._call, self._client, self._notify = call, client, notify
        self._bucket, self._prefix = config.bucket, config.prefix
        self.index_refresh = config.index_refresh
        lookback = config.index_lookback
        self._lookback_ms = int(lookback * 1000)
        self._list_timeout = config.index_list_timeout
        self._wall = wall
        self._read_journal, self._integrity_key = read_journal, integrity_key
        self._log = BurstLogger(logger)
        self._skew = ClockSkew(name, lookback, lambda: self._wall())
        self.refreshes = 0
        self.refresh_failures = 0  # rounds that failed (logged once per burst)
        self.listing_complete = False
        # Index upkeep sent by the journal loop: requests by kind ("list", "get", "put",
        # "delete", "head"); the reader counts the segments and bytes it read.
        self.requests: collections.Counter[str] = collections.Counter()
        self._upkeep = Upkeep(name, self._bucket, self._prefix, call, self.requests)
        self._build_readers(config, SnapshotLink(name, writer, call, client, integrity_key))
        self.rechecks = RemovalChecks(index, self._upkeep, forgot=forgot)
        self.publisher = Publisher(
            index,
            name=name,
            writer=writer,
            bucket=self._bucket,
            prefix=self._prefix,
            lookback_ms=self._lookback_ms,
            call=call,
            integrity_key=integrity_key,
            requests=self.requests,
            skew=self._skew,
            digests=self.digests,
            wall=lambda: self._wall(),
        )
        self.covered_ms: int | None = None
        self.view_complete = False
        self.load = IndexLoad(index)  # the background load at open, if any
        self._section_gets = 0  # of the loads that ended
        self.audit = BucketAudit(
            index,
            self._upkeep,
            every=config.index_audit_every if read_journal else None,
            list_timeout=config.index_list_timeout,
            writer=writer,
            client=client,
            ready=lambda: self.listing_complete and not index.loading and self.view_complete,
            notify=self.reader.tell,
            wall=lambda: self._wall(),
        )

    def _build_readers(self, config: S3Config, link: SnapshotLink) -> None:
        """The segment reader, and the snapshots and digests when this tier uses them.
        Snapshots (``_snapshot``) rely on ``covered_ms``: the wall ms up to which the index
        holds every segment (the last poll's start, the listing's, a snapshot's cover), and
        ``view_complete``: whether it has held them without a gap since the tier opened."""
        self.reader = SegmentReader(
            self._index,
            self._upkeep,
            integrity_key=link.integrity_key,
            skew=self._skew,
            notify=self._notify,
        )
        reads = self._read_journal
        self.snapshots = (
            Snapshots(self._index, config, link=link, requests=self.requests)
            if reads and config.index_snapshots
            else None
        )
        self.digests = (
            Digests(config, link=link, reader=self.reader, requests=self.requests)
            if reads and config.index_digests
            else None
        )

    @property
    def segments_published(self) -> int:
        return self.publisher.segments_published

    @property
    def clock_skew(self) -> float:
        """This node's wall clock minus the server's, seconds (the last measure)."""
        return self._skew.last

    def counts(self) -> dict[str, Any]:
        """The listing's and the journal's counters, by their ``S3TierStatistics`` names."""
        reader = self.reader
        return {
            "index_listing_complete": self.listing_complete,
            "index_refreshes": self.refreshes,
            "index_refresh_failures": self.refresh_failures,
            "journal_segments_published": self.segments_published,
            "journal_segments_read": reader.segments_read,
            "journal_segments_rejected": reader.segments_rejected,
            "journal_entries_rejected": reader.entries_rejected,
            "journal_clock_skew": self.clock_skew,
            "index_audits": self.audit.audits,
            "index_audit_failures": self.audit.failures,
            "index_audit_learnt": self.audit.learnt,
            "index_audit_seconds": self.audit.last_seconds,
        }

    # -- the listing at open -------------------------------------------------------------------

    async def list_at_open(self, survey: Survey | None = None) -> None:
        """Load the newest index snapshot if there is a usable one (``_snapshot``; from
        ``survey`` when one was made already), else index every block object under the
        prefix, within ``index_list_timeout`` seconds (``_listing``)."""
        started_ms = int(self._wall() * 1000)
        if self.snapshots is not None and await self._load_snapshot(started_ms, survey):
            self.listing_complete = True
            return
        listing = Listing(
            self._index.load_one,
            self._call,
            self._client(),
            name=self.name,
            bucket=self._bucket,
            prefix=self._prefix,
        )
        self.listing_complete = await listing.run(self._list_timeout)
        self._index.listed = listing.found
        listing.report(complete=self.listing_complete, timeout=self._list_timeout)
        self.covered_ms, self.view_complete = started_ms, self.listing_complete

    async def _load_snapshot(self, wall_ms: int, survey: Survey | None = None) -> bool:
        """Load the newest snapshot newer than the one held (``survey``: the folder as
        listed already, else listed now); whether one was loaded. The next poll lists from
        its cover minus the lookback."""
        assert self.snapshots is not None
        try:
            if survey is None:
                survey = await self.snapshots.survey(wall_ms)
            cover = await self.snapshots.load(survey, newer_than=self.snapshots.generation)
        except TierError as exc:
            self._log.warning("snapshot", "%s: no index snapshot (%s)", self.name, exc.reason)
            return False
        if cover is None:
            return False
        if self.covered_ms is None or not self.view_complete or cover > self.covered_ms:
            self.covered_ms, self.view_complete = cover, True
        return True

    async def _prepare_snapshot(self) -> Survey | None:
        """A background load's first step: list the snapshot folder and read the newest
        snapshot's manifest and directory (``Snapshots.prepare``), so lookups can fetch
        the chunk of any of its keys while the journal and the body are read; the survey,
        for ``list_at_open`` (None without snapshots, or when the folder cannot be read:
        ``list_at_open`` then tries again, and says why)."""
        if self.snapshots is None:
            return None
        try:
            survey = await self.snapshots.survey(int(self._wall() * 1000))
            await self.snapshots.prepare(survey)
        except TierError:
            return None
        return survey

    async def bring(self, keys: list[bytes]) -> set[bytes] | None:
        """While a background load runs, make the index answer for ``keys`` as the loaded
        index will, where the snapshot allows: index the chunks of its body that hold them
        (``_snapshot_sections``), then wait until the journal's last lookback is read too.
        Returns the keys that still need asking the bucket (a HEAD): those whose chunk could
        not be read, or, without a snapshot directory (none, an older writer's, or a
        listing instead), None: every key not indexed. It first waits for the directory (a
        few small requests at the start of the load): a key asked without it would be
        answered MISS, and that answer kept for ``miss_ttl``, though one GET would have
        found it. Raises nothing but cancellation."""
        await self.load.wait_prepared()
        sections = self.snapshots.sections if self.snapshots is not None else None
        if sections is None or not self._index.loading:
            return None
        failed = await sections.bring(keys)
        await self.load.wait_journal_read()
        return failed

    @property
    def section_gets(self) -> int:
        """The GETs of snapshot chunks sent for lookups during the load at open."""
        return self._section_gets + (
            self.snapshots.sections.gets
            if self.snapshots is not None and self.snapshots.sections is not None
            else 0
        )

    # -- the journal loop ------------------------------------------------------------------

    async def load_in_background(self) -> None:
        """The load at open of a tier that opened at once (``index_background_load``,
        ``_loading``): the newest snapshot's manifest and directory first (a few small
        requests, after which any key of the snapshot is one GET away), then the journal
        of the last lookback (read beside the body, it only slowed both), then the body or
        the listing. Never raises an ``Exception``: a failed load leaves the listing
        incomplete, logged."""

        async def load() -> None:
            try:
                survey = await self._prepare_snapshot()
            finally:
                self.load.prepared()
            try:
                if self._read_journal:
                    await self._read_recent()
            finally:
                self.load.journal_read()
            await self.list_at_open(survey)

        try:
            if not await self.load.run(load, self._failed):
                self.listing_complete = False
        finally:
            if self.snapshots is not None and self.snapshots.sections is not None:
                self._section_gets += self.snapshots.sections.gets
                self.snapshots.sections = None

    def begin_load(self) -> None:
        """At open: the index is loaded in the background (``run``), not complete until then."""
        self.listing_complete = False
        self.load.begin()

    async def _read_recent(self) -> None:
        """The background load's journal read, its removals checked; never raises."""
        try:
            await self.poll(ahead=_LOAD_GETS)
            await self.rechecks.run(self._client())
        except Exception as exc:  # read again at the next round
            self._failed(exc)

    async def run(self) -> None:
        """The background load if any, then publish and poll every ``index_refresh`` s, and
        the audits beside."""
        if self.load.running:
            await self.load_in_background()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.audit.run)
            if self.digests is not None:
                await self._run_digests(self.digests)
            while True:
                await anyio.sleep(self.index_refresh)
                await self.refresh_once()

    async def _run_digests(self, digests: Digests) -> None:
        """Three turns an interval, in order: at its start a node whose turn it is digests
        the interval that just ended (``_digest``); at a quarter every node reads that
        digest (again at the middle if it was late), so a key waits on average what it waits
        without digests; at three quarters it publishes, before the next digest lists. A
        late turn runs at once; a loop a whole interval behind moves on to the current one."""
        length_ms = digests.interval_ms
        interval = int(self._wall() * 1000) // length_ms + 1
        while True:
            interval = max(interval, int(self._wall() * 1000) // length_ms)
            start_ms = interval * length_ms
            await self._sleep_until(start_ms)
            await self._digest_turn()
            await self._sleep_until(start_ms + length_ms // 4)
            await self.refresh_once(publish=False)
            if digests.missing_last:
                await self._sleep_until(start_ms + length_ms // 2)
                await self.refresh_once(publish=False, count=False)
            await self._sleep_until(start_ms + 3 * length_ms // 4)
            await self.refresh_once(poll=False, count=False)
            interval += 1

    async def _sleep_until(self, wall_ms: int) -> None:
        await anyio.sleep(max(wall_ms / 1000 - self._wall(), 0.0))

    async def refresh_once(
        self, *, poll: bool = True, publish: bool = True, count: bool = True, full: bool = False
    ) -> None:
        """One round: publish this node's new keys and delete its old segments (unless
        ``publish`` is False), read the others' (unless ``poll`` is False or this tier does
        not read the journal): from the digests when there are, else from the journal; a
        round counts in ``refreshes`` unless ``count`` is False. Never raises an
        ``Exception``: a failed round is logged once per burst and counted, and the next
        round tries again. ``full``: read the journal even with digests (a fresh view now).
        The removals read are checked (``_rechecks``) before the snapshot round."""
        try:
            if publish:
                await self.publisher.publish(self._client())
                await self.publisher.delete_old(self._client())
            if poll and self._read_journal:
                if self.digests is None or full:
                    await self.poll()
                else:
                    await self._digest_round()
                await self.rechecks.run(self._client())
                await self._snapshot_round()
        except Exception as exc:
            self._failed(exc)
        self.refreshes += count

    def _failed(self, exc: Exception) -> None:
        self.refresh_failures += 1
        reason = exc.reason if isinstance(exc, TierError) else type(exc).__name__
        self._log.warning("refresh", "%s: index refresh failed (%s); retrying", self.name, reason)

    async def _digest_turn(self) -> None:
        """Digest the interval that just ended if it is this node's turn; never raises."""
        assert self.digests is not None
        if not self._read_journal:
            return
        try:
            for made in await self.digests.make_due(int(self._wall() * 1000)):
                await self._apply(made)
        except Exception as exc:
            self._failed(exc)

    async def _digest_round(self) -> None:
        """Read the digests of the intervals that ended since the last round (digesting the
        last one first if it is this node's turn). A missing digest whose segments a later
        one carries is passed over; one no digest can carry any more, a rejected one, or a
        node too far behind reads the journal instead; so does a look every half lookback
        for segments no digest brought."""
        digests = self.digests
        assert digests is not None
        await self._digest_turn()
        now_ms = int(self._wall() * 1000)
        target = digests.interval_of(now_ms) - 1
        wanted, gap = digests.to_read(target), None
        for interval in wanted or ():
            digest = await digests.fetch(interval)
            if digest is None and digests.missing_last:
                gap = interval if gap is None else gap  # carried by a later one, perhaps
            elif digest is None or (gap is not None and gap < interval - CARRY_INTERVALS):
                wanted = None
                break
            else:
                await self._apply(digest)
                gap = None
        if wanted is None or (gap is not None and gap < target - 1):
            digests.fallbacks += 1
            await self.poll()
            digests.skip_to(target + 1)
        elif gap is not None:
            digests.next = gap  # may still come: look again at the next round
        elif digests.sweep_due(now_ms):
            await self.poll(until_ms=digests.start_ms(digests.next or target))
        elif self.covered_ms is not None and digests.next is not None:
            self.covered_ms = max(self.covered_ms, digests.start_ms(digests.next))

    async def _apply(self, digest: Digest) -> None:
        """Apply a digest's segments that this node has not read, in name order."""
        assert self.digests is not None
        changes: list[bytes] = []
        try:
            for name, data in digest.segments:
                if name in self._index.unseen([name]) and segment_writer(name) != self._writer:
                    changes.extend(await self.reader.changes(name, data))
                self._index.seen(name, segment_time_ms(name) or 0)
        finally:
            self.reader.tell(changes)
        self.digests.done(digest)

    async def _snapshot_round(self) -> None:
        """Every ``index_snapshot_every`` seconds: catch up from a newer snapshot if this
        index has a gap, else compact one if it is due (``_snapshot``)."""
        now_ms = int(self._wall() * 1000)
        if self.snapshots is None or self.covered_ms is None:
            return
        if not self.snapshots.due(now_ms):
            return
        if not self.view_complete:
            await self._load_snapshot(now_ms)
            return
        if not self._index.full and self.listing_complete:
            await self.snapshots.tick(now_ms, self.covered_ms)

    async def poll(self, *, until_ms: int | None = None, ahead: int = 1) -> list[bytes]:
        """Read the segments other writers published within the lookback (those stamped
        before ``until_ms`` only, when given); the new keys. ``ahead``: GET that many at
        once, applied in order all the same (a load at open, with many to read)."""
        client = self._client()
        now_ms = int(self._wall() * 1000)
        covered = now_ms if self.covered_ms is None else min(self.covered_ms, now_ms)
        self._check_gap(now_ms, covered)
        # From the last poll's start (or a snapshot's cover) minus the lookback: a poll
        # after a short outage reads what it missed, while the writers keep it.
        oldest = covered - self._lookback_ms
        sizes = await self.reader.list_since(client, oldest)
        changes: list[bytes] = []
        names, got = self._index.unseen(sizes), dict[str, bytes | None]()
        try:
            for i, name in enumerate(names):
                if ahead > 1 and i % ahead == 0:
                    window = names[i : i + ahead]
                    wanted = self.reader.wanted
                    got = await self.reader.prefetch(
                        client, [n for n in window if wanted(n, sizes[n], self._writer, until_ms)]
                    )
                stamp = segment_time_ms(name)
                if (
                    stamp is None  # not a segment's name
                    or not self.reader.in_journal(name)
                    or segment_writer(name) == self._writer  # our own
                ):
                    self._index.seen(name, stamp or now_ms)
                    continue
                if self.digests is not None:
                    self.digests.note(name)
                if until_ms is not None and stamp >= until_ms:
                    continue  # a digest brings it
                size = sizes[name]
                if not isinstance(size, int) or not 0 <= size <= self.reader.max_segment:
                    self.reader.reject(name, f"{size} bytes")
                else:
                    data = got.pop(name) if name in got else await self.reader.fetch(client, name)
                    changes.extend(await self.reader.changes(name, data) if data else ())
                self._index.seen(name, stamp)
        finally:
            learnt = self.reader.tell(changes)  # what was applied is told, even if a GET failed
        self._index.forget_seen_before(oldest)
        if self.covered_ms is not None:
            self.covered_ms = max(self.covered_ms, min(now_ms, until_ms or now_ms))
        return learnt

    def _check_gap(self, now_ms: int, covered: int) -> None:
        """A view not refreshed for the lookback may miss segments since deleted: a gap."""
        if now_ms - covered >= self._lookback_ms and self.view_complete:
            self.view_complete = False
            if self.snapshots is not None:
                self.snapshots.look_now()
            self._log.warning(
                "gap",
                "%s: no journal poll for %.0f s (index_lookback): the index may miss keys "
                "until a newer index snapshot is loaded",
                self.name,
                (now_ms - covered) / 1000,
            )
