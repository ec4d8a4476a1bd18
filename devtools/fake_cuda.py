"""A stand-in for the CUDA runtime calls CudaPool makes (``kvtier.pools._cupy.CudaRuntime``),
so the pool's ordering, cancellation, close, error and abandon logic runs without a GPU.

Not a simulator of CUDA, a model of the parts the pool relies on, strict where CUDA is:

- Memory is numpy buffers at real addresses. ``malloc`` gives "device" memory, ``hostAlloc``
  pinned host memory; freed memory stays mapped (so a late copy cannot crash the test) but is
  poisoned: a copy that touches freed memory, memory the stand-in never gave out, or the wrong
  side of a copy kind is not done and is recorded in ``violations``.
- A stream is a FIFO worker thread. ``memcpyAsync``, ``eventRecord`` and ``streamWaitEvent``
  enqueue; the worker runs them in order; copies run only when the worker reaches them.
- Events complete when the worker reaches their record; ``eventSynchronize`` waits for the
  record made before the call; ``streamWaitEvent`` parks a stream until then (CUDA's
  semantics: a wait is on the record current when it is enqueued).
- Faults are injected, never timed: ``hold`` parks matching copies at a gate until released,
  ``fault`` turns a matching copy into a sticky context error (every later call and every
  pending wait fails with it, nothing more runs), ``refuse`` makes one named call raise.
- ``wait_quiet`` blocks until no stream can make progress (each is idle or parked), which is
  how a test knows a copy that could run has run, without sleeping; ``wait_until`` until any
  condition on the stand-in's state holds (memory freed by a late ``cudaFree``, say).

Not shipped: kvtier never imports it; the tests pass it as CudaPool's ``runtime``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["FakeCuda", "FakeCudaError", "FakeDeviceArray", "Hold"]

_NOT_READY = 600  # cudaErrorNotReady
_INVALID_VALUE = 1  # cudaErrorInvalidValue
_ILLEGAL_ADDRESS = 700  # cudaErrorIllegalAddress, sticky


class FakeCudaError(RuntimeError):
    """What the stand-in raises, like CuPy's ``CUDARuntimeError`` (``status`` is the code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"fake cudaError {status}: {message}")
        self.status = status


@dataclass
class Hold:
    """A gate for copies: matching copies enqueued while it is active park before running.

    ``reached`` is set when the first of them parks. ``release`` opens the gate for good."""

    kind: int | None
    stream: int | None
    reached: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)
    parked: int = 0

    def matches(self, kind: int, stream: int) -> bool:
        return (self.kind is None or self.kind == kind) and (
            self.stream is None or self.stream == stream
        )

    def release(self) -> None:
        self.opened.set()


@dataclass
class _Fault:
    kind: int | None
    skip: int
    message: str


@dataclass
class _Allocation:
    array: np.ndarray
    device: int | None  # None for pinned host memory
    freed: bool = False

    @property
    def start(self) -> int:
        return int(self.array.ctypes.data)

    def covers(self, ptr: int, size: int) -> bool:
        return self.start <= ptr and ptr + size <= self.start + self.array.nbytes


class _Event:
    __slots__ = ("completed", "recorded")

    def __init__(self) -> None:
        self.recorded = 0
        self.completed = 0


class _Stream:
    """One stream: a FIFO of operations and the worker thread that runs them in order."""

    def __init__(self, cuda: FakeCuda, handle: int) -> None:
        self.cuda = cuda
        self.handle = handle
        self.queue: deque[Callable[[], None]] = deque()
        self.running = False
        self.parked_on: Callable[[], bool] | None = None  # when parked: what it waits for
        self.destroyed = False
        self.thread = threading.Thread(
            target=self._work, name=f"fake-cuda-stream-{handle}", daemon=True
        )
        self.thread.start()

    def idle(self) -> bool:
        return not self.queue and not self.running

    def _work(self) -> None:
        cv = self.cuda.cv
        with cv:
            while True:
                cv.wait_for(lambda: bool(self.queue) or self.destroyed)
                if not self.queue:
                    return
                if self.cuda.error is not None:  # a dead context runs nothing more
                    self.queue.clear()
                    cv.notify_all()
                    continue
                op = self.queue.popleft()
                self.running = True
                try:
                    op()
                finally:
                    self.running = False
                    cv.notify_all()

    def park(self, ready: Callable[[], bool]) -> bool:
        """Inside an op (lock held): wait until ``ready()`` or a context error; False on the
        error."""
        cv = self.cuda.cv
        self.parked_on = ready
        cv.notify_all()
        try:
            cv.wait_for(lambda: ready() or self.cuda.error is not None)
        finally:
            self.parked_on = None
        return self.cuda.error is None


