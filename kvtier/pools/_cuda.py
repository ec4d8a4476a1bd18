"""The primary pool in GPU memory (design §3), on CuPy.

One device allocation cut into ``num_blocks`` slots; the bookkeeping is the same ``SlotTable``
as HostPool's (it lives in ``PrimaryPool``). Only the data movement differs:

- promotion (``fill``): the tier writes into a pinned staging buffer, then one host-to-device
  copy on the upload stream;
- write-through (``drain``): device-to-host into a staging buffer on the download stream, then
  the tier reads the staging buffer;
- engine store/load (``copy_in``/``copy_out``): device-to-device on the peer stream for GPU
  buffers (torch CUDA tensors, CuPy arrays), ordered after the engine's current stream; host
  buffers go through staging, pipelined in chunks.

Staging buffers are a bounded pool per direction (``staging_buffers`` each way), so a slow tier
write-through can never starve promotions. The event loop never blocks: copies are enqueued
asynchronously and completion is awaited through ``kvtier.pools._cuda_stream.Completion``.

Cancellation: an operation cancelled while a copy runs waits for that copy (shielded, at most
``settle_timeout`` seconds) before its staging buffer goes back and before the manager can hand
the slot to someone else. If the copy outlives that bound (a wedged GPU), the staging buffer is
returned only when the copy completes, and later copies touching the slot wait on a fence event.

CuPy is imported lazily: ``import kvtier`` and HostPool work without it.
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
from kvtier._errors import ExtraNotInstalledError, InvalidArgumentError, KVTierError, LifecycleError
from kvtier._settings import positive_number
from kvtier.pools._base import ByteSink, ByteSource, PrimaryPool
from kvtier.pools._cuda_stream import COMPLETIONS, Completion, Lane, StagingBuffer, StagingPool
from kvtier.pools._device import DeviceArray, current_stream, device_array, stream_handle
from kvtier.pools._policy import EvictionPolicy

__all__ = ["CudaPool", "CudaUnavailableError", "TransferStatistics", "cuda_available"]

logger = logging.getLogger(__name__)

# Host-side memcpy into or out of staging above this size runs in a worker thread.
_INLINE_COPY_BYTES = 1 << 20


class CudaUnavailableError(KVTierError, RuntimeError):
    """CuPy is installed but no usable CUDA device is visible."""


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ExtraNotInstalledError("kvtier.CudaPool", "cuda", "cupy") from exc
    return cupy


def _device_count(cupy: Any) -> int:
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, driver too old, no device
        raise CudaUnavailableError(
            f"no CUDA device visible ({exc}); use kvtier.HostPool on machines without a GPU"
        ) from exc
    if count == 0:
        raise CudaUnavailableError(
            "no CUDA device visible; use kvtier.HostPool on machines without a GPU"
        )
    return count


def cuda_available() -> tuple[bool, str]:
    """Whether CudaPool can run here, and why not (for skips and error messages)."""
    try:
        cupy = _import_cupy()
    except ExtraNotInstalledError:
        return False, "no CUDA GPU: cupy not installed"
    try:
        count = _device_count(cupy)
    except CudaUnavailableError as exc:
        return False, str(exc)
    return True, f"{count} CUDA device(s) visible"


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


class CudaPool(PrimaryPool):
    """``num_blocks`` slots of ``block_bytes`` in one allocation on CUDA ``device``.

    ``staging_buffers``: pinned host buffers per direction (promotions and engine stores from
    host memory use one set, write-through and engine loads into host memory the other).
    ``completion``: how the loop learns a copy finished, ``"callback"`` (default) or
    ``"thread"``; see ``kvtier.pools._cuda_stream``. ``engine_stream``: the engine's stream
    (torch/CuPy stream, ``__cuda_stream__`` object or raw handle) to order GPU-buffer copies
    after; by default each buffer's library's current stream on the calling thread.
    ``settle_timeout``: how long a cancelled operation waits for its in-flight copy.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        device: int = 0,
        *,
        policy: str | EvictionPolicy = "lru",
        staging_buffers: int = 8,
        completion: str = "callback",
        engine_stream: Any = None,
        settle_timeout: float = 5.0,
    ) -> None:
        cupy = _import_cupy()
        count = _device_count(cupy)
        super().__init__(num_blocks, block_bytes, policy=policy)
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise InvalidArgumentError(
                f"device must be a CUDA device index in [0, {count}), got {device!r}"
            )
        if (
            isinstance(staging_buffers, bool)
            or not isinstance(staging_buffers, int)
            or staging_buffers <= 0
        ):
            raise InvalidArgumentError(
                f"staging_buffers must be a positive int, got {staging_buffers!r}"
            )
        if completion not in COMPLETIONS:
            raise InvalidArgumentError(
                f"completion must be one of {COMPLETIONS}, got {completion!r}"
            )
        positive_number(settle_timeout, "settle_timeout")
        self._cupy = cupy
        self._rt: Any = cupy.cuda.runtime
        self.device = device
        self.completion = completion
        self.staging_buffers = staging_buffers
        self._engine_stream = None if engine_stream is None else stream_handle(engine_stream)
        self._settle_timeout = float(settle_timeout)
        self._closed = False
        self._fences: dict[int, Any] = {}
        self._to_device = self._to_host = self._peer_bytes = self._abandoned = 0
        with cupy.cuda.Device(device):
            nbytes = self.num_blocks * self.block_bytes
            try:
                self._memory: Any = cupy.cuda.Memory(nbytes)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise InvalidArgumentError(
                    f"cannot allocate {nbytes} bytes ({self.num_blocks} blocks of "
                    f"{self.block_bytes}) on cuda:{device} ({exc}); reduce num_blocks"
                ) from exc
            self._base = int(self._memory.ptr)
            self._upload = Lane(cupy, completion, device)
            self._download = Lane(cupy, completion, device)
            self._peer = Lane(cupy, completion, device)
            self._upload_staging = StagingPool(cupy, staging_buffers, self.block_bytes)
            self._download_staging = StagingPool(cupy, staging_buffers, self.block_bytes)

    # -- helpers -----------------------------------------------------------------------------

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        with self._cupy.cuda.Device(self.device):
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("this CudaPool is closed")

    def _ptr(self, slot: int) -> int:
        if not 0 <= slot < self.num_blocks:
            raise InvalidArgumentError(f"slot {slot} is outside [0, {self.num_blocks})")
        return self._base + slot * self.block_bytes

    def slot_array(self, slot: int) -> Any:
        """A CuPy uint8 view (no copy) of one slot's device memory; for tests and tools."""
        self._check_open()
        cuda = self._cupy.cuda
        pointer = cuda.MemoryPointer(self._memory, self._ptr(slot) - self._base)
        return self._cupy.ndarray((self.block_bytes,), self._cupy.uint8, pointer)

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
                with self._on_device():
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
        self._check_open()
        buffers = await self._upload_staging.acquire()
        done: Completion | None = None
        try:
            await sink(buffers[0].view)
            with self._on_device():
                self._fence(self._upload, slot)
                self._rt.memcpyAsync(
                    self._ptr(slot),
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
        self._check_open()
        buffers = await self._download_staging.acquire()
        done: Completion | None = None
        try:
            with self._on_device():
                self._fence(self._download, slot)
                self._rt.memcpyAsync(
                    buffers[0].ptr,
                    self._ptr(slot),
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

    async def copy_in(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> None:
        self._check_open()
        on_device, on_host = self._split(slots, blocks)
        if on_device:
            await self._copy_peer(on_device, to_pool=True)
        if on_host:
            await self._copy_staged(on_host, to_pool=True)

    async def copy_out(self, slots: Sequence[int], out: Sequence[BlockBuffer]) -> None:
        self._check_open()
        on_device, on_host = self._split(slots, out)
        if on_device:
            await self._copy_peer(on_device, to_pool=False)
        if on_host:
            await self._copy_staged(on_host, to_pool=False)

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
            with self._on_device():
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
                    (self._ptr(slot), array.ptr) if to_pool else (array.ptr, self._ptr(slot))
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
                with self._on_device():
                    copies = []
                    for buffer, (slot, _) in zip(buffers, batch.pairs, strict=True):
                        self._fence(lane, slot)
                        copies.append(
                            (self._ptr(slot), buffer.ptr)
                            if to_pool
                            else (buffer.ptr, self._ptr(slot))
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

    # -- lifecycle and observation -----------------------------------------------------------

    def _synchronize(self) -> None:  # worker thread
        with self._on_device():
            for lane in (self._upload, self._download, self._peer):
                lane.synchronize()

    async def aclose(self) -> None:
        """Wait (shielded, bounded) for queued copies, then free device and pinned memory.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        synced = False
        with anyio.move_on_after(self._settle_timeout, shield=True):
            await anyio.to_thread.run_sync(self._synchronize, abandon_on_cancel=True)
            synced = True
        if not synced:  # a wedged copy: keep the memory rather than free it under the DMA
            logger.warning("CudaPool on cuda:%d closed with copies still queued", self.device)
            return
        self._fences.clear()
        self._upload_staging.close()
        self._download_staging.close()
        self._memory = None

    def transfer_statistics(self) -> TransferStatistics:
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

    def __repr__(self) -> str:
        t = self.transfer_statistics()
        return (
            f"{super().__repr__()[:-1]} device=cuda:{self.device} completion={self.completion} "
            f"staging_free={t.upload_staging_free}+{t.download_staging_free}/"
            f"{self.staging_buffers}x2{' closed' if self._closed else ''}>"
        )
