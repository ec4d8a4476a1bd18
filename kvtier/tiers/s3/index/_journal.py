"""Reading journal segments into the S3 tier's existence index: list, GET, check, apply.

Shared by the journal poll (``_sync``) and the digests (``_digest``): a segment read from
the journal and one read from a digest get the same checks (``_journal_format``: bounded size,
checksum or MAC over the segment's own name, entries naming only this prefix's packs) and
change the index the same way, in the order of the segments' names: a store segment's keys
are learnt, a removal segment's keys are doubted (``ExistenceIndex.doubt``: dropped only once
``_rechecks`` finds their objects gone). Segments and entries that are ignored are counted
(``segments_rejected``, ``entries_rejected``) and logged once per burst.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from kvtier.common._errors import TierError
from kvtier.common._format import IntegrityKey
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._requests import get_bytes
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._journal_format import (
    SegmentError,
    decode_removals,
    decode_segment,
    is_removal_segment,
    journal_prefix,
    max_segment_bytes,
    segment_time_ms,
    segment_writer,
    start_after,
)
from kvtier.tiers.s3.index._skew import ClockSkew
from kvtier.tiers.s3.index._upkeep import Upkeep

__all__ = ["SegmentReader"]

logger = logging.getLogger("kvtier.tiers.s3.index._sync")

# Decoding a segment is a Python loop over its entries: segments above this size are decoded
# in a worker thread, so no one segment holds the event loop (docs/design.md, "Measurements
# behind the defaults").
_THREAD_DECODE_BYTES = 64 << 10
_T = TypeVar("_T")


class SegmentReader:
    """Lists, fetches and applies journal segments for one ``IndexSync``."""

    def __init__(
        self,
        index: ExistenceIndex,
        upkeep: Upkeep,
        *,
        integrity_key: IntegrityKey | None,
        skew: ClockSkew,
        notify: Callable[[list[bytes]], None],
    ) -> None:
        """Read segments of ``upkeep.prefix`` into ``index``; ``notify(keys)`` is told the
        keys they taught it (``tell``)."""
        self._index, self.name = index, upkeep.name
        self._notify = notify
        self._bucket, self._prefix, self._call = upkeep.bucket, upkeep.prefix, upkeep.call
        self._integrity_key = integrity_key
        self.requests = upkeep.requests
        self._skew = skew
        self._journal = journal_prefix(self._prefix)
        self.max_segment = max_segment_bytes(self._prefix)
        self._log = BurstLogger(logger)
        self.segments_read = 0
        self.segments_rejected = 0  # segments ignored: unparsable, unauthenticated, too large
        self.entries_rejected = 0  # entries ignored: naming no pack of this prefix, bad key
        self.bytes_read = 0

    async def list_since(self, client: Any, oldest: int) -> dict[str, object]:
        """Name -> size of every journal segment named after ``oldest`` (wall ms); the first
        page's Date checks this node's clock against the server's."""
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Prefix": self._journal,
            "StartAfter": start_after(self._prefix, oldest),
        }
        sizes: dict[str, object] = {}
        first = True
        while True:
            self.requests["list"] += 1
            page = await self._call(
                "journal", None, functools.partial(client.list_objects_v2, **kwargs)
            )
            assert not isinstance(page, Fault)
            if first:
                self._skew.check(page)
                first = False
            for item in page.get("Contents", ()):
                sizes[item["Key"]] = item.get("Size")
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sizes
            kwargs["ContinuationToken"] = token

    def in_journal(self, name: str) -> bool:
        """Whether ``name`` lies directly in this prefix's journal folder."""
        return name.startswith(self._journal) and "/" not in name[len(self._journal) :]

    async def fetch(self, client: Any, name: str) -> bytes | None:
        """One GET of at most ``max_segment_bytes`` (the object may have grown since the
        listing); None when there is nothing to read."""
        expected = frozenset({Fault.NOT_FOUND, Fault.REJECTED})
        get = functools.partial(get_bytes, client, self._bucket, name, 0, self.max_segment)
        self.requests["get"] += 1
        data = await self._call("journal", None, get, expected=expected)
        if isinstance(data, Fault):
            # Deleted by its writer meanwhile (older than the lookback anyway), or empty (a
            # range past the end).
            if data is Fault.REJECTED:
                self.reject(name, "empty")
            return None
        self.segments_read += 1
        self.bytes_read += len(data)
        return bytes(data)

    def wanted(self, name: str, size: object, writer: str, until_ms: int | None) -> bool:
        """Whether a poll GETs segment ``name`` of the listed ``size``: a segment of this
        journal, of another writer than ``writer``, stamped before ``until_ms`` (when given),
        of a size it reads."""
        stamp = segment_time_ms(name)
        return (
            stamp is not None
            and self.in_journal(name)
            and segment_writer(name) != writer
            and (until_ms is None or stamp < until_ms)
            and isinstance(size, int)
            and 0 <= size <= self.max_segment
        )

    async def prefetch(self, client: Any, names: list[str]) -> dict[str, bytes | None]:
        """``fetch`` of each of ``names`` at once (a poll with many segments to read, where
        one GET after another is what takes the time): what each returned. A GET that failed
        is left out, for the caller's own ``fetch`` to try again and report."""
        got: dict[str, bytes | None] = {}

        async def one(name: str) -> None:
            with contextlib.suppress(TierError):
                got[name] = await self.fetch(client, name)

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(one, name)
        return got

    async def valid(self, name: str, data: bytes) -> bool:
        """Whether ``data`` is a segment this tier accepts (counted when it is not)."""
        try:
            decode = decode_removals if is_removal_segment(data) else decode_segment
            await self._decode(decode, name, data)
        except SegmentError as exc:
            self.reject(name, str(exc))
            return False
        return True

    async def changes(self, name: str, data: bytes) -> list[bytes]:
        """Apply segment ``name`` to this index: the keys a store segment taught it (a
        removal segment's keys are doubted, and teach nothing). A segment that does not
        parse or verify changes nothing and is counted."""
        try:
            if is_removal_segment(data):
                removals, rejected = await self._decode(decode_removals, name, data)
                changes = self._doubt(removals)
            else:
                entries, rejected = await self._decode(decode_segment, name, data)
                changes = self._index.add_many(entries)
        except SegmentError as exc:
            self.reject(name, str(exc))
            return []
        if rejected:
            self.entries_rejected += rejected
            self._log.warning(
                "journal-entry",
                "%s: ignoring %d entries of journal segment %s (naming no pack of this prefix, "
                "a bad key or reason)",
                self.name,
                rejected,
                name,
            )
        return changes

    def tell(self, learnt: list[bytes]) -> list[bytes]:
        """Tell the keys the segments read taught this index (``notify``, all at once)."""
        if learnt:
            self._index.learnt += len(learnt)
            self._notify(learnt)
        return learnt

    def _doubt(self, removals: list[tuple[bytes, str]]) -> list[bytes]:
        """Doubt the keys another node deleted (see the module docstring); nothing learnt."""
        by_why: dict[str, list[bytes]] = {}
        for key, why in removals:
            by_why.setdefault(why, []).append(key)
        for why, keys in by_why.items():
            self._index.doubt(keys, why)
        return []

    async def _decode(self, decode: Callable[..., _T], name: str, data: bytes) -> _T:
        """``decode(data)`` of segment ``name`` for this prefix and key, in a worker thread
        when it is large."""
        call = functools.partial(
            decode, data, self._prefix, integrity_key=self._integrity_key, name=name
        )
        if len(data) > _THREAD_DECODE_BYTES:
            return await anyio.to_thread.run_sync(call)
        return call()

    def reject(self, name: str, why: str) -> None:
        self.segments_rejected += 1
        self._log.warning("segment", "%s: ignoring journal segment %s: %s", self.name, name, why)
