"""A stand-in for the CUDA runtime calls CudaPool makes (``kvtier.pools._cupy.CudaRuntime``),
so the pool's ordering, cancellation, close, error and abandon logic runs without a GPU.

Not a simulator of CUDA, a model of the parts the pool relies on, strict where CUDA is:

- Memory is numpy buffers at real addresses. ``malloc`` gives device memory of the current
  device, ``hostAlloc`` pinned host memory; freed memory stays mapped (so a late copy cannot
  crash the test) but is poisoned: a copy that touches freed memory, memory the stand-in never
  gave out, or the wrong side of a copy kind is not done and is recorded in ``violations``.
  ``pointerGetAttributes`` says what a pointer is: device memory, pinned host memory, or
  memory CUDA does not know (pageable: type ``memoryTypeUnregistered``, as CUDA 11+ answers).
  ``hostRegister`` page-locks memory the caller owns: from then on it is pinned host memory
  (copies may use it, ``pointerGetAttributes`` says so) until ``hostUnregister``; ranges may
  not overlap, and ``freeHost`` refuses them.
- Contexts: each thread has its own current device, none at first (``getDevice`` then says 0
  and ``ctxGetCurrent`` 0). ``setDevice`` makes a device current and creates its context the
  first time; any other call that needs a context, made on a thread without one, creates
  device 0's (CUDA's implicit initialisation). ``contexts`` records which were created.
- A stream is a FIFO worker thread on the device current at its creation; handle 0 is the
  current device's legacy default stream. Work on the legacy stream waits for the device's
  blocking streams, and theirs for it; non-blocking streams (``streamNonBlocking``) never wait
  for either. ``memcpy`` is a copy on the legacy stream that the caller waits for.
- Events belong to the device current at their creation; ``eventRecord`` on a stream of
  another device fails. They complete when the worker reaches their record;
  ``eventSynchronize`` waits for the record made before the call; ``streamWaitEvent`` parks a
  stream until then (a wait is on the record current when it is enqueued).
- Graph captures (``begin_capture``): while a thread captures in global mode, the unsafe
  calls of other threads in global mode (synchronising, querying, allocating, freeing) are
  refused with a non-sticky error that invalidates the capture, and what they would have
  waited for stays queued and runs; ``threadExchangeStreamCaptureMode`` changes a thread's
  mode. Work enqueued on the capturing stream is captured, not run.
- Faults are injected, never timed: ``hold`` parks matching copies at a gate until released,
  ``hold_call`` parks a named call on the thread that makes it, ``fault`` turns a matching
  copy into a sticky context error (every later call and every pending wait fails with it,
  nothing more runs), ``refuse`` makes one named call fail (not sticky).
- Optional costs: ``call_cost`` seconds on the calling thread per call, ``byte_cost`` seconds
  per byte a copy moves, on its stream.
- ``wait_quiet`` blocks until no stream can make progress (each is idle or parked), which is
  how a test knows a copy that could run has run, without sleeping; ``wait_until`` until any
  condition on the stand-in's state holds (memory freed by a late ``cudaFree``, say).

Not shipped: kvtier never imports it; the tests pass it as CudaPool's ``runtime``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from devtools.fake_cuda_parts import (
    ALREADY_REGISTERED,
    CAPTURE_GLOBAL,
    CAPTURE_RELAXED,
    INVALID_HANDLE,
    INVALID_VALUE,
    NOT_READY,
    NOT_REGISTERED,
    Allocation,
    Capture,
    Event,
    FakeCudaError,
    FakeDeviceArray,
    Hold,
    Stream,
    at,
)
from devtools.fake_cuda_state import LEGACY, FakeCudaState

__all__ = ["Capture", "FakeCuda", "FakeCudaError", "FakeDeviceArray", "Hold"]

_CONTEXT_BASE = 0xC7000  # context handles: this plus the device


class FakeCuda(FakeCudaState):
    """The stand-in runtime (see the module docstring). ``devices``: how many it reports."""

    streamNonBlocking = 1
    eventBlockingSync = 1
    eventDisableTiming = 2
    memoryTypeUnregistered = 0
    memoryTypeHost = 1
    memoryTypeDevice = 2
    streamCaptureModeGlobal = CAPTURE_GLOBAL
    streamCaptureModeThreadLocal = 1
    streamCaptureModeRelaxed = CAPTURE_RELAXED
    CUDARuntimeError = FakeCudaError

    # -- the runtime calls ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _api(self, name: str, *, context: bool = True, unsafe: bool = False) -> Iterator[int]:
        """Every call: pay its cost, park at a call gate, then with the lock held count it,
        fail on a sticky error, an injected refusal or a capture that forbids it, and give
        the calling thread a context when the call needs one; yields the current device."""
        if self.call_cost:
            time.sleep(self.call_cost)
        with self.cv:
            gates = [g for g in self._holds if g.call == name and not g.opened.is_set()]
        for gate in gates:
            gate.threads.append(threading.get_ident())
            gate.parked += 1
            gate.reached.set()
            gate.opened.wait()
        with self.cv:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.cv.notify_all()
            if self.error is not None:
                raise self.error
            skip = self._refusals.get(name)
            if skip is not None:
                if skip == 0:
                    del self._refusals[name]
                    raise FakeCudaError(INVALID_VALUE, f"{name} refused (injected)")
                self._refusals[name] = skip - 1
            if unsafe:
                self._check_capture(name)
            yield self._context() if context else self._current()

    def getDeviceCount(self) -> int:
        with self._api("getDeviceCount", context=False):
            return self.devices

    def getDevice(self) -> int:
        with self._api("getDevice", context=False) as device:
            return device

    def setDevice(self, device: int) -> None:
        with self._api("setDevice", context=False):
            if not 0 <= device < self.devices:
                raise FakeCudaError(101, f"invalid device {device}")
            self._make_context(device)
            self._thread.device = device

    def ctxGetCurrent(self) -> int:
        """The calling thread's context handle, 0 when it has none (``cuCtxGetCurrent``)."""
        with self._api("ctxGetCurrent", context=False):
            device: int | None = getattr(self._thread, "device", None)
            return 0 if device is None else _CONTEXT_BASE + device

    def streamGetCtx(self, stream: int) -> int:
        """The context of ``stream`` (``cuStreamGetCtx``; the null stream: the current one)."""
        with self._api("streamGetCtx", context=stream in LEGACY):
            return _CONTEXT_BASE + self._stream(stream).device

    def threadExchangeStreamCaptureMode(self, mode: int) -> int:
        """Set the calling thread's capture mode; returns the previous one."""
        with self._api("threadExchangeStreamCaptureMode", context=False):
            previous: int = getattr(self._thread, "mode", CAPTURE_GLOBAL)
            self._thread.mode = mode
            return previous

    def malloc(self, size: int) -> int:
        with self._api("malloc", unsafe=True) as device:
            return self._allocation(size, device, device)

    def hostAlloc(self, size: int, flags: int) -> int:
        with self._api("hostAlloc", unsafe=True) as device:
            return self._allocation(size, None, device)

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:
        """Page-lock ``size`` bytes the caller owns at ``ptr`` (``cudaHostRegister``)."""
        with self._api("hostRegister", unsafe=True) as device:
            for allocation in self._allocations.values():
                start, end = allocation.start, allocation.start + allocation.array.nbytes
                if not allocation.freed and start < ptr + size and ptr < end:
                    raise FakeCudaError(ALREADY_REGISTERED, f"{ptr:#x}+{size} is known already")
            self._allocations[ptr] = Allocation(at(ptr, size), None, device, registered=True)

    def hostUnregister(self, ptr: int) -> None:
        """Unlock memory ``hostRegister`` locked (``cudaHostUnregister``); it stays the
        caller's, so a later copy touching it is recorded as outside any allocation."""
        with self._api("hostUnregister", unsafe=True):
            allocation = self._allocations.get(ptr)
            if allocation is None or not allocation.registered:
                raise FakeCudaError(NOT_REGISTERED, f"{ptr:#x} is not registered")
            del self._allocations[ptr]
            self.cv.notify_all()

    def registered_bytes(self) -> int:
        """How many bytes ``hostRegister`` holds locked now (tests)."""
        with self.cv:
            return sum(a.array.nbytes for a in self._allocations.values() if a.registered)

    def free(self, ptr: int) -> None:
        self._free("free", ptr, device=True)

    def freeHost(self, ptr: int) -> None:
        self._free("freeHost", ptr, device=False)

    def _free(self, name: str, ptr: int, *, device: bool) -> None:
        with self._api(name, unsafe=True):
            allocation = self._allocations.get(ptr)
            if (
                allocation is None
                or allocation.freed
                or allocation.registered
                or (allocation.device is None) == device
            ):
                raise FakeCudaError(INVALID_VALUE, f"{name} of {ptr:#x}: not allocated")
            # cudaFree and cudaFreeHost wait for the whole device first.
            self._block(lambda: all(s.idle() for s in self._all_streams()), fail=False)
            allocation.freed = True  # kept mapped: a late copy is recorded, not a crash
            self.cv.notify_all()

    def pointerGetAttributes(self, ptr: int) -> Any:
        """What ``ptr`` is: device memory (type 2), pinned host memory (type 1, on the device
        whose context allocated it) or memory CUDA does not know (type 0, device -2)."""
        with self._api("pointerGetAttributes", context=False):
            allocation = self._find(ptr, 1)
        if allocation is None or allocation.freed:
            return SimpleNamespace(
                type=self.memoryTypeUnregistered, device=-2, devicePointer=0, hostPointer=0
            )
        if allocation.device is None:
            return SimpleNamespace(
                type=self.memoryTypeHost,
                device=allocation.context,
                devicePointer=ptr,
                hostPointer=ptr,
            )
        return SimpleNamespace(
            type=self.memoryTypeDevice, device=allocation.device, devicePointer=ptr, hostPointer=0
        )

    def streamCreateWithFlags(self, flags: int) -> int:
        with self._api("streamCreateWithFlags") as device:
            handle = next(self._handles)
            blocking = not flags & self.streamNonBlocking
            self._streams[handle] = Stream(self, handle, device, blocking=blocking)
            return handle

    def streamDestroy(self, stream: int) -> None:
        with self._api("streamDestroy"):
            target = self._stream(stream)
            if target.legacy:
                raise FakeCudaError(INVALID_HANDLE, "the legacy stream cannot be destroyed")
            target.destroyed = True  # the worker drains what is queued, then ends
            self.cv.notify_all()

    def streamSynchronize(self, stream: int) -> None:
        with self._api("streamSynchronize", unsafe=True):
            target = self._stream(stream)
            enqueued = target.enqueued
            self._block(lambda: target.finished >= enqueued)

    def eventCreateWithFlags(self, flags: int) -> int:
        with self._api("eventCreateWithFlags") as device:
            handle = next(self._handles)
            self._events[handle] = Event(device)
            return handle

    def eventDestroy(self, event: int) -> None:
        with self._api("eventDestroy"):
            self._event(event)
            del self._events[event]

    def eventRecord(self, event: int, stream: int) -> None:
        with self._api("eventRecord"):
            target = self._event(event)
            worker = self._stream(stream)
            if worker.device != target.device:
                raise FakeCudaError(
                    INVALID_HANDLE,
                    f"event of cuda:{target.device} recorded on a stream of cuda:{worker.device}",
                )
            target.recorded += 1
            generation = target.recorded

            def complete() -> None:
                target.completed = max(target.completed, generation)

            self._enqueue(worker, complete)

    def eventQuery(self, event: int) -> int:
        """The raw status, never raised (as CuPy's ``eventQuery``): 0 done, 600 not yet."""
        try:
            with self._api("eventQuery", unsafe=True):
                target = self._event(event)
                return 0 if target.completed >= target.recorded else NOT_READY
        except FakeCudaError as exc:
            return exc.status

    def eventSynchronize(self, event: int) -> None:
        with self._api("eventSynchronize", unsafe=True):
            target = self._event(event)
            generation = target.recorded
            self._block(lambda: target.completed >= generation)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        with self._api("streamWaitEvent"):
            target = self._event(event)
            generation = target.recorded
            waiter = self._stream(stream)

            def wait() -> None:
                waiter.park(lambda: target.completed >= generation)

            self._enqueue(waiter, wait)

    def memcpy(self, dst: int, src: int, size: int, kind: int) -> None:
        """A synchronous copy: on the current device's legacy stream (after its blocking
        streams, never after its non-blocking ones), then waited for; a pageable host end is
        allowed."""
        with self._api("memcpy", unsafe=True):
            legacy = self._stream(0)
            self._enqueue(legacy, lambda: self._copy(dst, src, size, kind, pageable=True))
            enqueued = legacy.enqueued
            self._block(lambda: legacy.finished >= enqueued)

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        with self._api("memcpyAsync"):
            self._enqueue_copy(dst, src, size, kind, stream)
