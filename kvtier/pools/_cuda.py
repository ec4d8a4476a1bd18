"""The primary pool in GPU memory (docs/design.md, "Decisions worth knowing"), over the CUDA runtime
(CuPy's by default).

One device allocation cut into ``num_blocks`` slots; the bookkeeping is the same ``SlotTable``
as HostPool's (it lives in ``PrimaryPool``). Only the data movement differs, and it lives in
``kvtier.pools._cuda_copies``:

- promotion (``fill``): the tier writes into a pinned staging buffer, then one host-to-device
  copy on the upload stream;
- write-through (``drain``): device-to-host into a staging buffer on the download stream, then
  the tier reads the staging buffer;
- engine store/load (``copy_in``/``copy_out``): device-to-device on the peer stream for GPU
  buffers (torch CUDA tensors, CuPy arrays), ordered after the engine's stream; host buffers
  go through staging, pipelined in chunks.

Staging buffers are a bounded pool per use (``staging_buffers`` each for promotions,
write-throughs and engine copies of host buffers), so a slow tier write-through can never
starve promotions or hold up an engine load. The event loop never blocks and makes no CUDA
call: the pool's own CUDA thread enqueues the copies (``kvtier.pools._cuda_caller``) and a
waiter thread per stream tells the loop when they finished (``kvtier.pools._cuda_stream``);
no Python runs on a CUDA driver thread. Threads the pool owns set its device once; elsewhere
the previous device comes back only where a context was current before (``use_device``), so
a pool never creates a context on a GPU it does not use.

Cancellation: an operation cancelled while a copy runs waits for that copy (shielded, at most
``settle_timeout`` seconds) before its staging buffer goes back and before the manager can hand
the slot to someone else. If the copy outlives that bound (a wedged GPU), its buffers are
returned only when it completes, and later copies touching the slot (and, for engine GPU
buffers, the engine's stream) wait on a fence event. Closing waits for operations in flight
and frees nothing a copy may still touch.

CuPy is imported lazily (``kvtier.pools._cupy``): ``import kvtier`` and HostPool work without
it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio

from kvtier.common._arguments import positive_number
from kvtier.common._buffers import BlockBuffer
from kvtier.common._errors import InvalidArgumentError, LifecycleError
from kvtier.common._threads import run_sync
from kvtier.pools._base import BatchSink, ByteSink, ByteSource, PrimaryPool
from kvtier.pools._cuda_copies import SlotCopies
from kvtier.pools._cuda_core import CopyLimits, SlotSpan, TransferStatistics
from kvtier.pools._cupy import CudaRuntime, cupy_runtime, device_count, use_device
from kvtier.pools._device import stream_device, stream_handle
from kvtier.pools._policy import EvictionPolicy

__all__ = ["CudaPool"]

logger = logging.getLogger(__name__)


class CudaPool(PrimaryPool):
    """``num_blocks`` slots of ``block_bytes`` in one allocation on CUDA ``device``.

    ``staging_buffers``: pinned host buffers per use (promotions, write-throughs, and engine
    stores and loads of host buffers each have a set).
    ``engine_stream``: the engine's stream (torch/CuPy stream, ``__cuda_stream__`` object or
    raw handle) to order GPU-buffer copies after; by default each buffer's library's current
    stream on the calling thread. The object is kept for the pool's life. ``copy_timeout``:
    how long an operation waits for its copies before it fails. ``settle_timeout``: how long
    a cancelled or failed operation, and ``aclose``, wait for copies still in flight.
    ``runtime``: the CUDA runtime calls (``cupy.cuda.runtime`` when None; the tests pass a
    stand-in).
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        device: int = 0,
        *,
        policy: str | EvictionPolicy = "lru",
        staging_buffers: int = 8,
        engine_stream: Any = None,
        copy_timeout: float = 60.0,
        settle_timeout: float = 5.0,
        runtime: CudaRuntime | None = None,
    ) -> None:
        rt = cupy_runtime() if runtime is None else runtime
        count = device_count(rt)
        super().__init__(num_blocks, block_bytes, policy=policy)
        _check_options(count, device, staging_buffers, copy_timeout, settle_timeout)
        _check_engine_stream(engine_stream, device)
        self._rt = rt
        self.device = device
        self.staging_buffers = staging_buffers
        self._settle_timeout = float(settle_timeout)
        self._closed = False
        with use_device(rt, device):
            nbytes = self.num_blocks * self.block_bytes
            try:
                self._base: int | None = rt.malloc(nbytes)
            except rt.CUDARuntimeError as exc:
                raise InvalidArgumentError(
                    f"cannot allocate {nbytes} bytes ({self.num_blocks} blocks of "
                    f"{self.block_bytes}) on cuda:{device} ({exc}); reduce num_blocks"
                ) from exc
            try:
                _check_stream_context(rt, engine_stream, device)
                span = SlotSpan(device, self._base, self.num_blocks, self.block_bytes)
                limits = CopyLimits(staging_buffers, self._settle_timeout, float(copy_timeout))
                self._copies = SlotCopies(rt, span, limits, engine_stream)
            except BaseException:
                rt.free(self._base)
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("this CudaPool is closed")

    def slot_bytes(self, slot: int) -> bytes:
        """A copy of one slot's device memory, read synchronously after every copy queued
        on the pool's streams (it blocks the calling thread until they ran); for tests and
        tools, not the serving path. The lanes are non-blocking streams, which a plain
        ``cudaMemcpy`` on the legacy stream does not wait for, so they are synchronised
        first."""
        self._check_open()
        out = bytearray(self.block_bytes)
        host = memoryview(out)
        import ctypes

        address = ctypes.addressof(ctypes.c_char.from_buffer(out))
        self._copies.synchronize()
        with self._copies.on_device():
            self._rt.memcpy(
                address, self._copies.ptr(slot), self.block_bytes, self._rt.memcpyDeviceToHost
            )
        host.release()
        return bytes(out)

    # -- data movement (kvtier.pools._cuda_copies) -------------------------------------------

    async def fill(self, slot: int, sink: ByteSink) -> None:
        """The tier writes into a pinned staging buffer; one host-to-device copy follows."""
        self._check_open()
        await self._copies.fill(slot, sink)

    async def fill_many(self, slots: Sequence[int], sink: BatchSink) -> Sequence[Exception | None]:
        """One tier call writes every slot: staging buffers as far as they go, the rest
        through host memory and the same buffers after."""
        self._check_open()
        return await self._copies.fill_many(slots, sink)

    async def drain(self, slot: int, source: ByteSource) -> None:
        """Device-to-host into a staging buffer, then the tier reads the staging buffer."""
        self._check_open()
        await self._copies.drain(slot, source)

    async def copy_in(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> None:
        self._check_open()
        await self._copies.copy(slots, blocks, to_pool=True)

    async def copy_out(self, slots: Sequence[int], out: Sequence[BlockBuffer]) -> None:
        self._check_open()
        await self._copies.copy(slots, out, to_pool=False)

    # -- lifecycle and observation -----------------------------------------------------------

    async def aclose(self) -> None:
        """Refuse new copies, wait (shielded, at most ``settle_timeout``) for the operations
        in flight and the copies queued, then free device and pinned memory in a worker
        thread (``cudaFree`` waits for the whole device). What a wedged copy may still touch
        is kept, not freed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not await self._copies.drain_all():
            logger.warning(
                "CudaPool on cuda:%d closed with %d operation(s) or copies still in flight; "
                "its memory is kept",
                self.device,
                self._copies.statistics().operations_in_flight,
            )
            return
        # cudaFree waits for the whole device, the engine's streams included: bounded too.
        freed = False
        with anyio.move_on_after(2 * self._settle_timeout, shield=True):
            await run_sync(self._free, abandon_on_cancel=True, limiter=anyio.CapacityLimiter(1))
            freed = True
        if not freed:
            logger.warning("CudaPool on cuda:%d: freeing its memory did not finish", self.device)

    def _free(self) -> None:  # worker thread
        base, self._base = self._base, None
        try:
            if not self._copies.release():
                logger.warning("CudaPool on cuda:%d: a copy never finished", self.device)
                return
            if base is not None:
                with self._copies.on_device():
                    self._rt.free(base)
        except Exception:  # a dead context: the memory goes with it
            logger.exception("freeing CudaPool memory on cuda:%d failed", self.device)

    def transfer_statistics(self) -> TransferStatistics:
        return self._copies.statistics()

    def __repr__(self) -> str:
        t = self.transfer_statistics()
        return (
            f"{super().__repr__()[:-1]} device=cuda:{self.device} "
            f"staging_free={t.upload_staging_free}+{t.download_staging_free}+"
            f"{t.engine_staging_free}/{self.staging_buffers}x3 in_flight={t.operations_in_flight}"
            f"{' closed' if self._closed else ''}>"
        )


def _check_options(
    count: int, device: int, staging_buffers: int, copy_timeout: float, settle_timeout: float
) -> None:
    """CudaPool's own arguments, checked before anything is allocated (``count``: devices
    visible)."""
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
    positive_number(copy_timeout, "copy_timeout")
    positive_number(settle_timeout, "settle_timeout")


def _check_engine_stream(engine_stream: Any, device: int) -> None:
    """The engine stream must be a stream (``stream_handle`` says what is accepted) on the
    pool's device, when its object says which device it is on."""
    if engine_stream is None:
        return
    stream_handle(engine_stream)
    on = stream_device(engine_stream)
    if on is not None and on != device:
        raise InvalidArgumentError(
            f"engine_stream is on cuda:{on} but this CudaPool is on cuda:{device}; "
            "pass the engine's stream on the pool's device"
        )


def _check_stream_context(rt: CudaRuntime, engine_stream: Any, device: int) -> None:
    """The engine stream must live in the pool's context (call with the pool's device
    current and its context made): a raw handle or ``__cuda_stream__`` object does not say
    its device, and a stream of another device would pass here and fail every device copy
    later (an event cannot be recorded on a stream of another context)."""
    if engine_stream is None:
        return
    handle = stream_handle(engine_stream)
    try:
        same = rt.streamGetCtx(handle) == rt.ctxGetCurrent()
    except Exception as exc:  # not a stream CUDA knows
        raise InvalidArgumentError(
            f"engine_stream {handle:#x} is not a CUDA stream ({exc}); pass the engine's stream"
        ) from exc
    if not same:
        raise InvalidArgumentError(
            f"engine_stream {handle:#x} is not on cuda:{device}: it belongs to another "
            "device's context; pass the engine's stream on the pool's device"
        )
