"""Packing the S3 tier's stores and coalescing its loads (the I/O rules around ``_pack_format``).

``PackWriter`` is a group commit. Each ``store`` queues its block and then takes a PUT slot;
whoever gets a slot sends everything queued by then (up to ``pack_blocks``) as one request. A
store that arrives alone while slots are free goes out at once as a plain block object, so
packing never adds latency; stores that arrive together (one request's new blocks, stored in
one event-loop tick) or while every slot is busy (a burst) share a pack. No timer is involved:
the only wait is one pass through the event loop, which lets the stores started in the same
tick join the queue.

``PackReads`` coalesces loads: the loads of several blocks of one pack that start in the same
tick (the manager starts a request's promotions in one scan) share one ranged GET of the
span they need. The first load leads the fetch; if it is cancelled, one of the others takes
over, so a cancelled promotion never fails its neighbours. Locations come from the journal and
from pack tables, which are untrusted: a load joins a fetch only with a section of the same
length (the tier checks that length is a header and a block before any read) and only while
the span stays within the bytes of the sections it serves, so a GET never reads more than a
block's section per block it serves, however far apart the offsets claim the sections are.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from kvtier.common._errors import TierError
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3._requests import acquire

__all__ = ["PackReads", "PackWriter", "PendingStore"]


class _State(enum.Enum):
    QUEUED = "queued"
    TAKEN = "taken"  # in a PUT in flight
    DONE = "done"


@dataclass(eq=False)
class PendingStore:
    """One block waiting to be sent: its object body (header + payload) and the metadata and
    CRC32 a plain block object carries."""

    key: bytes
    body: bytes
    metadata: dict[str, str]
    crc: str
    state: _State = _State.QUEUED
    error: TierError | None = None
    abandoned: bool = False  # its store was cancelled while another store's PUT carried it
    changed: anyio.Event = field(default_factory=anyio.Event)

    def move(self, state: _State) -> None:
        self.state = state
        changed, self.changed = self.changed, anyio.Event()
        changed.set()


class PackWriter:
    """Group commit of stores: one PUT for whatever is queued when a slot frees up.

    ``put_single`` sends one block as a plain object and ``put_pack`` several as a pack; both
    record what they wrote (index, statistics) themselves, whether or not anyone still waits,
    and raise ``TierError`` on failure (every store of the request fails with it)."""

    def __init__(
        self,
        *,
        pack_blocks: int,
        limiter: anyio.CapacityLimiter,
        put_single: Callable[[PendingStore], Awaitable[None]],
        put_pack: Callable[[list[PendingStore]], Awaitable[None]],
    ) -> None:
        self._pack_blocks = pack_blocks
        self._limiter = limiter
        self._put_single = put_single
        self._put_pack = put_pack
        self._queue: collections.deque[PendingStore] = collections.deque()
        self.packs = 0  # PUTs of more than one block
        self.packed_blocks = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def store(self, item: PendingStore) -> None:
        self._queue.append(item)
        try:
            await anyio.lowlevel.checkpoint()  # the stores started in this tick queue up too
            while item.state is not _State.DONE:
                if item.state is _State.TAKEN:
                    await item.changed.wait()
                    continue
                await acquire(self._limiter)
                try:
                    if item.state is _State.QUEUED:
                        await self._flush(item)
                finally:
                    self._limiter.release()
        except BaseException:
            if item.state is _State.QUEUED:
                self._queue.remove(item)
            elif item.state is _State.TAKEN:
                item.abandoned = True  # not queued again if that PUT is cancelled
            raise
        if item.error is not None:
            raise item.error

    def counts(self) -> dict[str, int]:
        """What packing did, by the ``S3TierStatistics`` names."""
        return {"packs_written": self.packs, "blocks_packed": self.packed_blocks}

    async def _flush(self, mine: PendingStore) -> None:
        """Send the oldest queued stores (``mine`` among them, or ahead of it) in one PUT."""
        batch = [self._queue.popleft() for _ in range(min(self._pack_blocks, len(self._queue)))]
        for item in batch:
            item.state = _State.TAKEN
        error: TierError | None = None
        try:
            if len(batch) == 1:
                await self._put_single(batch[0])
            else:
                await self._put_pack(batch)
                self.packs += 1
                self.packed_blocks += len(batch)
        except TierError as exc:
            error = exc
        except BaseException:
            # Cancelled with the PUT in flight: the others still waiting go back to the front
            # of the queue, in order, and the first of them to wake sends them. (A store
            # whose own wait was cancelled is dropped: nobody would ever send it.)
            others = [item for item in batch if item is not mine and not item.abandoned]
            self._queue.extendleft(reversed(others))
            for item in batch:
                item.move(_State.QUEUED if item in others else _State.DONE)
            raise
        for item in batch:
            item.error = error
            item.move(_State.DONE)


@dataclass(eq=False)
class _Fetch:
    """One ranged GET of a pack, shared by the loads that joined it before it was sent."""

    lo: int
    hi: int
    length: int  # every section it serves has this length
    sections: int = 1
    data: bytes | None = None
    error: TierError | None = None
    abandoned: bool = False  # its leader was cancelled: the others start another
    done: anyio.Event = field(default_factory=anyio.Event)

    def want(self, where: Location) -> bool:
        """Join ``where`` to this fetch if the span stays within the sections it serves."""
        lo, hi = min(self.lo, where.offset), max(self.hi, where.offset + where.length)
        if where.length != self.length or hi - lo > (self.sections + 1) * self.length:
            return False
        self.lo, self.hi = lo, hi
        self.sections += 1
        return True

    def section(self, where: Location) -> memoryview | None:
        """The bytes of ``where`` (short if the pack was shorter), or None: no such pack."""
        if self.error is not None:
            raise self.error
        if self.data is None:
            return None
        start = where.offset - self.lo
        return memoryview(self.data)[start : start + where.length]


class PackReads:
    """Coalesced section reads: ``fetch(pack, lo, hi)`` returns bytes ``lo:hi`` of a pack, or
    None when the pack does not exist."""

    def __init__(self, fetch: Callable[[str, int, int], Awaitable[bytes | None]]) -> None:
        self._fetch = fetch
        self._open: dict[str, _Fetch] = {}
        self.gets = 0  # ranged GETs sent
        self.sections = 0  # sections they served
        self.bytes = 0  # bytes they fetched

    def counts(self) -> dict[str, int]:
        """What the section reads did, by the ``S3TierStatistics`` names."""
        return {
            "pack_gets": self.gets,
            "pack_sections_read": self.sections,
            "pack_bytes_read": self.bytes,
        }

    async def read(self, where: Location) -> memoryview | None:
        while True:
            fetch = self._open.get(where.pack)
            if fetch is None or not fetch.want(where):
                # The first load of this pack now, or one too far from the others: its own
                # GET (later loads join the newest fetch).
                fetch = _Fetch(where.offset, where.offset + where.length, where.length)
                self._open[where.pack] = fetch
                return await self._lead(where, fetch)
            await fetch.done.wait()
            if not fetch.abandoned:
                self.sections += 1
                return fetch.section(where)

    async def _lead(self, where: Location, fetch: _Fetch) -> memoryview | None:
        try:
            try:
                await anyio.lowlevel.checkpoint()  # the loads started in this tick join
            finally:
                if self._open.get(where.pack) is fetch:
                    del self._open[where.pack]  # sent: later loads start their own
            self.gets += 1
            try:
                fetch.data = await self._fetch(where.pack, fetch.lo, fetch.hi)
                self.bytes += len(fetch.data or b"")
            except TierError as exc:
                fetch.error = exc
        except BaseException:
            fetch.abandoned = True
            raise
        finally:
            fetch.done.set()
        self.sections += 1
        return fetch.section(where)
