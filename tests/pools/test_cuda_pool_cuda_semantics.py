"""CudaPool where real CUDA differs from a naive model of it, on the stand-in that tells the
truth about each difference (``devtools.fake_cuda``): an engine's graph capture beside the
pool's waits, contexts on GPUs the pool never uses, the legacy stream against the pool's
non-blocking streams, streams of another device, staging order, pinned engine buffers,
events of failed waits, and CUDA calls that block.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from devtools.fake_cuda import FakeCuda, FakeCudaError, FakeDeviceArray
from kvtier import CudaPool, InvalidArgumentError
from kvtier.common._buffers import BlockBuffer
from tests.pools.stand_in import close_on_stand_in, threads_parked_at
from tests.support import fresh_keys

BLOCK = 64 * 1024
PoolOf = Callable[..., CudaPool]


@pytest.fixture
async def pool_of(fake: FakeCuda) -> AsyncIterator[PoolOf]:
    """Builds CudaPools on the stand-in; closes them and checks that no copy touched memory
    it must not."""
    pools: list[CudaPool] = []

    def make(num_blocks: int, **options: Any) -> CudaPool:
        pool = CudaPool(num_blocks, options.pop("block_bytes", BLOCK), runtime=fake, **options)
        pools.append(pool)
        return pool

    yield make
    await close_on_stand_in(fake, pools)


def _blocks(n: int) -> np.ndarray:
    return np.random.default_rng(n + 7).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def _reserve(pool: CudaPool, key: bytes) -> int:
    slot = pool.try_reserve(key)
    assert slot is not None
    return slot


async def _until(event: Any) -> None:
    assert await anyio.to_thread.run_sync(event.wait, 30), "the stand-in never got there"


async def _state(fake: FakeCuda, condition: Callable[[], bool]) -> None:
    await anyio.to_thread.run_sync(fake.wait_until, condition)


async def _quiet(fake: FakeCuda) -> None:
    await anyio.to_thread.run_sync(fake.wait_quiet)
    await anyio.wait_all_tasks_blocked()


def _device_block(fake: FakeCuda, data: np.ndarray, device: int = 0) -> FakeDeviceArray:
    array = FakeDeviceArray(fake, data.nbytes, stream=None, device=device)
    array.write(data.tobytes())
    return array


# -- an engine's graph capture beside the pool's waits -----------------------------------------


async def test_a_waiter_neither_breaks_nor_is_refused_by_an_engines_graph_capture(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """Another thread captures a CUDA graph in global mode (torch's default) while a copy
    is queued: the pool's waiter must not make a refused synchronising call (that would fail
    the copy and invalidate the engine's capture)."""
    pool = pool_of(2)
    slot = _reserve(pool, fresh_keys(1)[0])
    data = _blocks(1)[0]
    engine = await anyio.to_thread.run_sync(fake.streamCreateWithFlags, fake.streamNonBlocking)
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    capture = await anyio.to_thread.run_sync(fake.begin_capture, engine)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.copy_in, [slot], [BlockBuffer(data.data)])
            await _until(gate.reached)
            await _state(fake, lambda: fake.waiting > 0 or capture.invalidated)
            fake.release(gate)
    finally:  # the engine's capture ends either way (it would refuse the teardown's frees)
        refused = list(capture.refused)
        with contextlib.suppress(FakeCudaError):
            fake.end_capture(capture)
    assert refused == [], f"the pool's {refused} broke the engine's capture"
    assert pool.slot_bytes(slot) == data.tobytes()
    pool.abort(slot)


