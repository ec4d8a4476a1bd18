"""The data movement of a CudaPool: every copy between its device slots and the outside.

A ``SlotCopies`` owns the copy lanes (upload, download, peer), the pinned staging pools (one
per direction), the fences left by abandoned copies and the transfer counters; the pool owns
the allocation and the slot bookkeeping and hands slot numbers here:

- promotion (``fill``): the tier writes into a pinned staging buffer, then one host-to-device
  copy on the upload stream;
- write-through (``drain``): device-to-host into a staging buffer on the download stream, then
  the tier reads the staging buffer;
- engine store/load (``copy``): device-to-device on the peer stream for GPU buffers (torch
  CUDA tensors, CuPy arrays), ordered after the engine's current stream; host buffers go
  through staging, pipelined in chunks.

Every operation returns its staging buffers in ``finally`` through ``_settle``, which waits
(shielded, bounded) for a copy still running and fences the slots of one that outlives the
bound.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from kvtier._buffers import BlockBuffer
from kvtier._errors import InvalidArgumentError
from kvtier.pools._base import ByteSink, ByteSource
from kvtier.pools._cuda_stream import Completion, Lane, StagingBuffer, StagingPool
from kvtier.pools._device import DeviceArray, current_stream, device_array, stream_handle

__all__ = ["SlotCopies", "TransferStatistics"]

logger = logging.getLogger(__name__)

# Host-side memcpy into or out of staging above this size runs in a worker thread.
_INLINE_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TransferStatistics:
    """What CudaPool moved and how often it had to wait (``CudaPool.transfer_statistics``)."""

    device: int
    completion: str
    staging_buffers: int
    upload_staging_free: int
    download_staging_free: int
    staging_waits: int
    bytes_to_device: int
    bytes_to_host: int
    bytes_device_to_device: int
    abandoned_copies: int


class _Batch:
    """Staged copies issued together: their buffers, (slot, host view) pairs and completion."""

    __slots__ = ("buffers", "done", "pairs")

    def __init__(self, buffers: list[StagingBuffer], pairs: list[tuple[int, memoryview]]) -> None:
        self.buffers = buffers
        self.pairs = pairs
        self.done: Completion | None = None


def _memcpy_pairs(pairs: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in pairs:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


async def _host_copy(pairs: list[tuple[memoryview, memoryview]], nbytes: int) -> None:
    if nbytes <= _INLINE_COPY_BYTES:
        _memcpy_pairs(pairs)
    else:
        await anyio.to_thread.run_sync(_memcpy_pairs, pairs)


class SlotCopies:
    """Copies into and out of ``num_blocks`` slots of ``block_bytes`` from device pointer
    ``base`` on CUDA ``device``. Build it with that device current (its streams and pinned
    buffers are created here)."""

    def __init__(
        self,
        cupy: Any,
        *,
        device: int,
        base: int,
        num_blocks: int,
        block_bytes: int,
        completion: str,
        staging_buffers: int,
        engine_stream: int | None,
        settle_timeout: float,
    ) -> None:
        self._cupy = cupy
        self._rt: Any = cupy.cuda.runtime
        self.device = device
        self.completion = completion
        self.staging_buffers = staging_buffers
        self.block_bytes = block_bytes
        self._base = base
        self._num_blocks = num_blocks
        self._engine_stream = engine_stream
        self._settle_timeout = settle_timeout
        self._fences: dict[int, Any] = {}
        self._to_device = self._to_host = self._peer_bytes = self._abandoned = 0
        self._upload = Lane(cupy, completion, device)
        self._download = Lane(cupy, completion, device)
        self._peer = Lane(cupy, completion, device)
        self._upload_staging = StagingPool(cupy, staging_buffers, block_bytes)
        self._download_staging = StagingPool(cupy, staging_buffers, block_bytes)

    # -- helpers -----------------------------------------------------------------------------

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The pool's device current for the block."""
        with self._cupy.cuda.Device(self.device):
            yield

    def ptr(self, slot: int) -> int:
        """The device address of ``slot``."""
        if not 0 <= slot < self._num_blocks:
            raise InvalidArgumentError(f"slot {slot} is outside [0, {self._num_blocks})")
        return self._base + slot * self.block_bytes

    def _fence(self, lane: Lane, slot: int) -> None:
        """Order ``lane`` after an abandoned copy that may still touch ``slot``."""
        fence = self._fences.get(slot)
        if fence is None:
            return
        if fence.done:
            del self._fences[slot]
        else:
            lane.stream.wait_event(fence)

    def _issue(self, lane: Lane, copies: list[tuple[int, int]], kind: int) -> None:
        """Enqueue block copies (dst, src) on ``lane``, one copy per run of blocks that are
        contiguous on both sides (slots taken in order and one engine array usually are)."""
        size = self.block_bytes
        run_dst, run_src, run_len = copies[0][0], copies[0][1], size
        for dst, src in copies[1:]:
            if dst == run_dst + run_len and src == run_src + run_len:
                run_len += size
                continue
            self._rt.memcpyAsync(run_dst, run_src, run_len, kind, lane.stream.ptr)
            run_dst, run_src, run_len = dst, src, size
        self._rt.memcpyAsync(run_dst, run_src, run_len, kind, lane.stream.ptr)

    async def _settle(
        self,
        done: Completion | None,
        lane: Lane,
        slots: Sequence[int],
        staging: StagingPool | None,
        buffers: list[StagingBuffer],
    ) -> None:
        """Return staging buffers once no DMA can touch them; runs in ``finally``."""
        if done is not None and not done.done():
            try:
                with anyio.move_on_after(self._settle_timeout, shield=True):
                    await done.wait()
            except Exception:
                logger.exception("waiting for a CUDA copy on cuda:%d failed", self.device)
            if not done.done():
                self._abandoned += 1
                logger.warning(
                    "a CUDA copy on cuda:%d outlived settle_timeout=%.1fs; fencing %d slot(s)",
                    self.device,
                    self._settle_timeout,
                    len(slots),
                )
                with self.on_device():
                    fence = self._cupy.cuda.Event(disable_timing=True)
                    fence.record(lane.stream)
                for slot in slots:
                    self._fences[slot] = fence
                if staging is not None and buffers:
                    done.add_done_callback(functools.partial(staging.release, buffers))
                return
        if staging is not None and buffers:
            staging.release(buffers)

    # -- promotion and write-through ---------------------------------------------------------

    async def fill(self, slot: int, sink: ByteSink) -> None:
        """The tier writes into a pinned staging buffer; one host-to-device copy follows."""
        buffers = await self._upload_staging.acquire()
        done: Completion | None = None
        try:
            await sink(buffers[0].view)
            with self.on_device():
                self._fence(self._upload, slot)
                self._rt.memcpyAsync(
                    self.ptr(slot),
                    buffers[0].ptr,
                    self.block_bytes,
                    self._rt.memcpyHostToDevice,
                    self._upload.stream.ptr,
                )
                done = self._upload.mark()
            self._to_device += self.block_bytes
            await done.wait()
        finally:
            await self._settle(done, self._upload, [slot], self._upload_staging, buffers)

    async def drain(self, slot: int, source: ByteSource) -> None:
        """Device-to-host into a staging buffer, then the tier reads the staging buffer."""
        buffers = await self._download_staging.acquire()
        done: Completion | None = None
        try:
            with self.on_device():
                self._fence(self._download, slot)
                self._rt.memcpyAsync(
                    buffers[0].ptr,
                    self.ptr(slot),
                    self.block_bytes,
                    self._rt.memcpyDeviceToHost,
                    self._download.stream.ptr,
                )
                done = self._download.mark()
            self._to_host += self.block_bytes
            await done.wait()
            await source(buffers[0].view.toreadonly())
        finally:
            await self._settle(done, self._download, [slot], self._download_staging, buffers)

    # -- engine store and load ---------------------------------------------------------------

    async def copy(
        self, slots: Sequence[int], buffers: Sequence[BlockBuffer], *, to_pool: bool
    ) -> None:
        """Engine buffers into the slots (``to_pool``) or out of them: GPU buffers
        device-to-device, host buffers through staging."""
        on_device, on_host = self._split(slots, buffers)
        if on_device:
            await self._copy_peer(on_device, to_pool=to_pool)
        if on_host:
            await self._copy_staged(on_host, to_pool=to_pool)

    def _split(
        self, slots: Sequence[int], buffers: Sequence[BlockBuffer]
    ) -> tuple[list[tuple[int, DeviceArray]], list[tuple[int, memoryview]]]:
        on_device: list[tuple[int, DeviceArray]] = []
        on_host: list[tuple[int, memoryview]] = []
        for slot, buffer in zip(slots, buffers, strict=True):
            if buffer.host is not None:
                on_host.append((slot, buffer.host))
                continue
            array = device_array(buffer.device)
            if array.device != self.device:
                raise InvalidArgumentError(
                    f"a GPU buffer is on cuda:{array.device} but this CudaPool is on "
                    f"cuda:{self.device}; pass buffers on the pool's device"
                )
            on_device.append((slot, array))
        return on_device, on_host

    async def _copy_peer(self, pairs: list[tuple[int, DeviceArray]], *, to_pool: bool) -> None:
        """Device-to-device between slots and engine buffers, after the engine's stream."""
        lane = self._peer
        done: Completion | None = None
        try:
            with self.on_device():
                if self._engine_stream is not None:
                    handles = {self._engine_stream}
                else:  # read on the loop thread: current streams are thread-local
                    first_of: dict[tuple[str, int], DeviceArray] = {}
                    for _, array in pairs:
                        first_of.setdefault((array.framework, array.device), array)
                    handles = {stream_handle(current_stream(a)) for a in first_of.values()}
                for handle in handles:  # an event may be destroyed once waited on
                    event = self._cupy.cuda.Event(disable_timing=True)
                    self._rt.eventRecord(event.ptr, handle)
                    lane.stream.wait_event(event)
                for slot, _ in pairs:
                    self._fence(lane, slot)
                copies = [
                    (self.ptr(slot), array.ptr) if to_pool else (array.ptr, self.ptr(slot))
                    for slot, array in pairs
                ]
                self._issue(lane, copies, self._rt.memcpyDeviceToDevice)
                done = lane.mark()
            self._peer_bytes += len(pairs) * self.block_bytes
            await done.wait()
        finally:
            await self._settle(done, lane, [slot for slot, _ in pairs], None, [])

    async def _copy_staged(self, pairs: list[tuple[int, memoryview]], *, to_pool: bool) -> None:
        """Host buffers through pinned staging, in chunks of half the staging pool so the
        host memcpy of one chunk overlaps the DMA of the previous one."""
        lane = self._upload if to_pool else self._download
        staging = self._upload_staging if to_pool else self._download_staging
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
                    await _host_copy(
                        [(b.view, v) for b, (_, v) in zip(buffers, batch.pairs, strict=True)],
                        nbytes,
                    )
                with self.on_device():
                    copies = []
                    for buffer, (slot, _) in zip(buffers, batch.pairs, strict=True):
                        self._fence(lane, slot)
                        copies.append(
                            (self.ptr(slot), buffer.ptr)
                            if to_pool
                            else (buffer.ptr, self.ptr(slot))
                        )
                    kind = self._rt.memcpyHostToDevice if to_pool else self._rt.memcpyDeviceToHost
                    self._issue(lane, copies, kind)
                    batch.done = lane.mark()
                if to_pool:
                    self._to_device += nbytes
                else:
                    self._to_host += nbytes
            while pending:
                await self._retire(pending[0], staging, to_pool=to_pool)
                pending.popleft()
        finally:
            for batch in pending:
                await self._settle(
                    batch.done, lane, [slot for slot, _ in batch.pairs], staging, batch.buffers
                )

    async def _retire(self, batch: _Batch, staging: StagingPool, *, to_pool: bool) -> None:
        assert batch.done is not None
        await batch.done.wait()
        if not to_pool:
            host = [(view, b.view) for b, (_, view) in zip(batch.buffers, batch.pairs, strict=True)]
            await _host_copy(host, len(host) * self.block_bytes)
        staging.release(batch.buffers)
        batch.buffers = []

    # -- closing and observation -------------------------------------------------------------

    def synchronize(self) -> None:  # worker thread
        """Block until every lane ran what was queued on it."""
        with self.on_device():
            for lane in (self._upload, self._download, self._peer):
                lane.synchronize()

    def close(self) -> None:
        """Drop the fences and the pinned memory; only once ``synchronize`` returned."""
        self._fences.clear()
        self._upload_staging.close()
        self._download_staging.close()

    def statistics(self) -> TransferStatistics:
        return TransferStatistics(
            device=self.device,
            completion=self.completion,
            staging_buffers=self.staging_buffers,
            upload_staging_free=self._upload_staging.available,
            download_staging_free=self._download_staging.available,
            staging_waits=self._upload_staging.waits + self._download_staging.waits,
            bytes_to_device=self._to_device,
            bytes_to_host=self._to_host,
            bytes_device_to_device=self._peer_bytes,
            abandoned_copies=self._abandoned,
        )
