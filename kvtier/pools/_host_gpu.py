"""HostPool's copies between its slots and engine buffers on a GPU (torch CUDA tensors, CuPy
arrays, anything with ``__cuda_array_interface__``), through the CUDA runtime seam
(``kvtier.pools._cupy.CudaRuntime``) as CudaPool's copies are.

A batch is one trip to a worker thread: every block is enqueued on the stream its producer
works on (so a store reads what the engine wrote before it, and the engine's later work sees
what a load wrote), blocks adjacent in the slots and in the engine's memory as one copy, then
one event is recorded per stream and waited for. Nothing waits for the engine's whole stream,
and no CUDA call is made on the event loop thread: current streams are read there (they are
thread-local), everything else runs in the worker.

The pool's mapping is registered with CUDA (``cudaHostRegister``, portable to every device)
by the first batch that needs it, so the copies are DMAs from page-locked memory rather than
staged by the driver through a bounce buffer. Pinning is paid once and only by pools that
see GPU buffers; where it is refused (a locked-memory limit), copies go from pageable memory,
still batched. ``close`` unregisters it and destroys the events.

The worker waits in relaxed graph-capture mode, so an engine capturing a CUDA graph on
another thread neither refuses the wait nor is broken by it; a wait that is refused all the
same is tried again, since the copies are still queued (``until_done``).

CuPy is imported only when a GPU buffer arrives and no runtime was given.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvtier.common._buffers import BlockBuffer
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._threads import run_sync
from kvtier.pools import _cupy
from kvtier.pools._cuda_stream import until_done
from kvtier.pools._cupy import CudaRuntime, use_device
from kvtier.pools._device import device_array, producer_stream

__all__ = ["GpuCopies"]

logger = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context

# One block of a batch: (slot, host view or None, GPU array or None, its producer's stream)
_Job = tuple[int, memoryview | None, Any, int | None]


class GpuCopies:
    """The GPU side of a HostPool whose slots are ``block_bytes`` each in ``mapping``.
    ``runtime``: the CUDA runtime calls (CuPy's, made when first needed, when None)."""

    def __init__(self, runtime: CudaRuntime | None, mapping: memoryview, block_bytes: int) -> None:
        self._given = runtime
        self._rt: CudaRuntime | None = None
        self._mapping = mapping
        self.base = int(np.frombuffer(mapping, np.uint8).ctypes.data)
        self.num_blocks, self.block_bytes = mapping.nbytes // block_bytes, block_bytes
        self._lock = threading.Lock()  # the events, the registration
        self._registration_tried = False
        self.registered_on: int | None = None  # the device current when it was registered
        self._events: dict[int, list[int]] = {}  # device -> events free to record
        self.in_flight = 0  # batches in worker threads now (counted on the loop)

    def runtime(self) -> CudaRuntime:
        if self._rt is None:
            self._rt = _cupy.cupy_runtime() if self._given is None else self._given
        return self._rt

    async def copy(
        self, slots: Sequence[int], buffers: Sequence[BlockBuffer], *, to_pool: bool
    ) -> None:
        """Engine buffers into the slots (``to_pool``) or out of them, in one worker trip;
        host buffers among them are copied there too."""
        jobs: list[_Job] = []
        for slot, buffer in zip(slots, buffers, strict=True):
            if not 0 <= slot < self.num_blocks:
                raise InvalidArgumentError(f"slot {slot} is outside [0, {self.num_blocks})")
            if buffer.host is not None:
                jobs.append((slot, buffer.host, None, None))
            elif buffer.device is None:
                operation = "store" if to_pool else "load"
                raise InvalidArgumentError(f"HostPool cannot {operation} a buffer with no memory")
            else:  # the producer's current stream is thread-local: read it here
                jobs.append((slot, None, buffer.device, producer_stream(buffer.device)))
        self.in_flight += 1
        try:  # not abandoned on cancel: the slots and buffers are in use until it returns
            await run_sync(self._run, jobs, to_pool)
        finally:
            self.in_flight -= 1

    # -- the worker thread -------------------------------------------------------------------

    def _run(self, jobs: list[_Job], to_pool: bool) -> None:
        rt = self.runtime()
        size = self.block_bytes
        kind = rt.memcpyDeviceToHost if to_pool else rt.memcpyHostToDevice
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (device, stream) -> copies
        host: list[tuple[int, memoryview]] = []
        for slot, view, obj, stream in jobs:
            if view is not None:
                host.append((slot, view))
                continue
            array = device_array(obj, rt)
            if array.nbytes != size:
                raise InvalidArgumentError(
                    f"an engine buffer holds {array.nbytes} bytes but this HostPool's blocks "
                    f"are {size} bytes; pass exactly one block per slot"
                )
            address = self.base + slot * size
            copy = (address, array.ptr) if to_pool else (array.ptr, address)
            groups.setdefault((array.device, 0 if stream is None else stream), []).append(copy)
        if not groups:
            self._host_copies(host, to_pool=to_pool)
            return
        with _relaxed(rt):
            self._register(rt, next(iter(groups))[0])
            marks: list[tuple[int, int]] = []  # (device, event) after a group's copies
            try:
                for (device, stream), copies in groups.items():
                    with use_device(rt, device):
                        marks.append((device, self._enqueue(rt, device, stream, copies, kind)))
                self._host_copies(host, to_pool=to_pool)  # beside the DMAs
            finally:
                self._wait(rt, marks)

    def _register(self, rt: CudaRuntime, device: int) -> None:
        """Page-lock the mapping once, with ``device`` current (a thread without a context
        would otherwise make device 0's)."""
        with self._lock:
            if self._registration_tried:
                return
            self._registration_tried = True
            try:
                with use_device(rt, device):
                    rt.hostRegister(self.base, self.num_blocks * self.block_bytes, _PORTABLE)
            except Exception as exc:
                logger.warning(
                    "HostPool: cannot page-lock its %d bytes for GPU copies (%s); copying from "
                    "pageable memory",
                    self.num_blocks * self.block_bytes,
                    exc,
                )
                return
            self.registered_on = device

    def _enqueue(
        self, rt: CudaRuntime, device: int, stream: int, copies: list[tuple[int, int]], kind: int
    ) -> int:
        """``copies`` (dst, src) on ``stream``, one per run adjacent on both sides, and an
        event after them. Should anything fail, the stream is waited for before the error is
        raised: no copy may land after the caller got its buffers back."""
        size = self.block_bytes
        try:
            run_dst, run_src, run_len = copies[0][0], copies[0][1], size
            for dst, src in copies[1:]:
                if dst == run_dst + run_len and src == run_src + run_len:
                    run_len += size
                    continue
                rt.memcpyAsync(run_dst, run_src, run_len, kind, stream)
                run_dst, run_src, run_len = dst, src, size
            rt.memcpyAsync(run_dst, run_src, run_len, kind, stream)
            event = self._event(rt, device)
            try:
                rt.eventRecord(event, stream)
            except BaseException:
                self._give_back(device, event)
                raise
        except BaseException:
            with contextlib.suppress(Exception):
                until_done(rt, stream, None, _pause)
            raise
        return event

    def _host_copies(self, pairs: list[tuple[int, memoryview]], *, to_pool: bool) -> None:
        """Host buffers of a mixed batch: plain memcpys into or out of the slots."""
        if not pairs:
            return
        size = self.block_bytes
        for slot, view in pairs:
            block = self._mapping[slot * size : (slot + 1) * size]
            if to_pool:
                block[:] = view
            else:
                view[:] = block

    def _wait(self, rt: CudaRuntime, marks: list[tuple[int, int]]) -> None:
        """Until every recorded event completed; the first error that persists is raised
        once all were waited for (the event it met is destroyed, not reused)."""
        failure: BaseException | None = None
        for device, event in marks:
            with use_device(rt, device):
                try:
                    until_done(rt, 0, event, _pause)
                except Exception as exc:
                    failure = failure or exc
                    with contextlib.suppress(Exception):
                        rt.eventDestroy(event)
                    continue
            self._give_back(device, event)
        if failure is not None:
            raise failure

    def _event(self, rt: CudaRuntime, device: int) -> int:
        with self._lock:
            free = self._events.get(device)
            if free:
                return free.pop()
        return rt.eventCreateWithFlags(rt.eventBlockingSync | rt.eventDisableTiming)

    def _give_back(self, device: int, event: int) -> None:
        with self._lock:
            self._events.setdefault(device, []).append(event)

    def close(self) -> None:
        """Destroy the events and unregister the mapping (blocking: a worker thread runs it,
        once no batch is in flight)."""
        if self._rt is None:
            return
        rt = self._rt
        with self._lock:
            events, self._events = self._events, {}
            registered, self.registered_on = self.registered_on, None
        try:
            with _relaxed(rt):
                for device, free in events.items():
                    with use_device(rt, device):
                        for event in free:
                            rt.eventDestroy(event)
                if registered is not None:
                    with use_device(rt, registered):
                        rt.hostUnregister(self.base)
        except Exception:  # a dead context: what it held goes with it
            logger.exception("HostPool: releasing its CUDA resources failed")


@contextlib.contextmanager
def _relaxed(rt: CudaRuntime) -> Iterator[None]:
    """The calling thread in relaxed graph-capture mode for the block: an engine capturing a
    graph on another thread must neither refuse our registration and waits nor be
    invalidated by them (its own mode comes back after)."""
    previous: int | None = None
    with contextlib.suppress(Exception):
        previous = rt.threadExchangeStreamCaptureMode(rt.streamCaptureModeRelaxed)
    try:
        yield
    finally:
        if previous is not None:
            with contextlib.suppress(Exception):
                rt.threadExchangeStreamCaptureMode(previous)


def _pause(seconds: float) -> None:
    """The back-off between refused waits (a worker thread of its own batch)."""
    threading.Event().wait(seconds)
