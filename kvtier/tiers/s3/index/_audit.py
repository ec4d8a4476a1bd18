"""The audit of the S3 tier's index against the bucket: finding what nobody announced.

Two acts reach no journal: an object removed by something other than kvtier (a lifecycle
rule, a person, a tool) that no node loads, and a store or a delete whose node was killed
before its next publish. The bucket's listing is the only record of either, so once every
``index_audit_every`` seconds one node of the fleet lists the prefix and compares the listing
with its index:

- a key the index held when the audit began that the listing lacks is doubted (at most
  ``MAX_DOUBTED`` an audit), as a removal another node published is (``_rechecks``): a HEAD
  in a later refresh round, then, found gone, it is dropped, told as removed (``not_found``,
  LOCAL) and published in this node's removal segment as ``deleted``, so the other nodes
  check and drop it within about twice ``index_refresh``. A key stored again while the
  listing ran is found by its HEAD and stays;
- a block the listing has that the index lacks is indexed, told as stored (``notify``) and
  published in this node's next store segment, so the others learn it; one this node learnt
  gone while the listing ran is not brought back (``ExistenceIndex.begin_audit``). An index
  that has been full (``index_max_keys``) learns nothing this way: it would evict keys it
  holds to make room for keys nobody asked for.

A listing cut short by a failed request or by its bound (the longer of ``index_list_timeout``
and ``index_audit_every``: a prefix too large to list at open may still be audited, once an
interval) settles nothing: a key it did not reach is not missing. The audit never runs while
the index loads or is incomplete.

Whose turn: the wall clock cuts time into intervals of ``index_audit_every``; the node whose
conditional PUT (``If-None-Match: *``) of the marker ``<prefix>/_kvtier_audits/<interval>``
wins audits that interval, and the others do nothing. A server that ignores the condition
lets every node audit (the same result, at every node's cost). The winner deletes the marker
of two intervals before.

Cost, for the whole fleet each interval: the listing at open's (one LIST per 1,000 objects and
one small ranged GET per pack), one PUT per node and one DELETE, then one HEAD per key found
missing, at most ``MAX_CHECKS_PER_ROUND`` per refresh round. Memory while it runs: 8 bytes per
listed block (its 64-bit hash), the blocks the index lacked (at most ``MAX_LEARNT``), and the
index's keys as of the start, copied as the full state copies them and compared in a worker
thread.
"""

from __future__ import annotations

import array
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import xxhash

from kvtier.common._errors import TierError
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._names import under_prefix
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._listing import Listing
from kvtier.tiers.s3.index._snapshot import delete_object, put_if_absent
from kvtier.tiers.s3.index._upkeep import Upkeep

__all__ = ["AUDIT_DIR", "MAX_DOUBTED", "MAX_LEARNT", "BucketAudit", "audit_marker"]

logger = logging.getLogger("kvtier.tiers.s3.index._sync")

AUDIT_DIR = "_kvtier_audits"
MAX_LEARNT = 65_536
"""Blocks one audit indexes that the index lacked; the rest wait for the next audit."""
MAX_DOUBTED = 65_536
"""Keys one audit doubts (the checks drain ``MAX_CHECKS_PER_ROUND`` a round); the rest wait
for the next audit."""
_SLICE = 4_096  # keys doubted or learnt between two yields to the event loop

_Entries = Callable[[], list[tuple[bytes, Location | None]]]


def audit_marker(prefix: str, interval_ms: int, interval: int) -> str:
    """The name whose conditional PUT claims the audit of ``interval``."""
    return under_prefix(prefix, f"{AUDIT_DIR}/{interval_ms:012d}-{interval:015d}")


def _missing(entries: _Entries, listed: np.ndarray[Any, np.dtype[np.uint64]]) -> list[bytes]:
    """The keys of ``entries()`` whose hash is not in ``listed`` (sorted); in a worker thread."""
    keys = [key for key, _ in entries()]
    if not keys:
        return []
    hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=np.uint64, count=len(keys))
    at = np.searchsorted(listed, hashes)
    found = np.zeros(len(keys), dtype=bool)
    inside = at < len(listed)
    found[inside] = listed[at[inside]] == hashes[inside]
    return [keys[i] for i in np.flatnonzero(~found)]


