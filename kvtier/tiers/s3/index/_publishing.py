"""Publishing this node's journal segments, and deleting them once no reader lists them.

The writing half of the journal loop (``_sync`` runs it; ``_journal_format`` has the names and the
formats). Each refresh puts this node's oldest unpublished keys as one store segment and its
oldest unpublished removals as one removal segment, each named after the last (a node's
stamps only grow, whatever its clock does) and, under an integrity key, signed over that
name, so a copy under another name does not verify. A segment whose PUT fails goes back to
the front of its queue. Segments older than twice the lookback are deleted (with digests,
in batches: ``Digests.delete_own``); one whose DELETE failed stays first in line.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from kvtier.common._errors import TierError
from kvtier.common._format import IntegrityKey
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._requests import Call
from kvtier.tiers.s3.index._digest import Digests
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._journal_format import (
    MAX_SEGMENT_ENTRIES,
    encode_removals,
    encode_segment,
    segment_name,
)
from kvtier.tiers.s3.index._skew import ClockSkew
from kvtier.tiers.s3.index._snapshot import delete_object

__all__ = ["Publisher"]

logger = logging.getLogger("kvtier.tiers.s3.index._sync")


class Publisher:
    """This node's segments: put, and deleted once old (see the module docstring)."""

    def __init__(
        self,
        index: ExistenceIndex,
        *,
        name: str,
        writer: str,
        bucket: str,
        prefix: str,
        lookback_ms: int,
        call: Call,
        integrity_key: IntegrityKey | None,
        requests: collections.Counter[str],
        skew: ClockSkew,
        digests: Digests | None,
        wall: Callable[[], float],
    ) -> None:
        self._index, self.name, self._writer = index, name, writer
        self._bucket, self._prefix, self._lookback_ms = bucket, prefix, lookback_ms
        self._call, self._integrity_key = call, integrity_key
        self.requests, self._skew, self._digests = requests, skew, digests
        self._wall = wall
        self._seq = 0
        self._last_ms = 0  # the stamp of this node's newest segment: the next one is later
        # (wall ms, name) of segments published here and not deleted yet, the oldest first
        self._own: collections.deque[tuple[int, str]] = collections.deque()
        self._log = BurstLogger(logger)
        self.segments_published = 0

    async def publish(self, client: Any) -> None:
        """Put this node's oldest unpublished keys (at most ``MAX_SEGMENT_ENTRIES``: a PUT
        that keeps failing re-sends a bounded segment; the rest go in the next ones), then
        its oldest unpublished removals likewise. A key is in one of the two at most."""
        index, prefix, signer = self._index, self._prefix, self._integrity_key
        stores = index.take_unpublished(MAX_SEGMENT_ENTRIES)
        if stores:
            encode = functools.partial(encode_segment, stores, prefix, integrity_key=signer)
            await self._put_segment(client, encode, functools.partial(index.requeue, stores))
        removals = index.take_removals(MAX_SEGMENT_ENTRIES)
        if removals:
            encode = functools.partial(encode_removals, removals, prefix, integrity_key=signer)
            requeue = functools.partial(index.requeue_removals, removals)
            await self._put_segment(client, encode, requeue)

    async def _put_segment(
        self, client: Any, encode: Callable[..., bytes], requeue: Callable[[], None]
    ) -> None:
        """One segment of this node's, named after its newest one and encoded (signed) under
        that name by ``encode(name=...)``; ``requeue`` on failure."""
        now_ms = self._last_ms = max(int(self._wall() * 1000), self._last_ms + 1)
        self._seq += 1
        name = segment_name(self._prefix, now_ms, self._writer, self._seq)
        self.requests["put"] += 1
        try:
            body = encode(name=name)
            response = await self._call(
                "journal",
                None,
                lambda: client.put_object(Bucket=self._bucket, Key=name, Body=body),
            )
        except BaseException:
            requeue()
            raise
        self.segments_published += 1
        self._own.append((now_ms, name))
        if self._digests is not None:
            self._digests.note(name, body)
        self._skew.check(response)

    async def delete_old(self, client: Any) -> None:
        """Delete the segments published here that no reader lists any more (older than
        twice the lookback). A segment leaves the list only once its DELETE succeeded, so
        one that failed is tried again at the next refresh (and the poll still runs)."""
        if not self._own:
            return
        before_ms = int(self._wall() * 1000) - 2 * self._lookback_ms
        if self._digests is not None:
            await self._digests.delete_own(client, self._own, before_ms)
            return
        while self._own and self._own[0][0] < before_ms:
            _, name = self._own[0]
            self.requests["delete"] += 1
            try:
                await delete_object(self._call, client, self._bucket, name, "journal")
            except TierError as exc:  # kept: readers ignore it, the next refresh retries
                self._log.warning(
                    "journal-delete",
                    "%s: could not delete old journal segment %s (%s); retrying later",
                    self.name,
                    name,
                    exc.reason,
                )
                return
            self._own.popleft()