async def test_a_refused_wait_never_lets_a_queued_copy_overwrite_a_reused_slot(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """A wait refused with a non-sticky error (as a capture refuses it) says nothing about
    the copy, which is still queued: were the store failed and its slot handed on, the late
    copy would land on the next block written there."""
    pool = pool_of(1)
    first, second = fresh_keys(2)
    stale, fresh = _blocks(2)
    slot = _reserve(pool, first)
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    fake.refuse("eventSynchronize")
    outcome: list[object] = []

    async def store() -> None:
        try:
            await pool.copy_in([slot], [BlockBuffer(stale.data)])
            outcome.append("stored")
        except FakeCudaError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(store)
        await _until(gate.reached)
        await _state(fake, lambda: fake.calls.get("eventSynchronize", 0) >= 2 or bool(outcome))
        await anyio.wait_all_tasks_blocked()
        if outcome:  # the pool said the copy is over: the manager reuses the slot
            pool.abort(slot)
            assert _reserve(pool, second) == slot
            await pool.copy_in([slot], [BlockBuffer(None, _device_block(fake, fresh))])
            fake.release(gate)
            await _quiet(fake)
            assert pool.slot_bytes(slot) == fresh.tobytes(), "a copy given up on landed later"
        fake.release(gate)
    assert outcome == ["stored"]
    assert pool.slot_bytes(slot) == stale.tobytes()
    pool.abort(slot)


async def test_a_refused_wait_leaks_no_event(fake: FakeCuda, pool_of: PoolOf) -> None:
    """Every event the pool creates is destroyed by close, whatever its waits met."""
    pool = pool_of(2)
    slot = _reserve(pool, fresh_keys(1)[0])
    fake.refuse("eventSynchronize")
    with contextlib.suppress(FakeCudaError):
        await pool.copy_in([slot], [BlockBuffer(_blocks(1)[0].data)])
    pool.abort(slot)
    await pool.aclose()
    assert fake.live_events() == 0


# -- contexts and devices ----------------------------------------------------------------------


async def test_a_pool_on_another_gpu_never_creates_a_context_on_gpu_0(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """The loop thread never chose a device; the pool on cuda:1 must not leave a primary
    context on cuda:0 behind (switching "back" to device 0 would create one)."""
    pool = pool_of(4, device=1)
    slots = [_reserve(pool, k) for k in fresh_keys(3)]
    data = _blocks(3)
    await pool.copy_in(slots[:2], [BlockBuffer(row.data) for row in data[:2]])
    await pool.copy_in(slots[2:], [BlockBuffer(None, _device_block(fake, data[2], device=1))])
    seen: list[bytes] = []

    async def source(view: memoryview) -> None:
        seen.append(bytes(view))

    for slot in slots:
        pool.commit(slot)
        await pool.drain(slot, source)
    await pool.aclose()
    assert seen == [row.tobytes() for row in data]
    assert set(fake.contexts) == {1}, f"contexts made by {fake.contexts}"


async def test_a_thread_that_had_a_device_gets_it_back(fake: FakeCuda, pool_of: PoolOf) -> None:
    fake.setDevice(0)
    pool_of(2, device=1)
    assert fake.getDevice() == 0
    assert set(fake.contexts) == {0, 1}


async def test_an_engine_stream_on_another_gpu_is_refused_when_the_pool_is_built(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """A raw handle (or ``__cuda_stream__`` object) does not say its device: a stream of
    cuda:1 given to a pool on cuda:0 must be refused at once, not fail every copy later."""

    def stream_on_1() -> int:
        fake.setDevice(1)
        return fake.streamCreateWithFlags(fake.streamNonBlocking)

    other = await anyio.to_thread.run_sync(stream_on_1)

    class Protocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, other)

    allocations = fake.live_allocations()
    for stream in (other, Protocol()):
        with pytest.raises(
            InvalidArgumentError, match=r"engine_stream 0x[0-9a-f]+ is not on cuda:0"
        ):
            pool_of(2, engine_stream=stream)
    assert fake.live_allocations() == allocations  # nothing left allocated
    pool = pool_of(2, engine_stream=0)  # the legacy stream of the pool's device: fine
    slot = _reserve(pool, fresh_keys(1)[0])
    data = _blocks(1)[0]
    await pool.copy_in([slot], [BlockBuffer(None, _device_block(fake, data))])
    assert pool.slot_bytes(slot) == data.tobytes()
    pool.abort(slot)


# -- reading slots back ------------------------------------------------------------------------


async def test_slot_bytes_waits_for_copies_queued_on_the_pools_streams(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """``slot_bytes`` reads with a synchronous copy, which runs on the legacy stream; the
    pool's streams are non-blocking, so it must wait for them itself."""
    pool = pool_of(2)
    slot = _reserve(pool, fresh_keys(1)[0])
    data = _blocks(1)[0]
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    read: list[bytes] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.copy_in, [slot], [BlockBuffer(data.data)])
        await _until(gate.reached)
        reader = threading.Thread(target=lambda: read.append(pool.slot_bytes(slot)))
        reader.start()
        await _state(fake, lambda: fake.calls.get("memcpy", 0) > 0 or fake.waiting > 0)
        await anyio.to_thread.run_sync(fake.wait_quiet)
        fake.release(gate)
        await anyio.to_thread.run_sync(reader.join, 30)
    assert read == [data.tobytes()]
    pool.abort(slot)


# -- how copies are issued ---------------------------------------------------------------------


async def test_adjacent_slots_from_one_host_array_merge_into_one_copy_every_batch(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """Four batches of four adjacent slots from one array: one DMA each, every time (staging
    buffers come back in the order they went out)."""
    pool = pool_of(16, staging_buffers=8)
    keys = fresh_keys(16)
    slots = [_reserve(pool, k) for k in keys]
    assert slots == sorted(slots) == list(range(slots[0], slots[0] + 16))
    per_batch = []
    for batch in range(4):
        before = fake.calls.get("memcpyAsync", 0)
        batch_slots = slots[4 * batch : 4 * batch + 4]
        await pool.copy_in(batch_slots, [BlockBuffer(row.data) for row in _blocks(4)])
        per_batch.append(fake.calls["memcpyAsync"] - before)
    assert per_batch == [1, 1, 1, 1]
    for slot in slots:
        pool.abort(slot)


async def test_pinned_engine_buffers_are_copied_directly(fake: FakeCuda, pool_of: PoolOf) -> None:
    """Host buffers that are already page-locked (torch ``pin_memory()``) need no staging:
    one DMA from (and back into) the engine's memory."""
    pool = pool_of(4)
    slots = [_reserve(pool, k) for k in fresh_keys(2)]
    pinned = fake.allocate_quietly(2 * BLOCK, None)
    engine = np.frombuffer(
        memoryview((ctypes.c_ubyte * (2 * BLOCK)).from_address(pinned)), np.uint8
    )
    data = _blocks(2)
    engine[:] = data.reshape(-1)
    blocks = [BlockBuffer(engine[i * BLOCK : (i + 1) * BLOCK].data) for i in range(2)]
    await pool.copy_in(slots, blocks)
    base = pool._copies.ptr(slots[0])
    assert fake.log[-1] == (fake.memcpyHostToDevice, base, pinned)
    engine[:] = 0
    await pool.copy_out(slots, blocks)
    assert fake.log[-1] == (fake.memcpyDeviceToHost, pinned, base)
    assert np.array_equal(engine.reshape(2, BLOCK), data)
    for slot in slots:
        pool.abort(slot)


# -- CUDA calls that block ---------------------------------------------------------------------


@pytest.mark.parametrize("call", ["memcpyAsync", "eventRecord", "eventCreateWithFlags"])
async def test_a_cuda_call_that_blocks_never_blocks_the_event_loop(
    fake: FakeCuda, pool_of: PoolOf, call: str
) -> None:
    """CuPy holds the GIL in its enqueue wrappers: a driver call that blocks there would
    freeze the loop (and the pool's waiters with it). No CUDA call of a copy may run on
    the loop thread."""
    pool = pool_of(2)
    slot = _reserve(pool, fresh_keys(1)[0])
    data = _blocks(1)[0]
    copy = functools.partial(pool.copy_in, [slot], [BlockBuffer(data.data)])
    parked = await threads_parked_at(fake, call, copy)
    assert threading.get_ident() not in parked, f"{call} blocked the event loop thread"
    assert pool.slot_bytes(slot) == data.tobytes()
    pool.abort(slot)
