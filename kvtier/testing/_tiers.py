"""Tiers that misbehave on demand, for testing everything above the tiers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypedDict, Unpack

import anyio

from kvtier.common._errors import TierError, TierUnavailableError
from kvtier.common._lookup import LookupResult, MissReason
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import BatchResults, SecondaryTier, TierStatistics
from kvtier.tiers._memory import MemoryTier

__all__ = ["FailingTier", "SlowTier", "StallingTier"]

OPERATIONS = ("contains", "load", "store", "delete")


def _check_ops(operations: Iterable[str]) -> tuple[str, ...]:
    ops = tuple(operations) or OPERATIONS
    for op in ops:
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; use some of {OPERATIONS}")
    return ops


class _Bounds(TypedDict, total=False):
    """The lookup helper's bounds a testing tier passes on (``AsyncLookupManager``'s)."""

    max_pending: int
    max_entries: int


class _WrappingTier(SecondaryTier):
    """Delegates to ``inner`` (a MemoryTier by default) and answers lookups asynchronously,
    through an AsyncLookupManager, like a real remote tier."""

    def __init__(
        self,
        inner: SecondaryTier | None,
        name: str,
        lookup_timeout: float,
        **bounds: Unpack[_Bounds],
    ) -> None:
        super().__init__(name)
        self.inner = inner if inner is not None else MemoryTier(f"{name}.inner")
        self._lookups = AsyncLookupManager(
            self.contains_many,
            name=name,
            timeout=lookup_timeout,
            on_verdict=self.notify,
            **bounds,
        )

    async def _before(self, operation: str) -> None:
        """Hook where subclasses stall or fail."""

    async def open(self) -> None:
        await self.inner.open()
        if not self._lookups.is_open:
            await self._lookups.__aenter__()

    async def aclose(self) -> None:
        await self._lookups.aclose()
        await self.inner.aclose()

    def lookup(self, key: bytes) -> LookupResult:
        return self._lookups.lookup(key)

    def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, MissReason | None]:
        return self._lookups.lookup_with_reason(key)

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        await self._before("contains")
        return await self.inner.contains_many(keys)

    async def load(self, key: bytes, dst: memoryview) -> None:
        await self._before("load")
        await self.inner.load(key, dst)

    async def store(self, key: bytes, src: memoryview) -> None:
        await self._before("store")
        await self.inner.store(key, src)
        self.record_hit(key)

    async def delete(self, key: bytes) -> None:
        await self._before("delete")
        await self.inner.delete(key)
        self._lookups.forget(key)

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self._lookups.record(key, False, reason)

    def record_hit(self, key: bytes) -> None:
        self._lookups.record(key, True)

    def statistics(self) -> TierStatistics:
        inner = self.inner.statistics()
        return TierStatistics(
            name=self.name,
            lookups=self._lookups.statistics(),
            loads=inner.loads,
            stores=inner.stores,
            deletes=inner.deletes,
            bytes_read=inner.bytes_read,
            bytes_written=inner.bytes_written,
            read_seconds=inner.read_seconds,
            write_seconds=inner.write_seconds,
            failures_by_reason=inner.failures_by_reason,
            evictions=inner.evictions,
            blocks=inner.blocks,
            bytes_stored=inner.bytes_stored,
        )


class StallingTier(_WrappingTier):
    """Operations block while stalled, until released: puts a test "in the middle" of one.

    ``stall("load")`` makes every following load wait; ``await wait_stalled("load")`` returns
    once one is waiting; ``release("load")`` lets them all go.
    """

    def __init__(
        self,
        inner: SecondaryTier | None = None,
        *,
        name: str = "stalling",
        lookup_timeout: float = 5.0,
    ) -> None:
        super().__init__(inner, name, lookup_timeout)
        self._gates: dict[str, anyio.Event] = {}
        self._entered: dict[str, anyio.Event] = {op: anyio.Event() for op in OPERATIONS}
        self.stalled: dict[str, int] = dict.fromkeys(OPERATIONS, 0)

    @property
    def stalled_operations(self) -> frozenset[str]:
        """The operations that are held right now."""
        return frozenset(self._gates)

    def stall(self, *operations: str) -> None:
        for op in _check_ops(operations):
            self._gates.setdefault(op, anyio.Event())

    def release(self, *operations: str) -> None:
        for op in _check_ops(operations):
            gate = self._gates.pop(op, None)
            if gate is not None:
                gate.set()

    async def wait_stalled(self, operation: str) -> None:
        """Return once a call of ``operation`` is blocked in the stall."""
        _check_ops([operation])
        await self._entered[operation].wait()

    async def _before(self, operation: str) -> None:
        gate = self._gates.get(operation)
        if gate is None:
            return
        self.stalled[operation] += 1
        self._entered[operation].set()
        try:
            await gate.wait()
        finally:
            self.stalled[operation] -= 1
            if not self.stalled[operation]:
                self._entered[operation] = anyio.Event()


class FailingTier(_WrappingTier):
    """Operations raise while failing, until recovered: a tier that went down."""

    def __init__(
        self,
        inner: SecondaryTier | None = None,
        *,
        name: str = "failing",
        lookup_timeout: float = 5.0,
    ) -> None:
        super().__init__(inner, name, lookup_timeout)
        self._failing: dict[str, type[TierError]] = {}
        self.failures: dict[str, int] = dict.fromkeys(OPERATIONS, 0)

    def fail(self, *operations: str, error: type[TierError] = TierUnavailableError) -> None:
        for op in _check_ops(operations):
            self._failing[op] = error

    def recover(self, *operations: str) -> None:
        for op in _check_ops(operations):
            self._failing.pop(op, None)

    async def _before(self, operation: str) -> None:
        await anyio.lowlevel.checkpoint()
        error = self._failing.get(operation)
        if error is not None:
            self.failures[operation] += 1
            raise error("injected failure", tier=self.name, operation=operation)


class SlowTier(_WrappingTier):
    """Every operation takes ``delay`` seconds: a remote tier under load, for load tests."""

    def __init__(
        self,
        inner: SecondaryTier | None = None,
        *,
        delay: float = 0.01,
        name: str = "slow",
        lookup_timeout: float = 5.0,
        max_pending: int = 100_000,
        max_entries: int = 100_000,
    ) -> None:
        self._delay = delay
        super().__init__(
            inner, name, lookup_timeout, max_pending=max_pending, max_entries=max_entries
        )

    @property
    def lookups(self) -> AsyncLookupManager:
        return self._lookups

    async def _before(self, operation: str) -> None:
        await anyio.sleep(self._delay)

    # A batch costs one delay, as one round trip of a remote tier with a batch API does (the
    # S3 tier's packs, the FS tier's runs), not one per block.

    async def _load_batch(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        await self._before("load")
        return await self.inner.load_many(keys, dsts, timeout=_left(deadline), pinned=pinned)

    async def _store_batch(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        await self._before("store")
        return await self.inner.store_many(keys, srcs, timeout=_left(deadline), pinned=pinned)


def _left(deadline: float) -> float | None:
    """What is left of a batch's deadline, as ``load_many``'s ``timeout``."""
    if deadline == math.inf:
        return None
    return max(deadline - anyio.current_time(), 1e-6)
