"""Reading journal segments into the S3 tier's existence index: list, GET, check, apply.

Shared by the journal poll (``_sync``) and the digests (``_digesting``): a segment read from
the journal and one read from a digest get the same checks (``_journal``: bounded size,
checksum or MAC, entries naming only this prefix's packs) and change the index the same way,
in the order of the segments' names. Segments and entries that are ignored are counted
(``segments_rejected``, ``entries_rejected``) and logged once per burst.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from kvtier._format import IntegrityKey
from kvtier._logging import BurstLogger
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._index import ExistenceIndex
from kvtier.tiers.s3._journal import (
    SegmentError,
    decode_removals,
    decode_segment,
    is_removal_segment,
    journal_prefix,
    max_segment_bytes,
    start_after,
)
from kvtier.tiers.s3._requests import Call, get_bytes
from kvtier.tiers.s3._skew import ClockSkew

__all__ = ["Change", "SegmentReader"]

logger = logging.getLogger("kvtier.tiers.s3._sync")

# Decoding a segment is a Python loop over its entries: segments above this size are decoded
# in a worker thread, so the event loop never spends more than about a millisecond on one.
_THREAD_DECODE_BYTES = 64 << 10
_T = TypeVar("_T")
# What one segment changed in the index: (None, keys learnt) or (why, keys forgotten).
Change = tuple[str | None, list[bytes]]


class SegmentReader:
    """Lists, fetches and applies journal segments for one ``IndexSync``."""

    def __init__(
        self,
        index: ExistenceIndex,
        *,
        name: str,
        bucket: str,
        prefix: str,
        call: Call,
        integrity_key: IntegrityKey | None,
        requests: collections.Counter[str],
        skew: ClockSkew,
        notify: Callable[[list[bytes]], None],
        forgot: Callable[[list[bytes], str], None],
    ) -> None:
        """Read segments of ``prefix`` into ``index``; ``notify(keys)`` and ``forgot(keys,
        why)`` are told what they changed (``tell``)."""
        self._index, self.name = index, name
        self._notify, self._forgot = notify, forgot
        self._bucket, self._prefix, self._call = bucket, prefix, call
        self._integrity_key = integrity_key
        self.requests = requests
        self._skew = skew
        self._journal = journal_prefix(prefix)
        self.max_segment = max_segment_bytes(prefix)
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

    async def valid(self, name: str, data: bytes) -> bool:
        """Whether ``data`` is a segment this tier accepts (counted when it is not)."""
        try:
            decode = decode_removals if is_removal_segment(data) else decode_segment
            await self._decode(decode, data)
        except SegmentError as exc:
            self.reject(name, str(exc))
            return False
        return True

    async def changes(self, name: str, data: bytes) -> list[Change]:
        """What a segment changes in this index, once applied: ``(None, keys learnt)`` for
        a store segment, ``(why, keys dropped)`` per reason for a removal segment. A segment
        that does not parse or verify changes nothing and is counted."""
        try:
            if is_removal_segment(data):
                removals, rejected = await self._decode(decode_removals, data)
                changes = self._forget(removals)
            else:
                entries, rejected = await self._decode(decode_segment, data)
                changes = [(None, self._index.add_many(entries))]
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

    def tell(self, changes: list[Change]) -> list[bytes]:
        """Tell what the segments read changed, in their order: keys learnt (``notify``,
        a run of them at once) and keys forgotten (``forgot``); the keys learnt."""
        learnt: list[bytes] = []
        run: list[bytes] = []
        for why, keys in [*changes, ("", [])]:  # the empty last one tells the last run
            if why is None:
                run.extend(keys)
                continue
            if run:
                self._index.learnt += len(run)
                self._notify(run)
                learnt += run
                run = []
            if keys:
                self._forgot(keys, why)
        return learnt

    def _forget(self, removals: list[tuple[bytes, str]]) -> list[Change]:
        """Drop the keys another node deleted; ``(why, keys dropped)`` per reason."""
        by_why: dict[str, list[bytes]] = {}
        for key, why in removals:
            by_why.setdefault(why, []).append(key)
        return [(why, self._index.forget(keys)) for why, keys in by_why.items()]

    async def _decode(self, decode: Callable[..., _T], data: bytes) -> _T:
        """``decode(data)`` for this prefix and key, in a worker thread when it is large."""
        call = functools.partial(decode, data, self._prefix, integrity_key=self._integrity_key)
        if len(data) > _THREAD_DECODE_BYTES:
            return await anyio.to_thread.run_sync(call)
        return call()

    def reject(self, name: str, why: str) -> None:
        self.segments_rejected += 1
        self._log.warning("segment", "%s: ignoring journal segment %s: %s", self.name, name, why)
