"""The parts the CUDA stand-in (``devtools.fake_cuda``) is built from: errors, gates, memory,
events, streams, graph captures and engine arrays.

Kept apart from the runtime calls so each file holds one job: this one is the model of the
device's state, ``fake_cuda`` the calls that read and change it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = [
    "CAPTURE_GLOBAL",
    "CAPTURE_RELAXED",
    "CAPTURE_THREAD_LOCAL",
    "Capture",
    "FakeCudaError",
    "FakeDeviceArray",
    "Hold",
]


class DeviceState(Protocol):
    """What the parts read of the device model (``fake_cuda_state.FakeCudaState``): named
    here so the model imports its parts and not the other way round."""

    cv: threading.Condition
    error: FakeCudaError | None

    def peek(self, ptr: int, size: int) -> bytes: ...

    def poke(self, ptr: int, data: bytes) -> None: ...

    def allocate_quietly(self, size: int, device: int | None) -> int: ...


NOT_READY = 600  # cudaErrorNotReady
INVALID_VALUE = 1  # cudaErrorInvalidValue
INVALID_HANDLE = 400  # cudaErrorInvalidResourceHandle
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
ILLEGAL_ADDRESS = 700  # cudaErrorIllegalAddress, sticky
CAPTURE_UNSUPPORTED = 900  # cudaErrorStreamCaptureUnsupported: refused, not sticky
CAPTURE_INVALIDATED = 901  # cudaErrorStreamCaptureInvalidated

CAPTURE_GLOBAL = 0  # cudaStreamCaptureModeGlobal, every thread's default
CAPTURE_THREAD_LOCAL = 1
CAPTURE_RELAXED = 2


class FakeCudaError(RuntimeError):
    """What the stand-in raises, like CuPy's ``CUDARuntimeError`` (``status`` is the code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"fake cudaError {status}: {message}")
        self.status = status


@dataclass
class Hold:
    """A gate: matching copies enqueued while it is active (or, for a gate on a call, the
    matching calls made) park before running.

    ``reached`` is set when the first of them parks; ``threads`` names the threads whose calls
    parked. ``release`` opens the gate for good."""

    kind: int | None
    stream: int | None
    call: str | None = None
    reached: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)
    parked: int = 0
    threads: list[int] = field(default_factory=list)

    def matches(self, kind: int, stream: int) -> bool:
        return (
            self.call is None
            and (self.kind is None or self.kind == kind)
            and (self.stream is None or self.stream == stream)
        )

    def release(self) -> None:
        self.opened.set()


@dataclass
class Fault:
    kind: int | None
    skip: int
    message: str


@dataclass
class Allocation:
    """``device``: the device of device memory, None for pinned host memory; ``context``:
    the device whose context allocated it."""

    array: np.ndarray
    device: int | None
    context: int
    freed: bool = False
    registered: bool = False  # someone else's memory, page-locked by ``hostRegister``

    @property
    def start(self) -> int:
        return int(self.array.ctypes.data)

    def covers(self, ptr: int, size: int) -> bool:
        return self.start <= ptr and ptr + size <= self.start + self.array.nbytes


class Event:
    """An event of one device's context: a record is a generation, completed in order."""

    __slots__ = ("completed", "device", "recorded")

    def __init__(self, device: int) -> None:
        self.device = device
        self.recorded = 0
        self.completed = 0


@dataclass
class Capture:
    """A graph capture that a thread began on a stream: what the stream gets meanwhile is
    captured (``ops``), never run; an unsafe call it forbids invalidates it."""

    stream: int
    thread: int
    mode: int
    invalidated: bool = False
    refused: list[str] = field(default_factory=list)
    ops: list[Callable[[], None]] = field(default_factory=list)


class Stream:
    """One stream of one device: a FIFO of operations and the worker thread that runs them in
    order. ``blocking``: created without ``streamNonBlocking`` (it then syncs with the
    device's legacy stream); ``legacy``: the device's legacy default stream (handle 0)."""

    def __init__(
        self, cuda: DeviceState, handle: int, device: int, *, blocking: bool, legacy: bool = False
    ) -> None:
        self.cuda = cuda
        self.handle = handle
        self.device = device
        self.blocking = blocking
        self.legacy = legacy
        self.queue: deque[Callable[[], None]] = deque()
        self.enqueued = 0  # operations ever enqueued
        self.finished = 0  # of those, run (or dropped by a dead context)
        self.running = False
        self.parked_on: Callable[[], bool] | None = None  # when parked: what it waits for
        self.destroyed = False
        self.thread = threading.Thread(
            target=self._work, name=f"fake-cuda-stream-{handle:#x}", daemon=True
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
                    self.finished += len(self.queue)
                    self.queue.clear()
                    cv.notify_all()
                    continue
                op = self.queue.popleft()
                self.running = True
                try:
                    op()
                finally:
                    self.running = False
                    self.finished += 1
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
    ``ptr`` given: a view of memory allocated already (see ``split``). Allocating it changes
    nothing about the calling thread (no current device, no context, no call counted)."""

    def __init__(
        self,
        cuda: DeviceState,
        nbytes: int,
        *,
        stream: int | None,
        device: int = 0,
        ptr: int | None = None,
    ) -> None:
        self.cuda = cuda
        self.nbytes = nbytes
        self.stream = stream
        self.ptr = cuda.allocate_quietly(nbytes, device) if ptr is None else ptr

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


def at(ptr: int, size: int) -> np.ndarray:
    """The ``size`` bytes at address ``ptr`` as a numpy array (no copy)."""
    import ctypes

    return np.frombuffer(memoryview((ctypes.c_ubyte * size).from_address(ptr)), np.uint8)
