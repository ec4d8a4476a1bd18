"""The data movement of a CudaPool: every copy between its device slots and the outside.

A ``SlotCopies`` builds each copy on ``_cuda_core.CopyCore`` (the copy lanes, the pinned
staging pools, the fences left by abandoned copies, the count of operations in flight and the
transfer counters); the pool owns the allocation and the slot bookkeeping and hands slot
numbers here:

- promotion (``fill``): the tier writes into a pinned staging buffer, then one host-to-device
  copy on the upload stream;
- write-through (``drain``): device-to-host into a staging buffer on the download stream, then
  the tier reads the staging buffer;
- engine store/load (``copy``): device-to-device on the peer stream for GPU buffers (torch
  CUDA tensors, CuPy arrays), ordered after the engine's stream; host buffers that are
  already pinned (torch ``pin_memory()``, ``cudaHostAlloc``) one DMA each way on the upload
  or download stream; other host buffers through staging buffers of their own (so
  write-throughs parked on a slow tier never stall an engine load), pipelined in chunks.

The rules that keep a DMA from ever touching memory someone else owns:

- every enqueue re-checks that the pool is open (``_submit``), and ``aclose`` frees nothing
  while an operation is in flight (``operation``; it waits for them, bounded);
- once anything was enqueued, buffers go back only when the copy is known to have finished
  or never to run (``_settle``); enqueueing that fails partway still gets a completion;
- a copy that outlives ``settle_timeout`` is abandoned, not forgotten: later copies touching
  its slots, and for device-to-device copies the engine's streams, wait on its fence, and its
  staging buffers and engine arrays are kept until it lands.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from kvtier.common._buffers import BlockBuffer
from kvtier.common._errors import InvalidArgumentError
from kvtier.pools._base import BatchSink, ByteSink, ByteSource
from kvtier.pools._cuda_core import CopyCore
from kvtier.pools._cuda_stream import Completion, StagingBuffer, StagingPool
from kvtier.pools._device import (
    DeviceArray,
    device_array,
    engine_stream_handle,
    stream_handle,
)

__all__ = ["SlotCopies"]


class _Batch:
    """Staged copies issued together: their buffers, (slot, host view) pairs and completion."""

    __slots__ = ("buffers", "done", "pairs")

    def __init__(self, buffers: list[StagingBuffer], pairs: list[tuple[int, memoryview]]) -> None:
        self.buffers = buffers
        self.pairs = pairs
        self.done: Completion | None = None


class SlotCopies(CopyCore):
    """Copies into and out of ``num_blocks`` slots of ``block_bytes`` from device pointer
    ``base`` on CUDA ``device``. Build it with that device current (its streams and pinned
    buffers are created here)."""

    # -- promotion and write-through ---------------------------------------------------------

    async def fill(self, slot: int, sink: ByteSink) -> None:
        """The tier writes into a pinned staging buffer; one host-to-device copy follows."""
        with self.operation():
            buffers = await self._upload_staging.acquire()
            done: Completion | None = None
            try:
                await sink(buffers[0].view)
                copy = (self.ptr(slot), buffers[0].ptr)
                done = await self._submit(self._upload, [copy], self._rt.memcpyHostToDevice, [slot])
                self._to_device += self.block_bytes
                await self._wait(done)
            finally:
                await self._settle(done, self._upload, [slot], self._upload_staging, buffers)

    async def fill_many(self, slots: Sequence[int], sink: BatchSink) -> Sequence[Exception | None]:
        """One ``sink`` call writes every slot's bytes (a tier's batch load): into upload
        staging buffers as far as they go (waiting for at least one), the rest into host
        memory that follows through the same staging buffers afterwards. Per slot, None or
        why it failed."""
        with self.operation():
            buffers = await self._upload_staging.acquire(len(slots))
            first = len(buffers)
            rest = np.empty((len(slots) - first, self.block_bytes), np.uint8)
            done: Completion | None = None
            outcomes: list[Exception | None] = []
            try:
                views = [b.view for b in buffers] + [row.data for row in rest]
                outcomes = list(await sink(views))  # one per view (zip checks it)
                heads = zip(slots[:first], buffers, outcomes[:first], strict=True)
                ok = [(slot, buffer) for slot, buffer, outcome in heads if outcome is None]
                if ok:
                    copies = [(self.ptr(slot), buffer.ptr) for slot, buffer in ok]
                    kind = self._rt.memcpyHostToDevice
                    done = await self._submit(self._upload, copies, kind, [s for s, _ in ok])
                    self._to_device += len(ok) * self.block_bytes
                    await self._wait(done)
            except Exception as exc:
                return [exc] * len(slots)
            finally:
                await self._settle(done, self._upload, slots[:first], self._upload_staging, buffers)
            later = [
                (slot, row.data)
                for slot, row, outcome in zip(slots[first:], rest, outcomes[first:], strict=True)
                if outcome is None
            ]
            if later:
                try:
                    await self._copy_staged(later, to_pool=True, staging=self._upload_staging)
                except Exception as exc:
                    for i in range(first, len(slots)):
                        outcomes[i] = outcomes[i] or exc
            return outcomes

    async def drain(self, slot: int, source: ByteSource) -> None:
        """Device-to-host into a staging buffer, then the tier reads the staging buffer."""
        with self.operation():
            buffers = await self._download_staging.acquire()
            done: Completion | None = None
            try:
                copy = (buffers[0].ptr, self.ptr(slot))
                done = await self._submit(
                    self._download, [copy], self._rt.memcpyDeviceToHost, [slot]
                )
                self._to_host += self.block_bytes
                await self._wait(done)
                await source(buffers[0].view.toreadonly())
            finally:
                await self._settle(done, self._download, [slot], self._download_staging, buffers)

    # -- engine store and load ---------------------------------------------------------------

    async def copy(
        self, slots: Sequence[int], buffers: Sequence[BlockBuffer], *, to_pool: bool
    ) -> None:
        """Engine buffers into the slots (``to_pool``) or out of them: GPU buffers
        device-to-device, host buffers through staging."""
        with self.operation():
            # What each buffer is takes CUDA calls (pointer attributes): off the loop too.
            on_device, pinned, on_host = await self._caller.run(self._split, slots, buffers)
            if on_device:
                await self._copy_peer(on_device, to_pool=to_pool)
            if pinned:
                await self._copy_pinned(pinned, to_pool=to_pool)
            if on_host:
                await self._copy_staged(on_host, to_pool=to_pool)

    def _split(
        self, slots: Sequence[int], buffers: Sequence[BlockBuffer]
    ) -> tuple[
        list[tuple[int, DeviceArray]],
        list[tuple[int, int, memoryview]],
        list[tuple[int, memoryview]],
    ]:
        """The copies by kind: GPU buffers, pinned host buffers (slot, address, view) and
        pageable host buffers."""
        on_device: list[tuple[int, DeviceArray]] = []
        pinned: list[tuple[int, int, memoryview]] = []
        on_host: list[tuple[int, memoryview]] = []
        for slot, buffer in zip(slots, buffers, strict=True):
            self.ptr(slot)  # checks the slot number
            if buffer.host is not None:
                nbytes = buffer.host.nbytes
                address = self._pinned_address(buffer.host)
                if address is None:
                    on_host.append((slot, buffer.host))
                else:
                    pinned.append((slot, address, buffer.host))
            else:
                array = device_array(buffer.device, self._rt)
                if array.device != self.device:
                    raise InvalidArgumentError(
                        f"a GPU buffer is on cuda:{array.device} but this CudaPool is on "
                        f"cuda:{self.device}; pass buffers on the pool's device"
                    )
                nbytes = array.nbytes
                on_device.append((slot, array))
            if nbytes != self.block_bytes:
                raise InvalidArgumentError(
                    f"an engine buffer holds {nbytes} bytes but this CudaPool's blocks are "
                    f"{self.block_bytes} bytes; pass exactly one block per slot"
                )
        return on_device, pinned, on_host

    def _pinned_address(self, view: memoryview) -> int | None:
        """The address of ``view`` when all of it is page-locked host memory CUDA knows
        (so a DMA can read or write it directly); None for pageable memory."""
        if view.nbytes != self.block_bytes or not view.nbytes:
            return None  # a wrong size is reported by the caller
        address = int(np.frombuffer(view, np.uint8).ctypes.data)
        host = self._rt.memoryTypeHost
        try:  # older CUDA raises for memory it does not know
            first = self._rt.pointerGetAttributes(address).type
            last = self._rt.pointerGetAttributes(address + view.nbytes - 1).type
        except Exception:
            return None
        return address if first == host and last == host else None

    def _engine_handles(self, pairs: list[tuple[int, DeviceArray]]) -> list[int]:
        """The streams the engine wrote (or will read) its buffers on; read on the loop
        thread: current streams are thread-local."""
        if self._engine_stream is not None:
            return [stream_handle(self._engine_stream)]
        handles: dict[int, None] = {}
        seen: set[tuple[str, int]] = set()
        for _, array in pairs:
            if array.framework == "cai" or (array.framework, array.device) not in seen:
                seen.add((array.framework, array.device))
                handle = engine_stream_handle(array)
                if handle is not None:
                    handles[handle] = None
        return list(handles)

    async def _copy_peer(self, pairs: list[tuple[int, DeviceArray]], *, to_pool: bool) -> None:
        """Device-to-device between slots and engine buffers, after the engine's stream."""
        lane = self._peer
        slots = [slot for slot, _ in pairs]
        engine = self._engine_handles(pairs)
        done: Completion | None = None
        try:
            copies = [
                (self.ptr(slot), array.ptr) if to_pool else (array.ptr, self.ptr(slot))
                for slot, array in pairs
            ]
            kind = self._rt.memcpyDeviceToDevice
            done = await self._submit(lane, copies, kind, slots, after=engine)
            self._peer_bytes += len(pairs) * self.block_bytes
            await self._wait(done)
        finally:
            await self._settle(done, lane, slots, None, [], engine, [a.obj for _, a in pairs])

    async def _copy_pinned(
        self, pairs: list[tuple[int, int, memoryview]], *, to_pool: bool
    ) -> None:
        """Pinned host buffers and slots: one DMA per run, no staging and no host copy; the
        engine's buffers are kept until the copy landed, should it be abandoned."""
        lane = self._upload if to_pool else self._download
        slots = [slot for slot, _, _ in pairs]
        kind = self._rt.memcpyHostToDevice if to_pool else self._rt.memcpyDeviceToHost
        done: Completion | None = None
        try:
            copies = [
                (self.ptr(slot), address) if to_pool else (address, self.ptr(slot))
                for slot, address, _ in pairs
            ]
            done = await self._submit(lane, copies, kind, slots)
            nbytes = len(pairs) * self.block_bytes
            if to_pool:
                self._to_device += nbytes
            else:
                self._to_host += nbytes
            await self._wait(done)
        finally:
            await self._settle(done, lane, slots, None, [], keep=[v for _, _, v in pairs])

    async def _copy_staged(
        self,
        pairs: list[tuple[int, memoryview]],
        *,
        to_pool: bool,
        staging: StagingPool | None = None,
    ) -> None:
        """Host buffers through pinned staging (the engine's set unless given), in chunks of
        half the staging pool so the host memcpy of one chunk overlaps the DMA of the
        previous one."""
        lane = self._upload if to_pool else self._download
        staging = self._engine_staging if staging is None else staging
        kind = self._rt.memcpyHostToDevice if to_pool else self._rt.memcpyDeviceToHost
        chunk = max(1, staging.count // 2)
        pending: deque[_Batch] = deque()
        i = 0
        try:
            while i < len(pairs):
                want = min(chunk, len(pairs) - i)
                if pending:  # never block while holding buffers: retire our own work first
                    buffers = staging.try_acquire(want)
                    if not buffers:
                        await self._retire(pending[0], staging, to_pool=to_pool)
                        pending.popleft()
                        continue
                else:
                    buffers = await staging.acquire(want)
                batch = _Batch(buffers, pairs[i : i + len(buffers)])
                pending.append(batch)
                i += len(buffers)
                nbytes = len(buffers) * self.block_bytes
                if to_pool:
                    views = [(b.view, v) for b, (_, v) in zip(buffers, batch.pairs, strict=True)]
                    await self._host_copy(views, nbytes)
                ends = zip(buffers, batch.pairs, strict=True)
                copies = [
                    (self.ptr(slot), b.ptr) if to_pool else (b.ptr, self.ptr(slot))
                    for b, (slot, _) in ends
                ]
                batch.done = await self._submit(
                    lane, copies, kind, [slot for slot, _ in batch.pairs]
                )
                if to_pool:
                    self._to_device += nbytes
                else:
                    self._to_host += nbytes
            while pending:
                await self._retire(pending[0], staging, to_pool=to_pool)
                pending.popleft()
        finally:
            for batch in pending:
                slots = [slot for slot, _ in batch.pairs]
                await self._settle(batch.done, lane, slots, staging, batch.buffers)

    async def _retire(self, batch: _Batch, staging: StagingPool, *, to_pool: bool) -> None:
        assert batch.done is not None
        await self._wait(batch.done)
        if not to_pool:
            host = [(view, b.view) for b, (_, view) in zip(batch.buffers, batch.pairs, strict=True)]
            await self._host_copy(host, len(host) * self.block_bytes)
        staging.release(batch.buffers)
        batch.buffers = []
