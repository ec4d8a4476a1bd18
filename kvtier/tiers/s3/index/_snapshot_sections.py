"""Fetching the chunk of a snapshot body that holds a key, while the body streams in.

While the tier loads its index from a snapshot in the background, a key the stream has not
reached yet is asked of the bucket (``S3Tier._check_unindexed``). A HEAD by the key's name
finds a block stored as its own object, never one inside a pack. With the body's directory
(``_snapshot_directory``) the key's chunk is known: ``SnapshotSections.bring`` fetches it
with one ranged GET, shared by every key that falls in it, decodes and checks it in a
worker thread, and indexes its entries as the stream would (``ExistenceIndex.load_many``,
so what this node learnt since the load began wins). So any key of the snapshot, packed or
not, early or late in the body, is found within one GET of a few hundred KiB.

A chunk the stream has indexed already, one fetched already or being fetched, is not
fetched again; one that fails (gone, does not verify, holds keys outside its range) is not
tried again: its keys wait for the stream, which checks the whole body. At most
``_AT_ONCE`` chunks are fetched at a time, so the chunks asked for cost at most one more
reading of the body, in parallel with the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from kvtier.common._errors import TierError
from kvtier.common._format import IntegrityKey
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3._requests import Call, acquire, get_bytes
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._snapshot_directory import Directory, check_chunk
from kvtier.tiers.s3.index._snapshot_format import SnapshotError, decode_chunk
from kvtier.tiers.s3.index._snapshot_stream import ADD_SLICE

__all__ = ["SnapshotSections"]

logger = logging.getLogger(__name__)

_AT_ONCE = 4  # chunks fetched at a time
_GET_ANSWERS = frozenset({Fault.NOT_FOUND, Fault.REJECTED})


class SnapshotSections:
    """The chunks of one body, by its directory, fetched on demand (see the module doc)."""

    def __init__(
        self,
        directory: Directory,
        *,
        body: str,
        index: ExistenceIndex,
        call: Call,
        client: Callable[[], Any],
        bucket: str,
        prefix: str,
        integrity_key: IntegrityKey | None,
        name: str,
    ) -> None:
        self._directory, self._body, self._index = directory, body, index
        self._call, self._client, self._bucket = call, client, bucket
        self._prefix, self._integrity_key, self._name = prefix, integrity_key, name
        self._settled: dict[int, anyio.Event] = {}  # chunks fetched, or being fetched
        self._failed: set[int] = set()  # chunks that could not be used
        self._limiter = anyio.CapacityLimiter(_AT_ONCE)
        self._log = BurstLogger(logger)
        self.streamed_to = 0  # body bytes the stream has indexed
        self.gets = 0  # ranged GETs sent
        self.chunks = 0  # chunks indexed through them

    def streamed(self, offset: int) -> None:
        """The stream has indexed every chunk before byte ``offset``."""
        self.streamed_to = max(self.streamed_to, offset)

    def _pending(self, chunk: int) -> bool:
        d = self._directory
        return d.offsets[chunk] + d.lengths[chunk] > self.streamed_to

    async def bring(self, keys: list[bytes]) -> set[bytes]:
        """Index the chunks that hold ``keys`` and that neither the stream nor an earlier
        call brought; returns once each is indexed or has failed: the keys whose chunk
        failed (the body's answer for them is not known yet)."""
        chunk_of, pending = self._directory.chunk_of, self._pending
        chunks = {key: chunk_of(key) for key in keys}
        wanted = sorted({i for i in chunks.values() if i >= 0 and pending(i)})
        mine = [i for i in wanted if i not in self._settled]
        waits = [self._settled[i] for i in wanted if i in self._settled]
        for i in mine:
            self._settled[i] = anyio.Event()
        async with anyio.create_task_group() as tg:
            for i in mine:
                tg.start_soon(self._fetch, i)
        for settled in waits:
            await settled.wait()
        failed = self._failed
        return {key for key, i in chunks.items() if i in failed and pending(i)}

    async def _fetch(self, chunk: int) -> None:
        """Fetch, check and index one chunk; a failure is logged once per burst and counted."""
        d = self._directory
        lo, hi = d.offsets[chunk], d.offsets[chunk] + d.lengths[chunk]
        try:
            await acquire(self._limiter)
            try:
                if not self._pending(chunk):
                    return  # the stream got there first
                self.gets += 1
                client, bucket, body = self._client(), self._bucket, self._body
                data = await self._call(
                    "snapshot",
                    None,
                    lambda: get_bytes(client, bucket, body, lo, hi),
                    expected=_GET_ANSWERS,
                )
                if isinstance(data, Fault):
                    raise SnapshotError(f"{body} is gone")
                entries = await anyio.to_thread.run_sync(
                    self._decode, data, chunk, abandon_on_cancel=True
                )
            finally:
                self._limiter.release()
            for start in range(0, len(entries), ADD_SLICE):  # the loop serves meanwhile
                self._index.load_many(entries[start : start + ADD_SLICE])
                await anyio.lowlevel.checkpoint()
            self.chunks += 1
        except (TierError, SnapshotError) as exc:
            self._failed.add(chunk)
            why = exc.reason if isinstance(exc, TierError) else str(exc)
            self._log.warning(
                "section",
                "%s: could not read a chunk of index snapshot %s (%s); its keys wait for the "
                "rest of the load",
                self._name,
                self._body,
                why,
            )
        finally:
            self._settled[chunk].set()

    def _decode(self, data: bytes, chunk: int) -> list[tuple[bytes, Location | None]]:
        """The entries of ``chunk``, checked (in a worker thread)."""
        entries, _ignored = decode_chunk(data, self._prefix, integrity_key=self._integrity_key)
        check_chunk(entries, self._directory, chunk)
        return entries
