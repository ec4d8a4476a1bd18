"""The primary pool in host memory: the default without a GPU, and the one tests use."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import anyio

from kvtier.common._arguments import positive_int
from kvtier.common._buffers import LOOP_COPY_BYTES, BlockBuffer
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._lending import Lender, Release
from kvtier.common._threads import run_sync
from kvtier.pools._base import BatchSink, BatchSource, ByteSink, ByteSource, PrimaryPool
from kvtier.pools._policy import EvictionPolicy
from kvtier.pools._slots import SlotTable

if TYPE_CHECKING:
    from kvtier.pools._cupy import CudaRuntime
    from kvtier.pools._host_gpu import GpuCopies

__all__ = ["HostPool", "check_host_memory", "host_memory_bytes"]

logger = logging.getLogger(__name__)

_Pairs = list[tuple[memoryview, memoryview]]


def host_memory_bytes() -> tuple[int, str] | None:
    """The machine's physical memory, and what that figure is; None where it cannot be read.
    Physical, not available, memory: the page cache counts as used yet gives way to a pool,
    so refusing above what is free today would refuse pools that fit. ``sysconf`` opens no
    file, so the check may run on the event loop."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
    return (pages * page, "physical memory") if pages > 0 and page > 0 else None


def check_host_memory(nbytes: int, limit: tuple[int, str] | None = None) -> None:
    """Refuse a pool larger than the memory the machine has, before anything is allocated:
    the mapping would otherwise fail with a bare ``ENOMEM``, or, prefaulted, bring in the OOM
    killer, which ends the process without a word. ``limit`` stands in for the machine's
    figure (tests)."""
    have = host_memory_bytes() if limit is None else limit
    if have is None or nbytes <= have[0]:
        return
    size, what = have
    raise InvalidArgumentError(
        f"a host pool of {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB: num_blocks x block_bytes) "
        f"does not fit in this machine's {what} of {size:,} bytes ({size / 2**30:.1f} GiB): "
        "lower num_blocks or block_bytes"
    )


