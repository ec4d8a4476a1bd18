"""The CUDA stand-in's state (``devtools.fake_cuda``): its memory, streams, events, contexts
and captures, the faults and gates a test injects, what a test observes, and the internals
the runtime calls share. ``fake_cuda`` holds the calls themselves.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from devtools.fake_cuda_parts import (
    CAPTURE_GLOBAL,
    CAPTURE_INVALIDATED,
    CAPTURE_RELAXED,
    CAPTURE_UNSUPPORTED,
    ILLEGAL_ADDRESS,
    INVALID_HANDLE,
    Allocation,
    Capture,
    Event,
    FakeCudaError,
    Fault,
    Hold,
    Stream,
    at,
)

__all__ = ["LEGACY", "FakeCudaState"]

LEGACY = (0, 1, 2)  # the null stream, cudaStreamLegacy, cudaStreamPerThread (one model)


class FakeCudaState:
    """The stand-in's state, what tests inject into it and observe of it, and the internals
    the runtime calls share (``devtools.fake_cuda.FakeCuda`` makes the calls)."""

    memcpyHostToHost = 0
    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    memcpyDeviceToDevice = 3

    def __init__(self, devices: int = 1, *, call_cost: float = 0.0, byte_cost: float = 0.0) -> None:
        self.devices = devices
        self.call_cost = call_cost
        self.byte_cost = byte_cost
        self.cv = threading.Condition()
        self.error: FakeCudaError | None = None
        self.violations: list[str] = []
        self.calls: dict[str, int] = {}
        self.log: list[tuple[int, int, int]] = []  # copies done: (kind, dst, src)
        self.contexts: dict[int, str] = {}  # device -> the thread that created its context
        self.waiting = 0  # threads blocked in a synchronous wait now
        self._allocations: dict[int, Allocation] = {}
        self._streams: dict[int, Stream] = {}
        self._legacy: dict[int, Stream] = {}
        self._events: dict[int, Event] = {}
        self._handles = itertools.count(0x1000)
        self._holds: list[Hold] = []
        self._faults: list[Fault] = []
        self._refusals: dict[str, int] = {}
        self._captures: list[Capture] = []
        self._thread = threading.local()  # .device (None: no context), .mode (capture mode)

    # -- injection -----------------------------------------------------------------------------

    def hold(self, *, kind: int | None = None, stream: int | None = None) -> Hold:
        """Park the copies of ``kind`` (on ``stream``) enqueued from now until released."""
        gate = Hold(kind, stream)
        with self.cv:
            self._holds.append(gate)
        return gate

    def hold_call(self, name: str) -> Hold:
        """Park every call of ``name`` made from now, on the thread that makes it, until
        released (``threads`` says which threads it parked)."""
        gate = Hold(None, None, call=name)
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
            self._faults.append(Fault(kind, skip, message))

    def fail_context(self, message: str = "context lost") -> None:
        """A sticky context error now."""
        with self.cv:
            self._set_error(ILLEGAL_ADDRESS, message)

    def refuse(self, name: str, skip: int = 0) -> None:
        """The call ``name`` after ``skip`` more such calls fails (not sticky)."""
        with self.cv:
            self._refusals[name] = skip

    def begin_capture(self, stream: int, mode: int = CAPTURE_GLOBAL) -> Capture:
        """The calling thread begins a graph capture on ``stream`` (an engine warming up)."""
        with self.cv:
            target = self._stream(stream)
            if target.legacy:
                raise FakeCudaError(CAPTURE_UNSUPPORTED, "cannot capture the legacy stream")
            capture = Capture(target.handle, threading.get_ident(), mode)
            self._captures.append(capture)
            return capture

    def end_capture(self, capture: Capture) -> None:
        """End ``capture``; raises the invalidation error if a refused call invalidated it."""
        with self.cv:
            self._captures.remove(capture)
        if capture.invalidated:
            raise FakeCudaError(
                CAPTURE_INVALIDATED, f"capture invalidated by {', '.join(capture.refused)}"
            )

    def wait_quiet(self, timeout: float = 30.0) -> None:
        """Block until no stream can make progress without outside help (each is idle, or
        parked on a gate or an event that has not completed). Call it off the event loop."""
        with self.cv:
            quiet = self.cv.wait_for(self._quiet, timeout)
        if not quiet:
            raise AssertionError("fake CUDA streams did not settle")

    def wait_until(self, condition: Callable[[], bool], timeout: float = 30.0) -> None:
        """Block until ``condition()`` holds (checked whenever the stand-in's state changes:
        a call was made, a copy ran, an event completed, memory was freed). Call it off the
        event loop."""
        with self.cv:
            reached = self.cv.wait_for(condition, timeout)
        if not reached:
            raise AssertionError("the fake CUDA state never got there")

    def _quiet(self) -> bool:
        for stream in self._all_streams():
            if stream.idle():
                continue
            if stream.parked_on is None or stream.parked_on():
                return False
        return True

    # -- reading and writing memory directly (tests; no call counted, no context made) ---------

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

    def allocate_quietly(self, size: int, device: int | None) -> int:
        """Device memory on ``device`` (pinned host memory when None) for a test's own
        buffers, without touching the calling thread's device or context."""
        with self.cv:
            return self._allocation(size, device, 0 if device is None else device)

    def enqueue_write(self, stream: int, ptr: int, data: bytes) -> None:
        """Enqueue on ``stream`` a host-to-device copy of ``data`` to ``ptr`` (an engine's
        own work, for ordering tests)."""
        source = self.allocate_quietly(len(data), None)
        self.poke(source, data)
        with self.cv:
            self._enqueue_copy(ptr, source, len(data), self.memcpyHostToDevice, stream)

    def live_allocations(self) -> int:
        with self.cv:
            return sum(1 for a in self._allocations.values() if not a.freed)

    def live_streams(self) -> int:
        with self.cv:
            return sum(1 for s in self._streams.values() if not s.destroyed)

    def live_events(self) -> int:
        with self.cv:
            return len(self._events)

    def close(self) -> None:
        """Stop every worker thread (end of a test)."""
        with self.cv:
            for stream in self._all_streams():
                stream.destroyed = True
                stream.queue.clear()
            self._holds.clear()
            self.cv.notify_all()

    # -- contexts and captures (lock held) ----------------------------------------------------

    def _current(self) -> int:
        device: int | None = getattr(self._thread, "device", None)
        return 0 if device is None else device

    def _context(self) -> int:
        """The calling thread's device, creating device 0's context if it has none."""
        device: int | None = getattr(self._thread, "device", None)
        if device is None:
            device = self._thread.device = 0
            self._make_context(0)
        return device

    def _make_context(self, device: int) -> None:
        if device not in self.contexts:
            self.contexts[device] = threading.current_thread().name

    def _check_capture(self, name: str) -> None:
        me = threading.get_ident()
        mode = getattr(self._thread, "mode", CAPTURE_GLOBAL)
        for capture in self._captures:
            if capture.mode == CAPTURE_RELAXED or mode == CAPTURE_RELAXED:
                continue
            if capture.thread == me or (capture.mode == mode == CAPTURE_GLOBAL):
                capture.invalidated = True
                capture.refused.append(name)
                raise FakeCudaError(
                    CAPTURE_UNSUPPORTED, f"{name} not permitted while a graph capture runs"
                )

    def _set_error(self, status: int, message: str) -> None:
        if self.error is None:
            self.error = FakeCudaError(status, message)
        self.cv.notify_all()

    def _allocation(self, size: int, device: int | None, context: int) -> int:
        array = np.zeros(max(size, 1), np.uint8)
        allocation = Allocation(array, device, context)
        self._allocations[allocation.start] = allocation
        return allocation.start

    # -- internals (lock held) -----------------------------------------------------------------

    def _block(self, done: Callable[[], bool], *, fail: bool = True) -> None:
        """Wait (a synchronous call) until ``done()``; raises a context error met meanwhile."""
        self.waiting += 1
        self.cv.notify_all()
        try:
            self.cv.wait_for(lambda: done() or (fail and self.error is not None))
        finally:
            self.waiting -= 1
        if fail and self.error is not None:
            raise self.error

    def _enqueue_copy(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        worker = self._stream(stream)
        gates = [g for g in self._holds if g.matches(kind, worker.handle)]
        fault = self._take_fault(kind)

        def run() -> None:
            for gate in gates:
                gate.parked += 1
                gate.reached.set()
                if not worker.park(gate.opened.is_set):
                    return
            if fault is not None:
                self._set_error(ILLEGAL_ADDRESS, fault.message)
                return
            self._spend(size * self.byte_cost)
            self._copy(dst, src, size, kind, pageable=False)

        self._enqueue(worker, run)

    def _spend(self, seconds: float) -> None:
        """The time a copy takes, with the lock let go meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.cv.wait(left)

    def _take_fault(self, kind: int) -> Fault | None:
        for fault in self._faults:
            if fault.kind is None or fault.kind == kind:
                if fault.skip == 0:
                    self._faults.remove(fault)
                    return fault
                fault.skip -= 1
                return None
        return None

    def _all_streams(self) -> list[Stream]:
        return [*self._streams.values(), *self._legacy.values()]

    def _stream(self, handle: int) -> Stream:
        if handle in LEGACY:
            device = self._context()
            legacy = self._legacy.get(device)
            if legacy is None:
                legacy = Stream(self, -1 - device, device, blocking=True, legacy=True)
                self._legacy[device] = legacy
            return legacy
        stream = self._streams.get(handle)
        if stream is None or stream.destroyed:
            raise FakeCudaError(INVALID_HANDLE, f"invalid stream handle {handle:#x}")
        return stream

    def _event(self, handle: int) -> Event:
        event = self._events.get(handle)
        if event is None:
            raise FakeCudaError(INVALID_HANDLE, f"invalid event handle {handle:#x}")
        return event

    def _barrier(self, target: Stream) -> Callable[[], bool] | None:
        """What work on ``target`` implicitly waits for: the legacy stream waits for the
        work enqueued so far on its device's blocking streams, a blocking stream for the
        legacy stream's; a non-blocking stream for nothing."""
        if target.legacy:
            marks = [
                (s, s.enqueued)
                for s in self._streams.values()
                if s.blocking and s.device == target.device and not s.destroyed
            ]
            return lambda: all(s.finished >= n for s, n in marks)
        legacy = self._legacy.get(target.device)
        if target.blocking and legacy is not None:
            enqueued = legacy.enqueued
            return lambda: legacy.finished >= enqueued
        return None

    def _enqueue(self, target: Stream, op: Callable[[], None]) -> None:
        for capture in self._captures:
            if capture.stream == target.handle:
                capture.ops.append(op)
                return
        barrier = self._barrier(target)
        if barrier is not None:
            inner = op

            def op() -> None:
                if target.park(barrier):
                    inner()

        target.queue.append(op)
        target.enqueued += 1
        self.cv.notify_all()

    def _find(self, ptr: int, size: int) -> Allocation | None:
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
        np.copyto(at(dst, size), at(src, size))
        self.log.append((kind, dst, src))
