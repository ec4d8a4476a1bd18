"""What every primary pool offers: the slot table's synchronous API plus async copies.

Pools differ only in where the bytes live and how they move (memcpy on the host, CUDA streams
on a GPU); the bookkeeping is one ``SlotTable`` either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence

import anyio

from kvtier.common._arguments import positive_int
from kvtier.common._buffers import BlockBuffer
from kvtier.common._describe import describe
from kvtier.common._lending import Lender
from kvtier.common._lookup import LookupResult
from kvtier.pools._policy import EvictionPolicy, make_policy
from kvtier.pools._slots import PoolStatistics, SlotState, SlotTable

__all__ = ["BatchSink", "BatchSource", "ByteSink", "ByteSource", "PrimaryPool"]

ByteSink = Callable[[memoryview], Awaitable[None]]
"""Fills the view it is given (a tier's ``load`` into a slot or a staging buffer)."""
ByteSource = Callable[[memoryview], Awaitable[None]]
"""Reads the view it is given (a tier's ``store`` from a slot or a staging buffer)."""
BatchSink = Callable[[Sequence[memoryview]], Awaitable[Sequence[Exception | None]]]
"""Fills the views it is given, each on its own: per view, None or why it failed (a tier's
``load_many`` into slots or staging buffers)."""
BatchSource = Callable[[Sequence[int], Sequence[memoryview]], Awaitable[None]]
"""Reads the views it is given, of the slots at the given positions of a batch (a
write-through's ``store_many`` from slots or staging buffers)."""


class PrimaryPool(ABC):
    """``num_blocks`` slots of ``block_bytes`` each in one allocation."""

    def __init__(
        self, num_blocks: int, block_bytes: int, *, policy: str | EvictionPolicy = "lru"
    ) -> None:
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.block_bytes = positive_int(block_bytes, "block_bytes")
        self.table = SlotTable(self.num_blocks, make_policy(policy, self.num_blocks))

    # -- synchronous bookkeeping (never waits) ----------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        return self.table.lookup(key)

    def ready_prefix(self, keys: Sequence[bytes]) -> int:
        return self.table.ready_prefix(keys)

    def state_of(self, key: bytes) -> SlotState:
        return self.table.state_of(key)

    def try_reserve(self, key: bytes) -> int | None:
        return self.table.try_reserve(key)

    def reserve_new(self, keys: Sequence[bytes]) -> tuple[list[int], list[int], int]:
        return self.table.reserve_new(keys)

    def commit(self, slot: int) -> None:
        self.table.commit(slot)

    def abort(self, slot: int) -> None:
        self.table.abort(slot)

    def pin(self, key: bytes) -> int | None:
        return self.table.pin(key)

    def unpin(self, slot: int) -> None:
        self.table.unpin(slot)

    def discard(self, key: bytes) -> bool:
        return self.table.discard(key)

    def copy_slot(self, slot: int) -> bytes | None:
        """The bytes of ``slot`` now, if the pool can copy them at once on the event loop
        (host memory); None if that would mean waiting (device memory)."""
        return None

    def statistics(self) -> PoolStatistics:
        return self.table.statistics(self.block_bytes)

    def __repr__(self) -> str:
        shown = "num_blocks block_bytes free writing ready pinned policy evictions"
        return describe(type(self).__name__, stats=self.statistics(), shown=shown)

    # -- data movement (may wait) ------------------------------------------------------------

    @abstractmethod
    async def fill(self, slot: int, sink: ByteSink) -> None:
        """Let ``sink`` write the bytes of a WRITING slot (a promotion from a tier)."""

    async def fill_many(self, slots: Sequence[int], sink: BatchSink) -> Sequence[Exception | None]:
        """Let ``sink`` write the bytes of several WRITING slots (a batch of promotions from
        one tier); per slot, None or why it failed. The default fills each slot through
        ``fill``, concurrently; a pool whose slots the tier can write directly hands it them
        all in one call."""
        outcomes: list[Exception | None] = [None] * len(slots)

        async def one(i: int, slot: int) -> None:
            async def single(view: memoryview) -> None:
                (outcome,) = await sink([view])
                if outcome is not None:
                    raise outcome

            try:
                await self.fill(slot, single)
            except Exception as exc:
                outcomes[i] = exc

        async with anyio.create_task_group() as tg:
            for i, slot in enumerate(slots):
                tg.start_soon(one, i, slot)
        return outcomes

    def lender(self, slots: Sequence[int]) -> Lender | None:
        """What lends ``slots`` to the tier that ``fill_many`` writes them (see
        ``kvtier.common._lending``), or None when the views it hands out are not the slots."""
        return None

    @abstractmethod
    async def drain(self, slot: int, source: ByteSource) -> None:
        """Hand the bytes of a pinned READY slot to ``source`` (a write-through to a tier)."""

    async def drain_many(
        self, slots: Sequence[int], source: BatchSource
    ) -> Sequence[Exception | None]:
        """Hand the bytes of several pinned READY slots to ``source`` (a batch of
        write-throughs); per slot, None or why its bytes could not be handed over. The
        default drains each slot through ``drain``, concurrently, each as a batch of one; a
        pool whose slots the tier can read directly hands it them all in one call."""
        outcomes: list[Exception | None] = [None] * len(slots)

        async def one(i: int, slot: int) -> None:
            async def single(view: memoryview) -> None:
                await source((i,), (view,))

            try:
                await self.drain(slot, single)
            except Exception as exc:
                outcomes[i] = exc

        if len(slots) == 1:
            await one(0, slots[0])
            return outcomes
        async with anyio.create_task_group() as tg:
            for i, slot in enumerate(slots):
                tg.start_soon(one, i, slot)
        return outcomes

    @abstractmethod
    async def copy_in(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> None:
        """Copy engine blocks into WRITING slots."""

    def copy_in_now(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> bool:
        """Copy engine blocks into WRITING slots at once, on the event loop, if the pool can
        without waiting (a small copy between host buffers); False: nothing was copied, use
        ``copy_in``. A store then needs no deadline for its copy."""
        return False

    @abstractmethod
    async def copy_out(self, slots: Sequence[int], out: Sequence[BlockBuffer]) -> None:
        """Copy pinned READY slots into engine buffers."""

    async def aclose(self) -> None:
        """Release the pool's memory; the default has nothing to release."""
