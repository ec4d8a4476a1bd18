"""An in-memory secondary tier: the reference implementation of the tier contract."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.common._arguments import positive_int
from kvtier.common._errors import (
    BlockNotFoundError,
    InvalidArgumentError,
    TierError,
    TierNoSpaceError,
)
from kvtier.common._lookup import LookupResult, MissReason
from kvtier.tiers._base import (
    BatchResults,
    LookupStatistics,
    SecondaryTier,
    TierMeter,
    TierStatistics,
)

__all__ = ["MemoryTier"]


class MemoryTier(SecondaryTier):
    """Blocks in a dict. It needs no opening, so a test can fill it before a manager owns it.

    ``lookup`` answers at once (HIT or MISS): an in-memory check is as cheap as a dict lookup.
    Its every miss is ``not_found``, which is what the default ``lookup_with_reason`` says,
    so it keeps that default. With ``capacity_bytes`` the least recently used blocks are
    dropped to make room.
    """

    def __init__(self, name: str = "memory", *, capacity_bytes: int | None = None) -> None:
        super().__init__(name)
        if capacity_bytes is not None:
            positive_int(capacity_bytes, "capacity_bytes", " or None")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._meter = TierMeter()
        self._hits = 0
        self._misses = 0

    def lookup(self, key: bytes) -> LookupResult:
        if key in self._blocks:
            self._hits += 1
            return LookupResult.HIT
        self._misses += 1
        return LookupResult.MISS

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        await asyncio.sleep(0)
        return [key in self._blocks for key in keys]

    async def load(self, key: bytes, dst: memoryview) -> None:
        await asyncio.sleep(0)
        self._load(key, dst)

    def _load(self, key: bytes, dst: memoryview) -> None:
        started = time.perf_counter()
        data = self._blocks.get(key)
        if data is None:
            self._meter.failed(MissReason.NOT_FOUND)
            raise BlockNotFoundError("no such block", tier=self.name, operation="load", key=key)
        if dst.nbytes != len(data):
            raise InvalidArgumentError(
                f"dst holds {dst.nbytes} bytes but block {key.hex()} is {len(data)} bytes"
            )
        dst.cast("B")[:] = data
        self._blocks.move_to_end(key)
        self._meter.read(len(data), time.perf_counter() - started)

    async def store(self, key: bytes, src: memoryview) -> None:
        await asyncio.sleep(0)
        self._store(key, src)

    def _store(self, key: bytes, src: memoryview) -> None:
        started = time.perf_counter()
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        data = bytes(src)
        if self.capacity_bytes is not None:
            if len(data) > self.capacity_bytes:
                self._meter.failed(MissReason.NO_SPACE)
                raise TierNoSpaceError(
                    "block is larger than the tier", tier=self.name, operation="store", key=key
                )
            while self._bytes + len(data) > self.capacity_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self._bytes -= len(dropped)
                self._meter.evictions += 1
        self._blocks[key] = data
        self._bytes += len(data)
        self._meter.wrote(len(data), time.perf_counter() - started)

    # A batch is one checkpoint and a loop of dict operations, not a task per block (unless a
    # subclass changed what one block's ``load`` or ``store`` does).

    async def _load_batch(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        if type(self).load is not MemoryTier.load:
            return await super()._load_batch(keys, dsts, deadline, pinned)
        return await _each(self._load, keys, dsts)

    async def _store_batch(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        if type(self).store is not MemoryTier.store:
            return await super()._store_batch(keys, srcs, deadline, pinned)
        return await _each(self._store, keys, srcs)

    async def delete(self, key: bytes) -> None:
        await asyncio.sleep(0)
        data = self._blocks.pop(key, None)
        if data is not None:
            self._bytes -= len(data)
            self._meter.deletes += 1

    async def aclose(self) -> None:
        """Nothing to release: the blocks stay, so a re-opened manager still finds them."""

    def statistics(self) -> TierStatistics:
        lookups = LookupStatistics(
            hits=self._hits,
            misses=self._misses,
            misses_by_reason={"not_found": self._misses} if self._misses else {},
        )
        return self._meter.snapshot(
            self.name, lookups, blocks=len(self._blocks), bytes_stored=self._bytes
        )


async def _each(
    operation: Callable[[bytes, memoryview], None],
    keys: Sequence[bytes],
    views: Sequence[memoryview],
) -> BatchResults:
    """``operation`` on each block after one checkpoint; per block, None or the tier's error."""
    await asyncio.sleep(0)
    outcomes: BatchResults = []
    for key, view in zip(keys, views, strict=True):
        try:
            operation(key, view)
        except TierError as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
    return outcomes
