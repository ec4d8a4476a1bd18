"""The primary pool in GPU memory (design §3), on CuPy.

One device allocation cut into ``num_blocks`` slots; the bookkeeping is the same ``SlotTable``
as HostPool's (it lives in ``PrimaryPool``). Only the data movement differs, and it lives in
``kvtier.pools._cuda_copies``:

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

CuPy is imported lazily (``kvtier.pools._cupy``): ``import kvtier`` and HostPool work without
it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from kvtier._buffers import BlockBuffer
from kvtier._errors import InvalidArgumentError, LifecycleError
from kvtier._settings import positive_number
from kvtier.pools._base import ByteSink, ByteSource, PrimaryPool
from kvtier.pools._cuda_copies import SlotCopies, TransferStatistics
from kvtier.pools._cuda_stream import COMPLETIONS
from kvtier.pools._cupy import device_count, import_cupy
from kvtier.pools._device import stream_handle
from kvtier.pools._policy import EvictionPolicy

__all__ = ["CudaPool"]

logger = logging.getLogger(__name__)


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
        cupy = import_cupy()
        count = device_count(cupy)
        super().__init__(num_blocks, block_bytes, policy=policy)
        _check_options(count, device, staging_buffers, completion, settle_timeout)
        self._cupy = cupy
        self.device = device
        self.completion = completion
        self.staging_buffers = staging_buffers
        engine = None if engine_stream is None else stream_handle(engine_stream)
        self._settle_timeout = float(settle_timeout)
        self._closed = False
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
            self._copies = SlotCopies(
                cupy,
                device=device,
                base=self._base,
                num_blocks=self.num_blocks,
                block_bytes=self.block_bytes,
                completion=completion,
                staging_buffers=staging_buffers,
                engine_stream=engine,
                settle_timeout=self._settle_timeout,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("this CudaPool is closed")

    def slot_array(self, slot: int) -> Any:
        """A CuPy uint8 view (no copy) of one slot's device memory; for tests and tools."""
        self._check_open()
        cuda = self._cupy.cuda
        pointer = cuda.MemoryPointer(self._memory, self._copies.ptr(slot) - self._base)
        return self._cupy.ndarray((self.block_bytes,), self._cupy.uint8, pointer)

    # -- data movement (kvtier.pools._cuda_copies) -------------------------------------------

    async def fill(self, slot: int, sink: ByteSink) -> None:
        """The tier writes into a pinned staging buffer; one host-to-device copy follows."""
        self._check_open()
        await self._copies.fill(slot, sink)

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
        """Wait (shielded, bounded) for queued copies, then free device and pinned memory.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        synced = False
        with anyio.move_on_after(self._settle_timeout, shield=True):
            await anyio.to_thread.run_sync(self._copies.synchronize, abandon_on_cancel=True)
            synced = True
        if not synced:  # a wedged copy: keep the memory rather than free it under the DMA
            logger.warning("CudaPool on cuda:%d closed with copies still queued", self.device)
            return
        self._copies.close()
        self._memory = None

    def transfer_statistics(self) -> TransferStatistics:
        return self._copies.statistics()

    def __repr__(self) -> str:
        t = self.transfer_statistics()
        return (
            f"{super().__repr__()[:-1]} device=cuda:{self.device} completion={self.completion} "
            f"staging_free={t.upload_staging_free}+{t.download_staging_free}/"
            f"{self.staging_buffers}x2{' closed' if self._closed else ''}>"
        )


def _check_options(
    count: int, device: int, staging_buffers: int, completion: str, settle_timeout: float
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
    if completion not in COMPLETIONS:
        raise InvalidArgumentError(f"completion must be one of {COMPLETIONS}, got {completion!r}")
    positive_number(settle_timeout, "settle_timeout")
