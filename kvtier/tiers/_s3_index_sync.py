"""Keeping the S3 tier's existence index current: the listing at open and the journal loop.

The I/O around ``ExistenceIndex`` (a synchronous state machine): list the prefix once when the
tier opens (bounded by ``list_timeout``, progress in the log every few seconds), then every
``refresh`` seconds publish this node's new keys as one journal segment and read the segments
other nodes published (``_s3_journal`` documents the names, the format and the cost).

Staleness bound: a block another node stores becomes a HIT here at most about
``2 x refresh`` seconds later (it waits up to ``refresh`` in the writer's buffer, then up to
``refresh`` for this node's next poll), plus the two requests' latency. Faults are logged once
per burst and retried at the next refresh: the index only ever lags, it is never wrong in the
direction that matters (a stale HIT costs one GET and corrects itself).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio

from kvtier._errors import TierError
from kvtier._logging import BurstLogger
from kvtier.tiers._s3_errors import Fault
from kvtier.tiers._s3_index import ExistenceIndex, key_from_object
from kvtier.tiers._s3_journal import (
    SegmentError,
    decode_segment,
    encode_segment,
    journal_prefix,
    segment_name,
    segment_time_ms,
    segment_writer,
    start_after,
)
from kvtier.tiers._s3_pack import (
    TABLE_PROBE_BYTES,
    Location,
    PackTableError,
    decode_table,
    is_pack_name,
    table_size,
)

__all__ = ["IndexSync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PROGRESS_EVERY = 5.0  # seconds between progress lines of a long listing
_TABLE_READS = 16  # pack tables read at once at open


class Call(Protocol):
    async def __call__(
        self,
        operation: str,
        key: bytes | None,
        attempt: Callable[[], Awaitable[T]],
        *,
        expected: frozenset[Fault] = ...,
    ) -> T | Fault: ...


class _Progress:
    """When a long listing should log its progress again: every ``_PROGRESS_EVERY`` s."""

    def __init__(self) -> None:
        self._started = self._reported = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def due(self) -> float | None:
        """Seconds since the start if a progress line is due now, else None."""
        now = time.monotonic()
        if now - self._reported < _PROGRESS_EVERY:
            return None
        self._reported = now
        return now - self._started


class IndexSync:
    """Fills and refreshes an ``ExistenceIndex`` from the bucket (owned by an ``S3Tier``)."""

    def __init__(
        self,
        index: ExistenceIndex,
        *,
        name: str,
        bucket: str,
        prefix: str,
        writer: str,
        call: Call,
        client: Callable[[], Any],
        notify: Callable[[list[bytes]], None],
        refresh: float,
        lookback: float,
        list_timeout: float,
        read_journal: bool = True,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._index = index
        self.name = name
        self._bucket = bucket
        self._prefix = prefix
        self._writer = writer
        self._call = call
        self._client = client
        self._notify = notify
        self.refresh = refresh
        self._lookback_ms = int(lookback * 1000)
        self._list_timeout = list_timeout
        self._wall = wall
        self._read_journal = read_journal
        self._seq = 0
        self._own: list[tuple[int, str]] = []  # (wall ms, name) of segments published here
        self._log = BurstLogger(logger)
        self.refreshes = 0
        self.segments_published = 0
        self.segments_read = 0
        self.listing_complete = False

    # -- the listing at open -------------------------------------------------------------------

    async def list_at_open(self) -> None:
        """Index every block object under the prefix, within ``list_timeout`` seconds."""
        progress = _Progress()
        client = self._client()
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "MaxKeys": 1000}
        if self._prefix:
            kwargs["Prefix"] = self._prefix + "/"
        journal = journal_prefix(self._prefix)
        pages = found = 0
        packs: list[str] = []
        with anyio.move_on_after(self._list_timeout) as scope:
            while True:
                page = await self._call(
                    "list", None, functools.partial(client.list_objects_v2, **kwargs)
                )
                assert not isinstance(page, Fault)
                pages += 1
                for item in page.get("Contents", ()):
                    name = item["Key"]
                    if name.startswith(journal):
                        continue
                    if is_pack_name(name, self._prefix):
                        packs.append(name)
                        continue
                    key = key_from_object(name, self._prefix)
                    if key is not None and self._index.add(key):
                        found += 1
                if (elapsed := progress.due()) is not None:
                    logger.info(
                        "%s: indexing s3://%s/%s: %d blocks after %.0f s (%d pages)",
                        self.name,
                        self._bucket,
                        self._prefix,
                        found,
                        elapsed,
                        pages,
                    )
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break
                kwargs["ContinuationToken"] = token
            found += await self._read_tables(client, packs, progress)
        self._index.listed = found
        self.listing_complete = not scope.cancelled_caught
        if scope.cancelled_caught:
            logger.warning(
                "%s: listing s3://%s/%s stopped after %.0f s (index_list_timeout) with %d "
                "blocks indexed; blocks not listed answer MISS until written again",
                self.name,
                self._bucket,
                self._prefix,
                self._list_timeout,
                found,
            )
        else:
            logger.info(
                "%s: indexed %d blocks of s3://%s/%s in %.2f s (%d pages)",
                self.name,
                found,
                self._bucket,
                self._prefix,
                progress.elapsed(),
                pages,
            )

    async def _read_tables(self, client: Any, packs: list[str], progress: _Progress) -> int:
        """Index the keys of the listed ``packs`` from their tables: one small ranged GET
        each (two for a table past ``TABLE_PROBE_BYTES``), ``_TABLE_READS`` at a time."""
        found = 0
        done = 0
        pending = iter(packs)

        async def reader() -> None:
            nonlocal found, done
            for name in pending:
                entries = await self._read_table(client, name)
                found += len(self._index.add_many(entries))
                done += 1
                if (elapsed := progress.due()) is not None:
                    logger.info(
                        "%s: indexing s3://%s/%s: read %d of %d pack tables after %.0f s",
                        self.name,
                        self._bucket,
                        self._prefix,
                        done,
                        len(packs),
                        elapsed,
                    )

        async with anyio.create_task_group() as tg:
            for _ in range(min(_TABLE_READS, len(packs))):
                tg.start_soon(reader)
        return found

    async def _read_table(self, client: Any, name: str) -> list[tuple[bytes, Location | None]]:
        async def get(lo: int, hi: int) -> bytes:
            response = await client.get_object(
                Bucket=self._bucket, Key=name, Range=f"bytes={lo}-{hi - 1}"
            )
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        expected = frozenset({Fault.NOT_FOUND})
        try:
            data = await self._call(
                "list", None, lambda: get(0, TABLE_PROBE_BYTES), expected=expected
            )
            if isinstance(data, Fault):
                return []  # deleted since the listing
            size = table_size(data)
            if size > len(data):
                more = await self._call(
                    "list", None, lambda: get(len(data), size), expected=expected
                )
                if isinstance(more, Fault):
                    return []
                data += more
            return list(decode_table(data, name))
        except PackTableError as exc:
            self._log.warning("pack", "%s: ignoring pack %s: %s", self.name, name, exc)
        except TierError as exc:  # its keys miss until a journal or a store names them
            self._log.warning(
                "pack-table", "%s: could not read pack %s (%s)", self.name, name, exc.reason
            )
        return []

    # -- the journal loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Publish and poll every ``refresh`` seconds until cancelled."""
        while True:
            await anyio.sleep(self.refresh)
            await self.refresh_once()

    async def refresh_once(self, *, poll: bool = True) -> None:
        """One round: publish this node's new keys, read the others' (unless ``poll`` is
        False or this tier does not read the journal). Never raises a tier fault (logged once
        per burst; the next round tries again)."""
        try:
            await self.publish()
            if poll and self._read_journal:
                await self.poll()
        except TierError as exc:
            self._log.warning(
                "refresh", "%s: index refresh failed (%s); retrying", self.name, exc.reason
            )
        self.refreshes += 1

    async def publish(self) -> None:
        entries = self._index.take_unpublished()
        if not entries:
            return
        client = self._client()
        now_ms = int(self._wall() * 1000)
        self._seq += 1
        name = segment_name(self._prefix, now_ms, self._writer, self._seq)
        body = encode_segment(entries)
        try:
            await self._call(
                "journal",
                None,
                lambda: client.put_object(Bucket=self._bucket, Key=name, Body=body),
            )
        except BaseException:
            self._index.requeue(entries)
            raise
        self.segments_published += 1
        self._own.append((now_ms, name))
        await self._delete_old_own(now_ms - 2 * self._lookback_ms)

    async def _delete_old_own(self, before_ms: int) -> None:
        client = self._client()
        while self._own and self._own[0][0] < before_ms:
            _, name = self._own.pop(0)
            await self._call(
                "journal",
                None,
                functools.partial(client.delete_object, Bucket=self._bucket, Key=name),
                expected=frozenset({Fault.NOT_FOUND}),
            )

    async def poll(self) -> list[bytes]:
        """Read the segments other writers published within the lookback; the new keys."""
        client = self._client()
        now_ms = int(self._wall() * 1000)
        oldest = now_ms - self._lookback_ms
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Prefix": journal_prefix(self._prefix),
            "StartAfter": start_after(self._prefix, oldest),
        }
        names: list[str] = []
        while True:
            page = await self._call(
                "journal", None, functools.partial(client.list_objects_v2, **kwargs)
            )
            assert not isinstance(page, Fault)
            names.extend(item["Key"] for item in page.get("Contents", ()))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
            kwargs["ContinuationToken"] = token
        learnt: list[bytes] = []
        for name in self._index.unseen(names):
            stamp = segment_time_ms(name)
            if stamp is None or segment_writer(name) == self._writer:
                self._index.seen(name, stamp or now_ms)
                continue
            learnt.extend(await self._read_segment(client, name))
            self._index.seen(name, stamp)
        self._index.forget_seen_before(oldest)
        if learnt:
            self._index.learnt += len(learnt)
            self._notify(learnt)
        return learnt

    async def _read_segment(self, client: Any, name: str) -> list[bytes]:
        async def get() -> bytes:
            response = await client.get_object(Bucket=self._bucket, Key=name)
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        data = await self._call("journal", None, get, expected=frozenset({Fault.NOT_FOUND}))
        if isinstance(data, Fault):
            return []  # deleted by its writer meanwhile: older than the lookback anyway
        self.segments_read += 1
        try:
            entries = decode_segment(data)
        except SegmentError as exc:
            self._log.warning(
                "segment", "%s: ignoring journal segment %s: %s", self.name, name, exc
            )
            return []
        return self._index.add_many(entries)
