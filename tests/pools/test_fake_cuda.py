"""The CUDA stand-in (``devtools.fake_cuda``) tells the truth where CudaPool's correctness
depends on it: per-thread devices and the contexts they create, graph captures that refuse
other threads' synchronising calls without dropping their copies, the legacy stream against
non-blocking streams, events and streams bound to a device, host memory types, and costs.

No event loop and no pool here: plain threads, ordered by threading events and the stand-in's
own ``wait_until``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from devtools.fake_cuda import FakeCuda, FakeCudaError

H2D, D2H = FakeCuda.memcpyHostToDevice, FakeCuda.memcpyDeviceToHost


def _in_thread(fake: FakeCuda, call: Callable[[], Any]) -> Any:
    """``call()`` on a fresh thread (no device, no context); its result or its error."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and out, "the stand-in call never returned"
    return out[0]


def test_each_thread_has_its_own_device_and_a_first_set_device_creates_a_context(
    fake: FakeCuda,
) -> None:
    assert (fake.getDevice(), fake.ctxGetCurrent(), fake.contexts) == (0, 0, {})
    fake.setDevice(1)
    assert set(fake.contexts) == {1}
    assert fake.getDevice() == 1 and fake.ctxGetCurrent() != 0
    # Another thread starts with no device and no context of its own...
    assert _in_thread(fake, lambda: (fake.getDevice(), fake.ctxGetCurrent())) == (0, 0)
    assert set(fake.contexts) == {1}
    # ...and a call that needs one creates device 0's, as CUDA's implicit initialisation does.
    _in_thread(fake, lambda: fake.eventCreateWithFlags(0))
    assert set(fake.contexts) == {0, 1}
    assert fake.getDevice() == 1  # this thread's device did not move


def test_a_global_capture_refuses_other_threads_waits_and_the_copy_still_runs(
    fake: FakeCuda,
) -> None:
    fake.setDevice(0)
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    lane = fake.streamCreateWithFlags(fake.streamNonBlocking)
    event = fake.eventCreateWithFlags(0)
    src, dst = fake.hostAlloc(64, 0), fake.malloc(64)
    fake.poke(src, b"x" * 64)
    gate = fake.hold(stream=lane)
    fake.memcpyAsync(dst, src, 64, H2D, lane)
    fake.eventRecord(event, lane)
    capture = fake.begin_capture(engine)  # this thread captures, in global mode

    refused = _in_thread(fake, lambda: fake.eventSynchronize(event))
    assert isinstance(refused, FakeCudaError) and refused.status == 900
    assert fake.error is None  # not sticky
    assert _in_thread(fake, lambda: fake.eventQuery(event)) == 900  # a raw status
    assert capture.invalidated and capture.refused == ["eventSynchronize", "eventQuery"]
    fake.release(gate)
    fake.wait_quiet()
    assert fake.peek(dst, 64) == b"x" * 64  # the copy stayed queued and ran
    with pytest.raises(FakeCudaError, match="invalidated"):
        fake.end_capture(capture)


def test_a_relaxed_thread_waits_beside_a_capture_without_breaking_it(fake: FakeCuda) -> None:
    fake.setDevice(0)
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    event = fake.eventCreateWithFlags(0)
    fake.eventRecord(event, fake.streamCreateWithFlags(fake.streamNonBlocking))
    capture = fake.begin_capture(engine)

    def relaxed_wait() -> int:
        previous = fake.threadExchangeStreamCaptureMode(fake.streamCaptureModeRelaxed)
        fake.eventSynchronize(event)
        return previous

    assert _in_thread(fake, relaxed_wait) == fake.streamCaptureModeGlobal
    assert not capture.invalidated
    dst, src = fake.allocate_quietly(8, 0), fake.allocate_quietly(8, None)
    fake.memcpyAsync(dst, src, 8, H2D, engine)  # captured, not run
    # The capturing thread's own unsafe calls are refused whatever the others do.
    with pytest.raises(FakeCudaError, match="graph capture"):
        fake.malloc(64)
    with pytest.raises(FakeCudaError, match="invalidated by malloc"):
        fake.end_capture(capture)
    assert len(capture.ops) == 1 and fake.log == []