class FakeDeviceArray:
    """An engine buffer in the stand-in's device memory, seen through
    ``__cuda_array_interface__`` (version 3, with the stream its producer wrote it on).
    ``ptr`` given: a view of memory allocated already (see ``split``)."""

    def __init__(
        self,
        cuda: FakeCuda,
        nbytes: int,
        *,
        stream: int | None,
        device: int = 0,
        ptr: int | None = None,
    ) -> None:
        self.cuda = cuda
        self.nbytes = nbytes
        self.stream = stream
        if ptr is None:
            previous = cuda.getDevice()
            cuda.setDevice(device)
            try:
                ptr = cuda.malloc(nbytes)
            finally:
                cuda.setDevice(previous)
        self.ptr = ptr

    def split(self, count: int) -> list[FakeDeviceArray]:
        """``count`` equal, adjacent views of this array (one engine block each)."""
        size = self.nbytes // count
        return [
            FakeDeviceArray(self.cuda, size, stream=self.stream, ptr=self.ptr + i * size)
            for i in range(count)
        ]

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": self.stream,
        }

    def read(self) -> bytes:
        return self.cuda.peek(self.ptr, self.nbytes)

    def write(self, data: bytes) -> None:
        self.cuda.poke(self.ptr, data)


class FakeCuda:
    """The stand-in runtime (see the module docstring). ``devices``: how many it reports."""

    memcpyHostToHost = 0
    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    memcpyDeviceToDevice = 3
    streamNonBlocking = 1
    eventBlockingSync = 1
    eventDisableTiming = 2
    CUDARuntimeError = FakeCudaError

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.cv = threading.Condition()
        self.error: FakeCudaError | None = None
        self.violations: list[str] = []
        self.calls: dict[str, int] = {}
        self.log: list[tuple[int, int, int]] = []  # copies done: (kind, dst, src)
        self._allocations: dict[int, _Allocation] = {}
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, _Event] = {}
        self._handles = itertools.count(0x1000)
        self._holds: list[Hold] = []
        self._faults: list[_Fault] = []
        self._refusals: dict[str, int] = {}
        self._current = threading.local()
        self._streams[0] = _Stream(self, 0)  # the default stream

    # -- injection -----------------------------------------------------------------------------

    def hold(self, *, kind: int | None = None, stream: int | None = None) -> Hold:
        """Park the copies of ``kind`` (on ``stream``) enqueued from now until released."""
        gate = Hold(kind, stream)
        with self.cv:
            self._holds.append(gate)
        return gate

    def release(self, gate: Hold) -> None:
        with self.cv:
            if gate in self._holds:
                self._holds.remove(gate)
            gate.release()
            self.cv.notify_all()

    def release_all(self) -> None:
        """Open every gate (a test's teardown, so a failed test cannot leave copies parked)."""
        with self.cv:
            for gate in self._holds:
                gate.release()
            self._holds.clear()
            self.cv.notify_all()

    def fault(
        self, *, kind: int | None = None, skip: int = 0, message: str = "illegal address"
    ) -> None:
        """The copy of ``kind`` after ``skip`` matching ones fails with a sticky context error
        when it runs (an illegal memory access does that)."""
        with self.cv:
            self._faults.append(_Fault(kind, skip, message))

    def fail_context(self, message: str = "context lost") -> None:
        """A sticky context error now."""
        with self.cv:
            self._set_error(_ILLEGAL_ADDRESS, message)

    def refuse(self, name: str, skip: int = 0) -> None:
        """The call ``name`` after ``skip`` more such calls raises (not sticky)."""
        with self.cv:
            self._refusals[name] = skip

    def wait_quiet(self, timeout: float = 30.0) -> None:
        """Block until no stream can make progress without outside help (each is idle, or
        parked on a gate or an event that has not completed). Call it off the event loop."""
        with self.cv:
            quiet = self.cv.wait_for(self._quiet, timeout)
        if not quiet:
            raise AssertionError("fake CUDA streams did not settle")

    def wait_until(self, condition: Callable[[], bool], timeout: float = 30.0) -> None:
        """Block until ``condition()`` holds (checked whenever the stand-in's state changes:
        a copy ran, an event completed, memory was freed). Call it off the event loop."""
        with self.cv:
            reached = self.cv.wait_for(condition, timeout)
        if not reached:
            raise AssertionError("the fake CUDA state never got there")

    def _quiet(self) -> bool:
        for stream in self._streams.values():
            if stream.idle():
                continue
            if stream.parked_on is None or stream.parked_on():
                return False
        return True

    # -- reading and writing device memory directly (tests) ------------------------------------

    def peek(self, ptr: int, size: int) -> bytes:
        allocation = self._find(ptr, size)
        assert allocation is not None, "peek outside the stand-in's memory"
        offset = ptr - allocation.start
        return allocation.array[offset : offset + size].tobytes()

    def poke(self, ptr: int, data: bytes) -> None:
        allocation = self._find(ptr, len(data))
        assert allocation is not None, "poke outside the stand-in's memory"
        offset = ptr - allocation.start
        allocation.array[offset : offset + len(data)] = np.frombuffer(data, np.uint8)

    def enqueue_write(self, stream: int, ptr: int, data: bytes) -> None:
        """Enqueue on ``stream`` a host-to-device copy of ``data`` to ``ptr`` (an engine's
        own work, for ordering tests)."""
        source = self.hostAlloc(len(data), 0)
        self.poke(source, data)
        self.memcpyAsync(ptr, source, len(data), self.memcpyHostToDevice, stream)

    def live_allocations(self) -> int:
        with self.cv:
            return sum(1 for a in self._allocations.values() if not a.freed)

    def live_streams(self) -> int:
        with self.cv:
            return sum(1 for s in self._streams.values() if not s.destroyed) - 1

    def close(self) -> None:
        """Stop every worker thread (end of a test)."""
        with self.cv:
            for stream in self._streams.values():
                stream.destroyed = True
                stream.queue.clear()
            self._holds.clear()
            self.cv.notify_all()

    # -- the runtime calls ---------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        """Every call: count it, fail on a sticky error or an injected refusal (lock held)."""
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.error is not None:
            raise self.error
        skip = self._refusals.get(name)
        if skip is not None:
            if skip == 0:
                del self._refusals[name]
                raise FakeCudaError(_INVALID_VALUE, f"{name} refused (injected)")
            self._refusals[name] = skip - 1

    def _set_error(self, status: int, message: str) -> None:
        if self.error is None:
            self.error = FakeCudaError(status, message)
        self.cv.notify_all()

    def getDeviceCount(self) -> int:
        with self.cv:
            self._enter("getDeviceCount")
        return self.devices

    def getDevice(self) -> int:
        with self.cv:
            self._enter("getDevice")
        device: int = getattr(self._current, "device", 0)
        return device

    def setDevice(self, device: int) -> None:
        with self.cv:
            self._enter("setDevice")
            if not 0 <= device < self.devices:
                raise FakeCudaError(101, f"invalid device {device}")
        self._current.device = device

    def malloc(self, size: int) -> int:
        return self._allocate("malloc", size, getattr(self._current, "device", 0))

    def hostAlloc(self, size: int, flags: int) -> int:
        return self._allocate("hostAlloc", size, None)

    def _allocate(self, name: str, size: int, device: int | None) -> int:
        with self.cv:
            self._enter(name)
            array = np.zeros(max(size, 1), np.uint8)
            allocation = _Allocation(array, device)
            self._allocations[allocation.start] = allocation
            return allocation.start

    def free(self, ptr: int) -> None:
        self._free("free", ptr, device=True)

    def freeHost(self, ptr: int) -> None:
        self._free("freeHost", ptr, device=False)

    def _free(self, name: str, ptr: int, *, device: bool) -> None:
        with self.cv:
            self._enter(name)
            allocation = self._allocations.get(ptr)
            if allocation is None or allocation.freed or (allocation.device is None) == device:
                raise FakeCudaError(_INVALID_VALUE, f"{name} of {ptr:#x}: not allocated")
            # cudaFree and cudaFreeHost wait for the whole device first.
            self.cv.wait_for(lambda: all(s.idle() for s in self._streams.values()))
            allocation.freed = True  # kept mapped: a late copy is recorded, not a crash
            self.cv.notify_all()

    def pointerGetAttributes(self, ptr: int) -> Any:
        with self.cv:
            self._enter("pointerGetAttributes")
            allocation = self._find(ptr, 1)
        if allocation is None or allocation.device is None:
            raise FakeCudaError(_INVALID_VALUE, f"{ptr:#x} is not device memory")
        return SimpleNamespace(device=allocation.device, devicePointer=ptr)

    def streamCreateWithFlags(self, flags: int) -> int:
        with self.cv:
            self._enter("streamCreateWithFlags")
            handle = next(self._handles)
            self._streams[handle] = _Stream(self, handle)
            return handle

    def streamDestroy(self, stream: int) -> None:
        with self.cv:
            self._enter("streamDestroy")
            target = self._stream(stream)
            target.destroyed = True  # the worker drains what is queued, then ends
            self.cv.notify_all()

    def streamSynchronize(self, stream: int) -> None:
        with self.cv:
            self._enter("streamSynchronize")
            target = self._stream(stream)
            self.cv.wait_for(lambda: target.idle() or self.error is not None)
            if self.error is not None:
                raise self.error

    def eventCreateWithFlags(self, flags: int) -> int:
        with self.cv:
            self._enter("eventCreateWithFlags")
            handle = next(self._handles)
            self._events[handle] = _Event()
            return handle

    def eventDestroy(self, event: int) -> None:
        with self.cv:
            self._enter("eventDestroy")
            self._event(event)
            del self._events[event]

    def eventRecord(self, event: int, stream: int) -> None:
        with self.cv:
            self._enter("eventRecord")
            target = self._event(event)
            target.recorded += 1
            generation = target.recorded

            def complete() -> None:
                target.completed = max(target.completed, generation)

            self._enqueue(stream, complete)

    def eventQuery(self, event: int) -> int:
        with self.cv:
            self._enter("eventQuery")
            target = self._event(event)
            return 0 if target.completed >= target.recorded else _NOT_READY

    def eventSynchronize(self, event: int) -> None:
        with self.cv:
            self._enter("eventSynchronize")
            target = self._event(event)
            generation = target.recorded
            self.cv.wait_for(lambda: target.completed >= generation or self.error is not None)
            if self.error is not None:
                raise self.error

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        with self.cv:
            self._enter("streamWaitEvent")
            target = self._event(event)
            generation = target.recorded
            waiter = self._stream(stream)

            def wait() -> None:
                waiter.park(lambda: target.completed >= generation)

            self._enqueue(stream, wait)

    def memcpy(self, dst: int, src: int, size: int, kind: int) -> None:
        """Synchronous copy (tests read slots back with it); a pageable host end is allowed."""
        with self.cv:
            self._enter("memcpy")
            self.cv.wait_for(lambda: all(s.idle() for s in self._streams.values()))
            self._copy(dst, src, size, kind, pageable=True)

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        with self.cv:
            self._enter("memcpyAsync")
            worker = self._stream(stream)
            gates = [g for g in self._holds if g.matches(kind, stream)]
            fault = self._take_fault(kind)

            def run() -> None:
                for gate in gates:
                    gate.parked += 1
                    gate.reached.set()
                    if not worker.park(gate.opened.is_set):
                        return
                if fault is not None:
                    self._set_error(_ILLEGAL_ADDRESS, fault.message)
                    return
                self._copy(dst, src, size, kind, pageable=False)

            self._enqueue(stream, run)

    # -- internals (lock held) -----------------------------------------------------------------

    def _take_fault(self, kind: int) -> _Fault | None:
        for fault in self._faults:
            if fault.kind is None or fault.kind == kind:
                if fault.skip == 0:
                    self._faults.remove(fault)
                    return fault
                fault.skip -= 1
                return None
        return None

    def _stream(self, handle: int) -> _Stream:
        stream = self._streams.get(handle)
        if stream is None or stream.destroyed:
            raise FakeCudaError(400, f"invalid stream handle {handle:#x}")
        return stream

    def _event(self, handle: int) -> _Event:
        event = self._events.get(handle)
        if event is None:
            raise FakeCudaError(400, f"invalid event handle {handle:#x}")
        return event

    def _enqueue(self, stream: int, op: Callable[[], None]) -> None:
        self._stream(stream).queue.append(op)
        self.cv.notify_all()

    def _find(self, ptr: int, size: int) -> _Allocation | None:
        for allocation in self._allocations.values():
            if allocation.covers(ptr, size):
                return allocation
        return None

    def _end(self, ptr: int, size: int, *, device: bool, pageable: bool, what: str) -> bool:
        allocation = self._find(ptr, size)
        if allocation is None:
            if not device and pageable:
                return True
            self.violations.append(f"{what} {ptr:#x}+{size} is outside any allocation")
            return False
        if allocation.freed:
            self.violations.append(f"{what} {ptr:#x}+{size} touches freed memory")
            return False
        if (allocation.device is not None) != device:
            self.violations.append(f"{what} {ptr:#x} is not {'device' if device else 'host'}")
            return False
        return True

    def _copy(self, dst: int, src: int, size: int, kind: int, *, pageable: bool) -> None:
        dst_device = kind in (self.memcpyHostToDevice, self.memcpyDeviceToDevice)
        src_device = kind in (self.memcpyDeviceToHost, self.memcpyDeviceToDevice)
        ok = self._end(dst, size, device=dst_device, pageable=pageable, what="copy destination")
        ok = self._end(src, size, device=src_device, pageable=pageable, what="copy source") and ok
        if not ok:
            return
        np.copyto(_at(dst, size), _at(src, size))
        self.log.append((kind, dst, src))


def _at(ptr: int, size: int) -> np.ndarray:
    """The ``size`` bytes at address ``ptr`` as a numpy array (no copy)."""
    import ctypes

    return np.frombuffer(memoryview((ctypes.c_ubyte * size).from_address(ptr)), np.uint8)