class BucketAudit:
    """The audits of one ``IndexSync`` (see the module docstring)."""

    def __init__(
        self,
        index: ExistenceIndex,
        upkeep: Upkeep,
        *,
        every: float | None,
        list_timeout: float,
        writer: str,
        client: Callable[[], Any],
        ready: Callable[[], bool],
        notify: Callable[[list[bytes]], object],
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Audit ``index`` every ``every`` seconds (None: only when ``audit`` is called)
        when it is this node's turn (``writer`` names it in the marker) and ``ready()`` says
        the index is whole, listing for at most the longer of ``list_timeout`` and
        ``every``; ``notify(keys)`` is told the blocks an audit indexed."""
        self._index, self._upkeep, self.name = index, upkeep, upkeep.name
        self.interval_ms = None if every is None else max(int(every * 1000), 1)
        self._list_timeout = max(list_timeout, every or 0.0)
        self._writer = writer
        self._client, self._ready, self._notify, self._wall = client, ready, notify, wall
        self._log = BurstLogger(logger)
        self.audits = 0  # audits that listed the whole prefix and compared it
        self.failures = 0  # audits cut short (a request failed, the listing's bound)
        self.doubted = 0  # indexed keys a listing lacked, doubted (then checked)
        self.learnt = 0  # blocks a listing had that the index lacked, indexed
        self.last_seconds = 0.0  # the last whole audit's time: its findings are that late
        self._one_at_a_time = anyio.Lock()  # a turn and ``S3Tier.audit_index`` may meet

    async def run(self) -> None:
        """Claim and run the audit of every interval, from the next one on (never, without
        an interval)."""
        length = self.interval_ms
        if length is None:
            return
        while True:
            interval = int(self._wall() * 1000) // length + 1
            await anyio.sleep(max(interval * length / 1000 - self._wall(), 0.0))
            if self._ready():
                await self.turn(interval)

    async def turn(self, interval: int) -> bool:
        """Audit ``interval`` if this node wins its marker; whether it audited. Never raises
        an ``Exception``: a failed audit is logged once per burst and counted."""
        upkeep, client, length = self._upkeep, self._client(), self.interval_ms
        assert length is not None
        marker = audit_marker(upkeep.prefix, length, interval)
        try:
            won = await put_if_absent(
                upkeep.call,
                client,
                upkeep.bucket,
                marker,
                self._writer.encode(),
                "journal",
                upkeep.requests,
            )
            if not won:
                return False
            await self.audit()
            old = audit_marker(upkeep.prefix, length, interval - 2)
            upkeep.requests["delete"] += 1
            await delete_object(upkeep.call, client, upkeep.bucket, old, "journal")
        except Exception as exc:
            self.failures += 1
            reason = exc.reason if isinstance(exc, TierError) else type(exc).__name__
            self._log.warning("audit", "%s: index audit failed (%s)", self.name, reason)
            return False
        return True

    async def audit(self) -> None:
        """List the prefix and settle the index against it (see the module docstring), one
        audit at a time. Raises ``TierError`` when a request fails, and ``TimeoutError``
        past the bound."""
        async with self._one_at_a_time:
            await self._audit()

    async def _audit(self) -> None:
        index, upkeep = self._index, self._upkeep
        started = time.monotonic()
        before = index.entries_reader()  # the keys held now: a later store is not missing
        learn = not index.full
        hashes = array.array("Q")
        unlisted: dict[bytes, Location | None] = {}

        def keep(key: bytes, where: Location | None) -> bool:
            hashes.append(xxhash.xxh3_64_intdigest(key))
            if learn and len(unlisted) < MAX_LEARNT and key not in index:
                unlisted[key] = where
            return True

        listing = Listing(
            keep,
            upkeep.call,
            self._client(),
            name=self.name,
            bucket=upkeep.bucket,
            prefix=upkeep.prefix,
            doing="auditing",
        )
        index.begin_audit()
        try:
            complete = await listing.run(self._list_timeout)
            upkeep.requests["list"] += listing.pages
            if not complete:
                raise TimeoutError(f"listing the prefix took over {self._list_timeout} s")
            found = list(unlisted.items())
            learnt: list[bytes] = []
            for start in range(0, len(found), _SLICE):
                await anyio.lowlevel.checkpoint()
                entries = found[start : start + _SLICE]
                learnt.extend(key for key, where in entries if index.audit_learn(key, where))
        finally:
            index.end_audit()
        listed = np.sort(np.frombuffer(hashes, dtype=np.uint64))
        missing = (await anyio.to_thread.run_sync(_missing, before, listed))[:MAX_DOUBTED]
        for start in range(0, len(missing), _SLICE):
            await anyio.lowlevel.checkpoint()
            self.doubted += index.audit_doubt(missing[start : start + _SLICE])
        self.learnt += len(learnt)
        self.audits += 1
        self.last_seconds = time.monotonic() - started
        if learnt:
            self._notify(learnt)
        if missing or learnt:
            logger.info(
                "%s: audit of %d blocks: %d indexed here are not in the bucket (checking "
                "them), %d in the bucket were not indexed here (learnt)",
                self.name,
                listing.found,
                len(missing),
                len(learnt),
            )