def test_the_legacy_stream_waits_for_blocking_streams_but_not_for_non_blocking_ones(
    fake: FakeCuda,
) -> None:
    fake.setDevice(0)
    device = fake.malloc(64)
    fake.poke(device, b"o" * 64)
    for flags, waits in ((fake.streamNonBlocking, False), (0, True)):
        stream = fake.streamCreateWithFlags(flags)
        gate = fake.hold(stream=stream)
        fake.enqueue_write(stream, device, b"n" * 64)
        out = bytearray(64)
        address = ctypes.addressof(ctypes.c_char.from_buffer(out))
        reader = threading.Thread(target=fake.memcpy, args=(address, device, 64, D2H))
        reader.start()
        if waits:
            fake.wait_until(lambda: fake.waiting > 0)
            fake.wait_quiet()
            assert bytes(out) == bytes(64)  # behind the blocking stream's write
            fake.release(gate)
        reader.join(30)
        assert not reader.is_alive()
        assert bytes(out) == (b"n" if waits else b"o") * 64
        fake.release(gate)
        fake.wait_quiet()
        fake.poke(device, b"o" * 64)


def test_events_and_streams_belong_to_the_device_current_at_their_creation(
    fake: FakeCuda,
) -> None:
    fake.setDevice(1)
    other = fake.streamCreateWithFlags(fake.streamNonBlocking)
    other_context = fake.ctxGetCurrent()
    fake.setDevice(0)
    event = fake.eventCreateWithFlags(0)
    with pytest.raises(FakeCudaError, match="event of cuda:0 recorded on a stream of cuda:1"):
        fake.eventRecord(event, other)
    assert fake.streamGetCtx(other) == other_context != fake.ctxGetCurrent()
    assert fake.streamGetCtx(0) == fake.ctxGetCurrent()  # the legacy stream: the current one
    fake.eventRecord(event, fake.streamCreateWithFlags(0))  # same device: fine


def test_pointer_attributes_tell_pageable_pinned_and_device_memory(fake: FakeCuda) -> None:
    fake.setDevice(1)
    pageable = np.zeros(64, np.uint8)
    pinned, device = fake.hostAlloc(64, 0), fake.malloc(64)
    kinds = [
        (a.type, a.device)
        for a in map(fake.pointerGetAttributes, (pageable.ctypes.data, pinned + 63, device))
    ]
    assert kinds == [
        (fake.memoryTypeUnregistered, -2),
        (fake.memoryTypeHost, 1),
        (fake.memoryTypeDevice, 1),
    ]


def test_calls_and_bytes_cost_time_when_asked() -> None:
    fake = FakeCuda(call_cost=0.05, byte_cost=0.1 / 1024)
    try:
        start = time.perf_counter()
        fake.getDeviceCount()
        assert time.perf_counter() - start >= 0.05
        stream = fake.streamCreateWithFlags(fake.streamNonBlocking)
        src, dst = fake.allocate_quietly(1024, None), fake.allocate_quietly(1024, 0)
        start = time.perf_counter()
        fake.memcpyAsync(dst, src, 1024, H2D, stream)
        fake.streamSynchronize(stream)
        assert time.perf_counter() - start >= 0.05 + 0.1
    finally:
        fake.close()


def test_a_call_gate_parks_the_thread_that_makes_the_call(fake: FakeCuda) -> None:
    gate = fake.hold_call("eventCreateWithFlags")
    done = threading.Event()

    def create() -> None:
        fake.eventCreateWithFlags(0)
        done.set()

    worker = threading.Thread(target=create)
    worker.start()
    assert gate.reached.wait(30)
    assert not done.is_set() and gate.threads == [worker.ident]
    fake.release(gate)
    assert done.wait(30)
    worker.join(30)