class HostPool(PrimaryPool):
    """Slots in one page-aligned anonymous mapping (mmap), so tiers can DMA or O_DIRECT into
    them and promotions from a tier land in the slot without a staging copy.

    With ``prefault`` (the default) the constructor touches every page once, which takes
    about a second per few GiB: build large pools before the serving loop starts, or in a
    worker thread (``await anyio.to_thread.run_sync(HostPool, n, size)``).

    Engine buffers on a GPU are copied through ``runtime`` (the CUDA runtime calls, CuPy's
    when None, imported only when the first GPU buffer arrives): in batches on the engine's
    stream, from the mapping page-locked once for it (``kvtier.pools._host_gpu``). A pool
    that only ever sees host buffers makes no CUDA call."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        policy: str | EvictionPolicy = "lru",
        prefault: bool = True,
        runtime: CudaRuntime | None = None,
    ) -> None:
        check_host_memory(
            positive_int(num_blocks, "num_blocks") * positive_int(block_bytes, "block_bytes")
        )
        super().__init__(num_blocks, block_bytes, policy=policy)
        # MAP_POPULATE faults every page in now, once, so the first write into a slot (often a
        # promotion on the request path) does not pay for page faults.
        populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
        self._map = mmap.mmap(
            -1,
            self.num_blocks * self.block_bytes,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate,
        )
        self._view = memoryview(self._map)
        self._runtime = runtime
        self._gpu: GpuCopies | None = None

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.block_bytes
        return self._view[start : start + self.block_bytes]

    def copy_slot(self, slot: int) -> bytes:
        return bytes(self.slot_view(slot))  # one memcpy

    async def fill(self, slot: int, sink: ByteSink) -> None:
        await sink(self.slot_view(slot))

    async def fill_many(self, slots: Sequence[int], sink: BatchSink) -> Sequence[Exception | None]:
        """The slots themselves, in one call: a tier either writes each through a buffer of
        its own, so a deadline never leaves a write into a slot behind, or is lent the slots
        (``lender``) and keeps any it still writes into."""
        return await sink([self.slot_view(slot) for slot in slots])

    def lender(self, slots: Sequence[int]) -> Lender:
        """The WRITING ``slots`` lent to a tier's reads: the views ``fill_many`` hands out
        are the slots themselves, so a read that outlives its caller keeps its slot."""
        return _SlotLoan(self.table, slots, asyncio.get_running_loop())

    async def drain(self, slot: int, source: ByteSource) -> None:
        await source(self.slot_view(slot).toreadonly())

    async def drain_many(
        self, slots: Sequence[int], source: BatchSource
    ) -> Sequence[Exception | None]:
        """The slots themselves, read-only, in one call."""
        await source(range(len(slots)), [self.slot_view(slot).toreadonly() for slot in slots])
        return [None] * len(slots)

    async def copy_in(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> None:
        pairs = [(self.slot_view(s), b.host) for s, b in zip(slots, blocks, strict=True)]
        if any(host is None for _, host in pairs):
            await self._gpu_copies().copy(slots, blocks, to_pool=True)
            return
        await _copy_all(cast(_Pairs, pairs), len(pairs) * self.block_bytes)

    def copy_in_now(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> bool:
        """A small copy from host memory is done here, on the loop (cheaper than a thread
        hop); anything else is left to ``copy_in``."""
        if len(slots) * self.block_bytes > LOOP_COPY_BYTES:
            return False
        hosts = [block.host for block in blocks]
        if not all(host is not None for host in hosts):
            return False
        size = self.block_bytes
        view = self._view
        for slot, host in zip(slots, hosts, strict=True):
            assert host is not None
            view[slot * size : (slot + 1) * size] = host
        return True

    async def copy_out(self, slots: Sequence[int], out: Sequence[BlockBuffer]) -> None:
        pairs = [(b.host, self.slot_view(s)) for s, b in zip(slots, out, strict=True)]
        if any(host is None for host, _ in pairs):
            await self._gpu_copies().copy(slots, out, to_pool=False)
            return
        await _copy_all(cast(_Pairs, pairs), len(pairs) * self.block_bytes)

    def _gpu_copies(self) -> GpuCopies:
        """The copies of engine buffers on a GPU, made when the first one arrives."""
        if self._gpu is None:
            from kvtier.pools._host_gpu import GpuCopies

            self._gpu = GpuCopies(self._runtime, self._view, self.block_bytes)
        return self._gpu

    async def aclose(self) -> None:
        """Unregister the mapping from CUDA and destroy the events, if GPU buffers were ever
        copied (the slots stay usable; a later GPU copy registers again). Kept while a copy
        is in flight: its DMA may still touch the mapping."""
        gpu = self._gpu
        if gpu is None:
            return
        if gpu.in_flight:
            logger.warning("HostPool closed with GPU copies in flight; its mapping stays pinned")
            return
        self._gpu = None
        with anyio.CancelScope(shield=True):
            await run_sync(gpu.close)


def _copy_pairs(pairs: _Pairs) -> None:
    for dst, src in pairs:
        dst[:] = src  # both flat byte views of one block: one memcpy


async def _copy_all(pairs: _Pairs, nbytes: int) -> None:
    if nbytes <= LOOP_COPY_BYTES:
        _copy_pairs(pairs)
    else:  # big copies run off the event loop
        await run_sync(_copy_pairs, pairs)


class _SlotLoan:
    """``HostPool.lender``: a kept slot is lent in the table; giving it back runs on the loop."""

    __slots__ = ("_loop", "_slots", "_table")

    def __init__(
        self, table: SlotTable, slots: Sequence[int], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._table, self._slots, self._loop = table, slots, loop

    def keep(self, index: int) -> Release:
        slot, table, loop = self._slots[index], self._table, self._loop
        table.lend(slot)
        once = threading.Lock()

        def release() -> None:
            if not once.acquire(blocking=False):
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed: so has the pool
                loop.call_soon_threadsafe(table.give_back, slot)

        return release
