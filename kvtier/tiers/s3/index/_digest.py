"""Journal digests of the S3 tier: who writes one and when, and reading them (``_digest_format``
has the format).

No metadata service decides who digests. Time is cut into intervals of ``index_refresh``
seconds by the wall clock; the writers a node knows with a segment stamped in the
``index_lookback`` before interval ``j - CARRY_INTERVALS`` (itself included; a fleet that has
just started counts them up to ``j``) are sorted, and ``j`` is digested by the ``j mod n``-th
of them. Nodes reading the same digests know the same
writers, so they agree; where views differ, two nodes may both digest ``j``: each writes the
digest with a conditional PUT (``If-None-Match: *``), so one wins and the other reads the
winner's. A node that digests ``j``:

1. lists the journal from the start of ``j - CARRY_INTERVALS`` (one LIST);
2. GETs each segment stamped before the end of ``j`` that no digest it read holds yet, and
   checks it as a reader would (a segment that fails is left out and counted);
3. publishes the digest, and deletes the digest of ``2 x index_lookback`` ago.

Segments of ``j`` that no digest holds (their PUT was slow, the digester's clock ran ahead,
or the node whose turn it was never digested: it crashed, or it is a kvtier that predates
digests) are carried by the next interval's digester, which is therefore ``j``'s backup.

A reader GETs the digests of the intervals that ended since its last refresh, by name. When
one is missing, the reader passes over it if a later digest carries its segments, and looks
again at the next round while one still may (its digester may be late: a loaded node's turn
also takes the interval before, if that was its turn and it missed it). When one is
rejected, or missing with no digest left that can carry it, or the reader is more than
``MAX_CATCH_UP`` intervals behind, it reads the journal as a node without digests does (a
LIST and a GET per segment it has not read), so the index never depends on a digester.
Every ``index_lookback / 2`` it also lists the journal and reads the segments that no digest
brought although their interval is digested (one LIST, and normally nothing to read).
Writers keep publishing and deleting their own segments as before, so kvtier nodes that
predate digests keep reading the journal.
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import logging
from typing import Any

import anyio
import anyio.to_thread

from kvtier.common._errors import TierError
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._config import S3Config
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._requests import get_bytes
from kvtier.tiers.s3.index._digest_format import (
    CARRY_INTERVALS,
    MAX_DIGEST_BYTES,
    MAX_DIGEST_SEGMENTS,
    Digest,
    DigestError,
    decode_digest,
    digest_name,
    encode_digest,
)
from kvtier.tiers.s3.index._journal import SegmentReader
from kvtier.tiers.s3.index._journal_format import segment_name, segment_time_ms, segment_writer
from kvtier.tiers.s3.index._snapshot import SnapshotLink, delete_object, put_if_absent

__all__ = ["CARRY_INTERVALS", "DELETE_BATCH", "MAX_CATCH_UP", "Digests"]

logger = logging.getLogger(__name__)

# A reader further behind than this many intervals reads the journal instead.
MAX_CATCH_UP = 4
# A writer deletes its old segments in batches of this many (one request for them all).
DELETE_BATCH = 16
_GET_ANSWERS = frozenset({Fault.NOT_FOUND, Fault.REJECTED})
_THREAD_BYTES = 256 << 10
# A digester reads the interval's segments this many at a time (the digest is due by the
# time the readers' round comes, a quarter interval later).
_PARALLEL_GETS = 16


class Digests:
    """Writing and reading digests for one ``IndexSync`` (see the module docstring)."""

    def __init__(
        self,
        config: S3Config,
        *,
        link: SnapshotLink,
        reader: SegmentReader,
        requests: collections.Counter[str],
    ) -> None:
        self.name, self._writer = link.name, link.writer
        self._call, self._client = link.call, link.client
        self._integrity_key = link.integrity_key
        self._bucket, self._prefix = config.bucket, config.prefix
        self._reader, self.requests = reader, requests
        self.interval_ms = max(int(config.index_refresh * 1000), 1)
        self._lookback_ms = int(config.index_lookback * 1000)
        self._keep = -(-2 * self._lookback_ms // self.interval_ms) + 1
        self._log = BurstLogger(logger)
        self.next: int | None = None  # the next interval whose digest this node reads
        self._made = -1  # the newest interval this node tried to digest
        self._covered: dict[str, int] = {}  # segment names in digests read: their stamps
        self._writers: dict[str, list[int]] = {}  # writer id: stamps seen of it, sorted
        self._own: dict[str, bytes] = {}  # segments published here and not yet digested
        self._swept_ms: int | None = None
        self.missing_last = False  # whether the last digest asked for was not there
        self.published = 0
        self.read = 0
        self.lost = 0  # digests another node published first
        self.missing = 0  # digests not there when read: the journal was read instead
        self.rejected = 0  # digests ignored: too large, corrupt, unauthenticated
        self.fallbacks = 0  # refreshes that read the journal instead of a digest

    def interval_of(self, wall_ms: int) -> int:
        return wall_ms // self.interval_ms

    def start_ms(self, interval: int) -> int:
        return interval * self.interval_ms

    def note(self, name: str, body: bytes | None = None) -> None:
        """A segment seen (published, listed or read): its writer is alive. ``body``: one
        this node published, kept until digested so its digester need not GET it."""
        writer, stamp = segment_writer(name), segment_time_ms(name)
        if writer is not None and stamp is not None:
            stamps = self._writers.setdefault(writer, [])
            if stamp not in stamps:
                bisect.insort(stamps, stamp)
        if body is not None:
            self._own[name] = body

    def designated(self, interval: int, wall_ms: int) -> bool:
        """Whether it is this node's turn to digest ``interval``: the writers counted are
        those with a segment stamped in the lookback before interval ``interval -
        CARRY_INTERVALS``, which every node has read (from the digests, or the journal) by
        the time the turn comes, even after a missing digest or a late segment; a writer's
        newer segments, which it knows before the others, do not count yet. A fleet that
        has just started, with no such writer, counts the writers up to ``interval``."""
        for writer, stamps in list(self._writers.items()):
            del stamps[: bisect.bisect_left(stamps, wall_ms - 3 * self._lookback_ms)]
            if not stamps:
                del self._writers[writer]
        writers = self._writers_before(self.start_ms(interval - CARRY_INTERVALS))
        writers = writers or self._writers_before(self.start_ms(interval + 1))
        return bool(writers) and writers[interval % len(writers)] == self._writer

    def _writers_before(self, end_ms: int) -> list[str]:
        """The writers with a segment stamped in the lookback before ``end_ms``, sorted."""
        start_ms = end_ms - self._lookback_ms
        return sorted(
            writer
            for writer, stamps in self._writers.items()
            if (at := bisect.bisect_left(stamps, end_ms)) > 0 and stamps[at - 1] >= start_ms
        )

    # -- reading ----------------------------------------------------------------------------

    def to_read(self, target: int) -> list[int] | None:
        """The intervals whose digests to read now, up to ``target``; None when this node is
        too far behind (or new): it reads the journal instead."""
        if self.next is None or target - self.next >= MAX_CATCH_UP:
            return None
        return list(range(self.next, target + 1))

    def skip_to(self, interval: int) -> None:
        """The journal was read: the next digest read is ``interval``'s."""
        self.next = interval if self.next is None else max(self.next, interval)

    def sweep_due(self, wall_ms: int) -> bool:
        """Whether to list the journal for segments no digest brought (every lookback / 2)."""
        if self._swept_ms is None:
            self._swept_ms = wall_ms
        if wall_ms - self._swept_ms < self._lookback_ms // 2:
            return False
        self._swept_ms = wall_ms
        return True

    async def fetch(self, interval: int) -> Digest | None:
        """The digest of ``interval``, or None when it is missing or rejected (counted)."""
        name = digest_name(self._prefix, self.interval_ms, interval)
        self.requests["get"] += 1
        get = functools.partial(get_bytes, self._client(), self._bucket, name, 0, MAX_DIGEST_BYTES)
        data = await self._call("digest", None, get, expected=_GET_ANSWERS)
        self.missing_last = isinstance(data, Fault)
        if isinstance(data, Fault):
            self.missing += 1
            return None
        decode = functools.partial(
            decode_digest,
            data,
            self._prefix,
            interval,
            self.interval_ms,
            integrity_key=self._integrity_key,
        )
        try:
            if len(data) > _THREAD_BYTES:
                digest = await anyio.to_thread.run_sync(decode)
            else:
                digest = decode()
        except DigestError as exc:
            self.rejected += 1
            self._log.warning("digest", "%s: ignoring digest %s: %s", self.name, name, exc)
            return None
        self._reader.bytes_read += len(data)
        self.read += 1
        return digest

    def done(self, digest: Digest) -> None:
        """``digest`` was applied: its segments are covered, its writers alive."""
        for name, _ in digest.segments:
            self._covered[name] = segment_time_ms(name) or 0
            self.note(name)
        self.skip_to(digest.interval + 1)
        self._made = max(self._made, digest.interval)
        oldest = self.start_ms(digest.interval - CARRY_INTERVALS - 1)
        for name in [n for n, stamp in self._covered.items() if stamp < oldest]:
            del self._covered[name]
        for name in [n for n in self._own if n in self._covered or n < self._first(oldest)]:
            del self._own[name]

    async def delete_own(
        self, client: Any, own: collections.deque[tuple[int, str]], before_ms: int
    ) -> None:
        """Delete this node's segments stamped before ``before_ms`` with one DeleteObjects
        once ``DELETE_BATCH`` of them are due (or the oldest is a lookback later still), so
        a writer's deletes cost a fraction of its PUTs. Names the store could not delete
        stay in ``own`` for the next try."""
        due = [name for stamp, name in itertools.islice(own, 1000) if stamp < before_ms]
        if not due or (len(due) < DELETE_BATCH and own[0][0] >= before_ms - self._lookback_ms):
            return
        self.requests["delete"] += 1
        objects = [{"Key": name} for name in due]
        request = functools.partial(
            client.delete_objects,
            Bucket=self._bucket,
            Delete={"Objects": objects, "Quiet": True},
        )
        try:
            answer = await self._call("journal", None, request)
        except TierError as exc:  # kept: readers ignore old segments, the next round retries
            self._log.warning(
                "journal-delete", "%s: could not delete old segments (%s)", self.name, exc.reason
            )
            return
        assert not isinstance(answer, Fault)
        failed = {e.get("Key") for e in answer.get("Errors", ()) if isinstance(e, dict)}
        kept = [item for item in (own.popleft() for _ in due) if item[1] in failed]
        own.extendleft(reversed(kept))

    def _first(self, wall_ms: int) -> str:
        """The first segment name stamped at ``wall_ms`` (names sort by stamp)."""
        return segment_name(self._prefix, wall_ms, "0" * 16, 0)

    # -- writing ----------------------------------------------------------------------------

    async def make_due(self, wall_ms: int) -> list[Digest]:
        """Digest the intervals that ended lately whose turn is this node's and that it has
        not tried (the last one, and the one before when this node's loop ran late); the
        digests it published."""
        current = self.interval_of(wall_ms)
        made = []
        for interval in range(max(self._made + 1, current - 2), current):
            digest = await self.make(interval, wall_ms)
            if digest is not None:
                made.append(digest)
        return made

    async def make(self, interval: int, wall_ms: int) -> Digest | None:
        """Digest ``interval`` if it is this node's turn and nobody did; the digest this node
        published, or None. Raises only ``TierError``."""
        if interval <= self._made or not self.designated(interval, wall_ms):
            return None  # tried, or read, already; or not this node's turn
        self._made = interval
        client = self._client()
        segments = await self._gather(client, interval)
        digest = Digest(interval, self.interval_ms, self._writer, segments)
        encode = functools.partial(
            encode_digest, digest, self._prefix, integrity_key=self._integrity_key
        )
        body = await anyio.to_thread.run_sync(encode) if len(segments) > 64 else encode()
        name = digest_name(self._prefix, self.interval_ms, interval)
        if not await self._put_new(client, name, body):
            self.lost += 1
            return None
        self.published += 1
        self._covered.update((name, segment_time_ms(name) or 0) for name, _ in segments)
        old = digest_name(self._prefix, self.interval_ms, interval - self._keep)
        self.requests["delete"] += 1
        try:
            await delete_object(self._call, client, self._bucket, old, "digest")
        except TierError as exc:  # left behind: costs storage, never a wrong answer
            self._log.warning("digest-delete", "%s: could not delete %s (%s)", self.name, old, exc)
        return digest

    async def _gather(self, client: Any, interval: int) -> list[tuple[str, bytes]]:
        """The segments of ``interval`` (and those carried) that no digest holds, checked."""
        reader = self._reader
        start = self.start_ms(interval - CARRY_INTERVALS)
        sizes = await reader.list_since(client, start)
        end = self.start_ms(interval + 1)
        names = []
        for name, size in sorted(sizes.items()):
            stamp = segment_time_ms(name)
            if stamp is None or not reader.in_journal(name) or name in self._covered:
                continue
            self.note(name)
            fits = isinstance(size, int) and 0 < size <= reader.max_segment
            if start <= stamp < end and fits:  # the window a reader accepts (``_digest_format``)
                names.append(name)
        fetched: dict[str, bytes] = {}

        async def fetch(name: str, limiter: anyio.CapacityLimiter) -> None:
            async with limiter:
                data = self._own.get(name) or await reader.fetch(client, name)
                if data is not None and await reader.valid(name, data):
                    fetched[name] = data

        limiter = anyio.CapacityLimiter(_PARALLEL_GETS)
        async with anyio.create_task_group() as tg:
            for name in names[:MAX_DIGEST_SEGMENTS]:
                tg.start_soon(fetch, name, limiter)
        segments: list[tuple[str, bytes]] = []
        total = 0
        for name in sorted(fetched):
            total += len(fetched[name]) + 300
            if total > MAX_DIGEST_BYTES - 4096:
                break  # the rest waits for the next digest
            segments.append((name, fetched[name]))
        return segments

    async def _put_new(self, client: Any, name: str, body: bytes) -> bool:
        """Publish a digest unless another node did (two digests of one interval, on a
        server without the condition, are both correct)."""
        return await put_if_absent(
            self._call, client, self._bucket, name, body, "digest", self.requests
        )
