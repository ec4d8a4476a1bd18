"""The data movement of a CudaPool: every copy between its device slots and the outside.

A ``SlotCopies`` owns the copy lanes (upload, download, peer), the pinned staging pools (one
per direction), the fences left by abandoned copies, the count of operations in flight and
the transfer counters; the pool owns the allocation and the slot bookkeeping and hands slot
numbers here:

- promotion (``fill``): the tier writes into a pinned staging buffer, then one host-to-device
  copy on the upload stream;
- write-through (``drain``): device-to-host into a staging buffer on the download stream, then
  the tier reads the staging buffer;
- engine store/load (``copy``): device-to-device on the peer stream for GPU buffers (torch
  CUDA tensors, CuPy arrays), ordered after the engine's stream; host buffers go through
  staging buffers of their own (so write-throughs parked on a slow tier never stall an
  engine load), pipelined in chunks.

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

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from kvtier._buffers import BlockBuffer
from kvtier._errors import InvalidArgumentError, LifecycleError
from kvtier.pools._base import ByteSink, ByteSource
from kvtier.pools._cuda_stream import Completion, Lane, StagingBuffer, StagingPool
from kvtier.pools._cupy import CudaRuntime
from kvtier.pools._device import (
    DeviceArray,
    device_array,
    engine_stream_handle,
    stream_handle,
)

__all__ = ["BatchSink", "SlotCopies", "TransferStatistics"]

BatchSink = Callable[[Sequence[memoryview]], Awaitable[Sequence[Exception | None]]]
"""Fills the views it is given, each on its own: per view, None or why it failed."""

logger = logging.getLogger(__name__)

# Host-side memcpy into or out of staging above this size runs in a worker thread.
_INLINE_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TransferStatistics:
    """What CudaPool moved and how often it had to wait (``CudaPool.transfer_statistics``)."""

    device: int
    staging_buffers: int
    upload_staging_free: int
    download_staging_free: int
    engine_staging_free: int
    staging_waits: int
    bytes_to_device: int
    bytes_to_host: int
    bytes_device_to_device: int
    abandoned_copies: int
    operations_in_flight: int


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


class SlotCopies:
    """Copies into and out of ``num_blocks`` slots of ``block_bytes`` from device pointer
    ``base`` on CUDA ``device``. Build it with that device current (its streams and pinned
    buffers are created here)."""

    def __init__(
        self,
        runtime: CudaRuntime,
        *,
        device: int,
        base: int,
        num_blocks: int,
        block_bytes: int,
        staging_buffers: int,
        engine_stream: Any,
        settle_timeout: float,
        copy_timeout: float,
    ) -> None:
        self._rt = runtime
        self.device = device
        self.staging_buffers = staging_buffers
        self.block_bytes = block_bytes
        self._base = base
        self._num_blocks = num_blocks
        self._engine_stream = engine_stream  # the object, kept alive while the pool lives
        self._settle_timeout = settle_timeout
        self._copy_timeout = copy_timeout
        # slot -> (fence event, the abandoned copy's completion that retires it)
        self._fences: dict[int, tuple[int, Completion]] = {}
        self._to_device = self._to_host = self._peer_bytes = self._abandoned = 0
        self._in_flight = 0
        self._idle: anyio.Event | None = None
        self.closing = False
        # Host memcpys of big batches: our own threads, not the default limiter's.
        self._limiter = anyio.CapacityLimiter(2)
        self._lanes: list[Lane] = []
        self._staging: list[StagingPool] = []
        try:
            self._upload = self._lane("upload")
            self._download = self._lane("download")
            self._peer = self._lane("peer")
            self._order = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
            self._upload_staging = self._pinned(staging_buffers)
            self._download_staging = self._pinned(staging_buffers)
            self._engine_staging = self._pinned(staging_buffers)
        except BaseException:
            self.release()
            raise

    def _lane(self, name: str) -> Lane:
        lane = Lane(self._rt, self.device, name)
        self._lanes.append(lane)
        return lane

    def _pinned(self, count: int) -> StagingPool:
        staging = StagingPool(self._rt, count, self.block_bytes)
        self._staging.append(staging)
        return staging

    # -- helpers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The pool's device current for the block (switched only when it is not)."""
        previous = self._rt.getDevice()
        if previous == self.device:
            yield
            return
        self._rt.setDevice(self.device)
        try:
            yield
        finally:
            self._rt.setDevice(previous)

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        """Count an operation in flight for its whole life (``aclose`` waits for it)."""
        if self.closing:
            raise LifecycleError("this CudaPool is closed")
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    def ptr(self, slot: int) -> int:
        """The device address of ``slot``."""
        if not 0 <= slot < self._num_blocks:
            raise InvalidArgumentError(f"slot {slot} is outside [0, {self._num_blocks})")
        return self._base + slot * self.block_bytes

    def _issue(self, lane: Lane, copies: list[tuple[int, int]], kind: int) -> None:
        """Enqueue block copies (dst, src) on ``lane``, one copy per run of blocks that are
        contiguous on both sides (slots taken in order and one engine array usually are)."""
        size = self.block_bytes
        run_dst, run_src, run_len = copies[0][0], copies[0][1], size
        for dst, src in copies[1:]:
            if dst == run_dst + run_len and src == run_src + run_len:
                run_len += size
                continue
            self._rt.memcpyAsync(run_dst, run_src, run_len, kind, lane.stream)
            run_dst, run_src, run_len = dst, src, size
        self._rt.memcpyAsync(run_dst, run_src, run_len, kind, lane.stream)

    def _submit(
        self,
        lane: Lane,
        copies: list[tuple[int, int]],
        kind: int,
        slots: Sequence[int],
        after: Sequence[int] = (),
    ) -> Completion:
        """Enqueue ``copies`` on ``lane`` after the fences of ``slots`` and the streams
        ``after``; the completion covers whatever got enqueued, even when enqueueing failed
        partway (it then reports that error once the stream drained). Raises, enqueueing
        nothing, only when the pool is closing."""
        if self.closing:
            raise LifecycleError("this CudaPool is closed")
        with self.on_device():
            try:
                for handle in after:  # the event may be recorded again once waited on
                    self._rt.eventRecord(self._order, handle)
                    self._rt.streamWaitEvent(lane.stream, self._order, 0)
                for slot in slots:
                    fence = self._fences.get(slot)
                    if fence is not None:
                        self._rt.streamWaitEvent(lane.stream, fence[0], 0)
                self._issue(lane, copies, kind)
            except Exception as exc:
                return lane.mark(exc)
            return lane.mark()

    async def _wait(self, done: Completion) -> None:
        """Until ``done``; a copy slower than ``copy_timeout`` fails the operation (and is
        then settled or abandoned like a cancelled one)."""
        with anyio.fail_after(self._copy_timeout):
            await done.wait()

    async def _settle(
        self,
        done: Completion | None,
        lane: Lane,
        slots: Sequence[int],
        staging: StagingPool | None,
        buffers: list[StagingBuffer],
        engine: Sequence[int] = (),
        keep: object = None,
    ) -> None:
        """Return staging buffers once no DMA can touch them; runs in ``finally``.

        A copy still running is waited for (shielded, at most ``settle_timeout``); one that
        outlives that is abandoned: ``slots`` (and the ``engine`` streams) are fenced on it,
        and ``buffers`` and ``keep`` (the engine's arrays) are let go only when it lands."""
        if done is not None and not done.done():
            with anyio.move_on_after(self._settle_timeout, shield=True):
                await done.settled()
            if not done.done():
                self._abandon(done, lane, slots, engine)
                if staging is not None and buffers:
                    done.add_done_callback(functools.partial(staging.release, buffers))
                if keep is not None:
                    done.add_done_callback(functools.partial(_keep_until_done, keep))
                return
        if staging is not None and buffers:
            staging.release(buffers)

    def _abandon(
        self, done: Completion, lane: Lane, slots: Sequence[int], engine: Sequence[int]
    ) -> None:
        self._abandoned += 1
        logger.warning(
            "a CUDA copy on cuda:%d outlived settle_timeout=%.1fs; fencing %d slot(s)",
            self.device,
            self._settle_timeout,
            len(slots),
        )
        try:
            with self.on_device():
                fence = done.event
                if fence is None:  # a stream-wide completion: a fence for all queued so far
                    fence = self._rt.eventCreateWithFlags(self._rt.eventDisableTiming)
                    done.add_done_callback(functools.partial(self._destroy_event, fence))
                    self._rt.eventRecord(fence, lane.stream)
                for handle in engine:  # the engine must not reuse its buffers before it lands
                    self._rt.streamWaitEvent(handle, fence, 0)
        except Exception:  # the context is failing: nothing queued will run any more
            logger.exception("fencing an abandoned CUDA copy on cuda:%d failed", self.device)
            return
        for slot in slots:
            self._fences[slot] = (fence, done)
        done.add_done_callback(functools.partial(self._unfence, slots, fence))

    def _destroy_event(self, event: int) -> None:
        try:
            with self.on_device():
                self._rt.eventDestroy(event)
        except Exception:  # a dead context: the event goes with it
            logger.debug("destroying a fence event on cuda:%d failed", self.device)

    def _unfence(self, slots: Sequence[int], fence: int) -> None:
        for slot in slots:
            current = self._fences.get(slot)
            if current is not None and current[0] == fence:
                del self._fences[slot]

    async def _host_copy(self, pairs: list[tuple[memoryview, memoryview]], nbytes: int) -> None:
        if nbytes <= _INLINE_COPY_BYTES:
            _memcpy_pairs(pairs)
        else:  # not abandoned on cancel: the staging buffer is in use until it returns
            await anyio.to_thread.run_sync(_memcpy_pairs, pairs, limiter=self._limiter)

    # -- promotion and write-through ---------------------------------------------------------

    async def fill(self, slot: int, sink: ByteSink) -> None:
        """The tier writes into a pinned staging buffer; one host-to-device copy follows."""
        with self.operation():
            buffers = await self._upload_staging.acquire()
            done: Completion | None = None
            try:
                await sink(buffers[0].view)
                copy = (self.ptr(slot), buffers[0].ptr)
                done = self._submit(self._upload, [copy], self._rt.memcpyHostToDevice, [slot])
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
                    done = self._submit(self._upload, copies, kind, [s for s, _ in ok])
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
                done = self._submit(self._download, [copy], self._rt.memcpyDeviceToHost, [slot])
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
            self.ptr(slot)  # checks the slot number
            if buffer.host is not None:
                nbytes = buffer.host.nbytes
                on_host.append((slot, buffer.host))
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
        return on_device, on_host

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
            done = self._submit(lane, copies, kind, slots, after=engine)
            self._peer_bytes += len(pairs) * self.block_bytes
            await self._wait(done)
        finally:
            await self._settle(done, lane, slots, None, [], engine, [a.obj for _, a in pairs])

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
                batch.done = self._submit(lane, copies, kind, [slot for slot, _ in batch.pairs])
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

    # -- closing and observation -------------------------------------------------------------

    async def drain_all(self) -> bool:
        """Refuse new work, then wait (at most ``settle_timeout``) until no operation is in flight
        and every lane ran what was queued; False when something is still running."""
        self.closing = True
        with anyio.move_on_after(self._settle_timeout, shield=True):
            while self._in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
            try:
                with self.on_device():
                    marks = [lane.mark() for lane in self._lanes]
            except Exception:  # CUDA is failing: a dead context runs nothing more
                logger.exception("CUDA failed while closing a CudaPool on cuda:%d", self.device)
                return True
            for done in marks:
                await done.settled()
            return True
        return False

    def release(self) -> bool:
        """Stop the waiters and free the streams, events and pinned memory; blocking (a
        worker thread runs it), and only after ``drain_all`` returned True. False when a
        waiter is stuck on a copy (then nothing is freed)."""
        if not all(lane.stop(self._settle_timeout) for lane in self._lanes):
            return False
        with self.on_device():
            for lane in self._lanes:
                lane.destroy()
            if hasattr(self, "_order"):
                self._rt.eventDestroy(self._order)
            self._fences.clear()
            for staging in self._staging:
                staging.free()
        return True

    def statistics(self) -> TransferStatistics:
        return TransferStatistics(
            device=self.device,
            staging_buffers=self.staging_buffers,
            upload_staging_free=self._upload_staging.available,
            download_staging_free=self._download_staging.available,
            engine_staging_free=self._engine_staging.available,
            staging_waits=sum(staging.waits for staging in self._staging),
            bytes_to_device=self._to_device,
            bytes_to_host=self._to_host,
            bytes_device_to_device=self._peer_bytes,
            abandoned_copies=self._abandoned,
            operations_in_flight=self._in_flight,
        )


def _keep_until_done(objects: object) -> None:
    """A completion callback whose only job is to hold ``objects`` (the engine's arrays) until
    the copy that touches them has landed."""
