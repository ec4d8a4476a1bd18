"""The primary-pool contract, run on HostPool and on CudaPool, plus CudaPool specifics:
bounded staging, cancellation, close, errors, abandoned copies, GPU buffers.

CudaPool runs everywhere on the CUDA stand-in (``devtools.fake_cuda``: streams as FIFO
worker threads, events, gates, sticky errors, poisoned freed memory), and on CuPy as well
where a GPU is visible (``cupy`` cases, marked ``gpu``; ``nox -s gpu`` runs them). Tests that
need the stand-in's gates or faults run on it alone; everything else runs on both unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import subprocess
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from devtools.fake_cuda import FakeCuda, FakeCudaError, FakeDeviceArray, Hold
from kvtier import (
    CudaPool,
    CudaUnavailableError,
    ExtraNotInstalledError,
    HostPool,
    InvalidArgumentError,
    LifecycleError,
    MemoryTier,
    OffloadScheduler,
    PrimaryPool,
    SlotState,
    TieringManager,
    block_keys,
    cuda_available,
)
from kvtier.common._buffers import BlockBuffer
from kvtier.pools import _cuda_core
from kvtier.pools._cupy import cupy_packages, cupy_runtime
from tests.support import HUNG_FAILSAFE

CUDA_OK, CUDA_REASON = cuda_available()

BLOCK = 64 * 1024  # host memcpys of a staged chunk of these stay inline
BIG_BLOCK = 1536 * 1024  # one block past the inline host-copy bound


class Cuda:
    """One CUDA runtime for the tests: the stand-in, or CuPy on a real GPU."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fake: FakeCuda | None = FakeCuda(devices=2) if name == "fake" else None
        self.runtime: Any = self.fake if self.fake is not None else cupy_runtime()
        self.pools: list[CudaPool] = []

    def pool(self, num_blocks: int, block_bytes: int = BLOCK, **options: Any) -> CudaPool:
        pool = CudaPool(num_blocks, block_bytes, runtime=self.runtime, **options)
        self.pools.append(pool)
        return pool

    def device_blocks(self, data: np.ndarray, stream: int | None = None) -> list[Any]:
        """One GPU array per row of ``data``, adjacent in memory (like one engine tensor)."""
        if self.fake is not None:
            whole = FakeDeviceArray(self.fake, data.nbytes, stream=stream)
            whole.write(data.tobytes())
            return whole.split(len(data))
        import cupy

        array = cupy.asarray(data)
        return [array[i] for i in range(len(data))]

    def read(self, arrays: list[Any]) -> np.ndarray:
        if self.fake is not None:
            return np.stack([np.frombuffer(a.read(), np.uint8) for a in arrays])
        import cupy

        return np.stack([cupy.asnumpy(a) for a in arrays])


CUDA_RUNTIMES = ["fake", pytest.param("cupy", marks=pytest.mark.gpu)]


def _open(name: str) -> Cuda:
    if name == "cupy" and not CUDA_OK:
        pytest.skip(CUDA_REASON)
    return Cuda(name)


async def _close(runtime: Cuda) -> None:
    """Close the runtime's pools; on the stand-in, check that no copy touched memory it must
    not (freed, foreign, or the wrong side of a copy)."""
    if runtime.fake is not None:
        runtime.fake.release_all()  # a failed test may have left copies parked
    for pool in runtime.pools:
        pool.table.check_invariants()
        await pool.aclose()
    if runtime.fake is not None:
        assert runtime.fake.violations == []
        runtime.fake.close()


@pytest.fixture(params=CUDA_RUNTIMES)
async def cuda(request: pytest.FixtureRequest) -> AsyncIterator[Cuda]:
    """A CUDA runtime: the stand-in, and CuPy where a GPU is visible."""
    runtime = _open(request.param)
    yield runtime
    await _close(runtime)


@pytest.fixture
def fake(cuda: Cuda) -> FakeCuda:
    """The stand-in, for tests that need its gates and faults (skipped on real CuPy)."""
    if cuda.fake is None:
        pytest.skip("needs the CUDA stand-in's gates and faults")
    return cuda.fake


class MakePool:
    """Builds pools of one kind; CudaPool options are ignored for HostPool."""

    def __init__(self, cuda: Cuda | None) -> None:
        self.cuda = cuda
        self.pools: list[PrimaryPool] = []

    def __call__(
        self, num_blocks: int, block_bytes: int = BLOCK, **cuda_options: Any
    ) -> PrimaryPool:
        if self.cuda is not None:
            return self.cuda.pool(num_blocks, block_bytes, **cuda_options)
        pool = HostPool(num_blocks, block_bytes)
        self.pools.append(pool)
        return pool


@pytest.fixture(params=["host", "cuda-fake", pytest.param("cuda-cupy", marks=pytest.mark.gpu)])
async def make_pool(request: pytest.FixtureRequest) -> AsyncIterator[MakePool]:
    """Builds pools of the parametrised kind and closes them after the test."""
    kind: str = request.param
    runtime = _open(kind.removeprefix("cuda-")) if kind.startswith("cuda") else None
    make = MakePool(runtime)
    yield make
    for pool in make.pools:
        pool.table.check_invariants()
        await pool.aclose()
    if runtime is not None:
        await _close(runtime)


def _blocks(n: int, block_bytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def _reserve(pool: PrimaryPool, key: bytes) -> int:
    slot = pool.try_reserve(key)
    assert slot is not None
    return slot


async def _read_back(pool: PrimaryPool, slots: list[int]) -> np.ndarray:
    out = np.zeros((len(slots), pool.block_bytes), np.uint8)
    await pool.copy_out(slots, [BlockBuffer(row.data) for row in out])
    return out


def _all_staging_free(pool: PrimaryPool) -> bool:
    if not isinstance(pool, CudaPool):
        return True
    stats = pool.transfer_statistics()
    free = (stats.upload_staging_free, stats.download_staging_free, stats.engine_staging_free)
    return free == (pool.staging_buffers,) * 3


async def _until(event: Any) -> None:
    """Wait for a stand-in gate or a threading.Event off the loop."""
    assert await anyio.to_thread.run_sync(event.wait, 30), "the stand-in never got there"


async def _quiet(fake: FakeCuda) -> None:
    """Until every fake stream that could run has run, and every task is blocked."""
    await anyio.to_thread.run_sync(fake.wait_quiet)
    await anyio.wait_all_tasks_blocked()


@contextlib.contextmanager
def _failsafe(fake: FakeCuda) -> Iterator[None]:
    """Open every gate after ``HUNG_FAILSAFE`` seconds, should a wait the pool must bound
    wait for a gate after all."""
    timer = threading.Timer(HUNG_FAILSAFE, fake.release_all)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class HostCopies:
    """Stands in for the pool's host memcpy (``_cuda_core._memcpy_pairs``): records the
    thread each call runs on, and parks calls made off the loop thread until ``gate`` opens
    (never the loop: that would hang the test instead of failing it)."""

    def __init__(self, memcpy: Callable[[Any], None], loop: int) -> None:
        self.memcpy = memcpy
        self.loop = loop  # the event loop's thread
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, pairs: Any) -> None:
        self.threads.append(threading.get_ident())
        self.entered.set()
        if threading.get_ident() != self.loop:
            self.gate.wait(HUNG_FAILSAFE)
        self.memcpy(pairs)


@pytest.fixture
async def host_copies(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HostCopies]:
    """The pool's host memcpys, observed and gated (the gate opens at teardown too)."""
    hook = HostCopies(_cuda_core._memcpy_pairs, threading.get_ident())
    monkeypatch.setattr(_cuda_core, "_memcpy_pairs", hook)
    yield hook
    hook.gate.set()


# -- the contract every pool keeps -------------------------------------------------------------


async def test_fill_then_copy_out_round_trips(make_pool: MakePool, keys: list[bytes]) -> None:
    pool = make_pool(4)
    data = _blocks(1)[0]
    slot = _reserve(pool, keys[0])

    async def sink(view: memoryview) -> None:
        assert view.nbytes == BLOCK
        view[:] = data.tobytes()

    await pool.fill(slot, sink)
    pool.commit(slot)
    pinned = pool.pin(keys[0])
    assert pinned == slot
    assert np.array_equal((await _read_back(pool, [slot]))[0], data)
    pool.unpin(slot)
    assert _all_staging_free(pool)


async def test_copy_in_then_drain_round_trips(make_pool: MakePool, keys: list[bytes]) -> None:
    pool = make_pool(4)
    data = _blocks(3)
    slots = [_reserve(pool, k) for k in keys[:3]]
    await pool.copy_in(slots, [BlockBuffer(row.data) for row in data])
    for slot in slots:
        pool.commit(slot)
    seen: list[bytes] = []

    async def source(view: memoryview) -> None:
        assert view.readonly
        seen.append(bytes(view))

    for slot in slots:
        await pool.drain(slot, source)
    assert seen == [row.tobytes() for row in data]
    assert _all_staging_free(pool)


@pytest.mark.parametrize("block_bytes", [BLOCK, BIG_BLOCK])
async def test_batches_larger_than_staging_round_trip(
    make_pool: MakePool, block_bytes: int
) -> None:
    """Big blocks take the threaded host copy; more blocks than staging buffers take the
    retire-before-acquire path."""
    pool = make_pool(12, block_bytes, staging_buffers=3)
    data = _blocks(10, block_bytes)
    slots = [_reserve(pool, k) for k in block_keys(list(range(40)), 4)]
    await pool.copy_in(slots, [BlockBuffer(row.data) for row in data])
    for slot in slots:
        pool.commit(slot)
    assert np.array_equal(await _read_back(pool, slots), data)
    assert _all_staging_free(pool)


async def test_big_host_copies_run_in_the_pools_own_worker_threads(
    cuda: Cuda, host_copies: HostCopies, keys: list[bytes]
) -> None:
    """A staged host memcpy past the inline bound runs in a worker thread while the loop
    goes on, and holds no token of anyio's default thread limiter (the tiers share it)."""
    pool = cuda.pool(2, BIG_BLOCK)
    slot = _reserve(pool, keys[0])
    data = _blocks(1, BIG_BLOCK)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.copy_in, [slot], [BlockBuffer(data[0].data)])
        await _until(host_copies.entered)
        borrowed = anyio.to_thread.current_default_thread_limiter().borrowed_tokens
        host_copies.gate.set()  # before asserting: a failure must not wait for the thread
    assert host_copies.threads and host_copies.loop not in host_copies.threads
    assert borrowed == 0
    assert pool.slot_bytes(slot) == data[0].tobytes()
    pool.abort(slot)


async def test_a_cancelled_big_host_copy_keeps_its_staging_until_its_thread_returns(
    cuda: Cuda, host_copies: HostCopies, keys: list[bytes]
) -> None:
    """The worker thread is still writing into a staging buffer: cancelled, the store waits
    for it instead of giving the buffer back under it."""
    pool = cuda.pool(2, BIG_BLOCK, staging_buffers=2)
    slot = _reserve(pool, keys[0])
    scope, returned = anyio.CancelScope(), anyio.Event()

    async def store() -> None:
        with scope:
            await pool.copy_in([slot], [BlockBuffer(_blocks(1, BIG_BLOCK)[0].data)])
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(store)
        await _until(host_copies.entered)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        waited, held = not returned.is_set(), pool.transfer_statistics().engine_staging_free
        host_copies.gate.set()
    assert (waited, held) == (True, 1)
    assert scope.cancelled_caught
    assert _all_staging_free(pool)
    assert pool.transfer_statistics().operations_in_flight == 0
    pool.abort(slot)


async def test_failing_sink_leaves_the_slot_for_the_caller_to_abort(
    make_pool: MakePool, keys: list[bytes]
) -> None:
    pool = make_pool(2)
    slot = _reserve(pool, keys[0])

    async def sink(view: memoryview) -> None:
        raise OSError("tier read failed")

    with pytest.raises(OSError, match="tier read failed"):
        await pool.fill(slot, sink)
    assert pool.state_of(keys[0]) is SlotState.WRITING
    pool.abort(slot)
    assert pool.state_of(keys[0]) is SlotState.FREE
    assert _all_staging_free(pool)


async def test_cancelled_fill_and_drain_return_their_staging(
    make_pool: MakePool, keys: list[bytes]
) -> None:
    pool = make_pool(2)
    stalled = anyio.Event()

    async def stall(view: memoryview) -> None:
        stalled.set()
        await anyio.sleep_forever()

    slot = _reserve(pool, keys[0])
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.fill, slot, stall)
            await stalled.wait()
            scope.cancel()
    pool.abort(slot)  # what the manager does when a promotion is cancelled
    assert _all_staging_free(pool)

    slot = _reserve(pool, keys[1])
    await pool.copy_in([slot], [BlockBuffer(_blocks(1)[0].data)])
    pool.commit(slot)
    assert pool.pin(keys[1]) == slot
    stalled = anyio.Event()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.drain, slot, stall)
            await stalled.wait()
            scope.cancel()
    pool.unpin(slot)
    assert _all_staging_free(pool)
    stats = pool.statistics()
    assert (stats.pinned, stats.writing) == (0, 0)


async def test_manager_store_write_through_promote_and_load(make_pool: MakePool) -> None:
    tier = MemoryTier()
    keys = block_keys(list(range(40)), 4, namespace=os.urandom(8))
    data = _blocks(len(keys))
    async with TieringManager(make_pool(16), [tier]) as manager:
        assert await manager.store(keys, data) == len(keys)
    assert manager.statistics().writes.succeeded == len(keys)

    # A fresh pool: every block comes back by promotion from the tier.
    async with TieringManager(make_pool(16), [tier]) as manager:
        scheduler = OffloadScheduler(manager)
        assert await scheduler.lookup(keys, timeout=30) == len(keys)
        out = np.zeros_like(data)
        assert await manager.load(keys, out) == len(keys)
        assert np.array_equal(out, data)
        assert manager.statistics().promotions.succeeded == len(keys)


# -- CudaPool on any runtime -------------------------------------------------------------------


async def test_promotions_wait_for_a_staging_buffer_instead_of_allocating(
    cuda: Cuda, keys: list[bytes]
) -> None:
    pool = cuda.pool(4, staging_buffers=1)
    first_in, release_first = anyio.Event(), anyio.Event()
    entered: list[int] = []

    async def first(view: memoryview) -> None:
        entered.append(1)
        first_in.set()
        await release_first.wait()

    async def second(view: memoryview) -> None:
        entered.append(2)

    a, b = _reserve(pool, keys[0]), _reserve(pool, keys[1])
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.fill, a, first)
        await first_in.wait()
        tg.start_soon(pool.fill, b, second)
        await anyio.wait_all_tasks_blocked()
        assert entered == [1]  # the second promotion queues for the only buffer
        assert pool.transfer_statistics().staging_waits == 1
        release_first.set()
    assert entered == [1, 2]
    assert pool.transfer_statistics().upload_staging_free == 1


async def test_write_throughs_parked_on_a_slow_tier_do_not_stall_engine_copies(
    cuda: Cuda, keys: list[bytes]
) -> None:
    """Every download staging buffer is held by a write-through whose tier is stuck; an
    engine load into host memory still runs (it has staging of its own)."""
    pool = cuda.pool(4, staging_buffers=2)
    data = _blocks(3)
    slots = [_reserve(pool, k) for k in keys[:3]]
    await pool.copy_in(slots, [BlockBuffer(row.data) for row in data])
    for slot in slots:
        pool.commit(slot)
    parked, release = 0, anyio.Event()
    both_parked = anyio.Event()

    async def slow_tier(view: memoryview) -> None:
        nonlocal parked
        parked += 1
        if parked == 2:
            both_parked.set()
        await release.wait()

    async with anyio.create_task_group() as tg:
        for slot in slots[:2]:
            tg.start_soon(pool.drain, slot, slow_tier)
        await both_parked.wait()
        assert pool.transfer_statistics().download_staging_free == 0
        assert np.array_equal(await _read_back(pool, slots), data)
        release.set()
    assert _all_staging_free(pool)


async def test_a_batch_larger_than_staging_fills_in_one_sink_call(
    cuda: Cuda, keys: list[bytes]
) -> None:
    """A tier's batch load gets every view at once: two are staging buffers, three are host
    memory that follows through them; a failed view fails only its slot."""
    pool = cuda.pool(8, staging_buffers=2)
    slots = [_reserve(pool, k) for k in keys[:5]]
    data = _blocks(5)
    calls = 0

    async def sink(views: Sequence[memoryview]) -> list[Exception | None]:
        nonlocal calls
        calls += 1
        assert len(views) == 5
        for view, row in zip(views, data, strict=True):
            view[:] = row.tobytes()
        return [None, OSError("one block unreadable"), None, OSError("another"), None]

    outcomes = await pool.fill_many(slots, sink)
    assert calls == 1
    assert [type(o) for o in outcomes] == [type(None), OSError, type(None), OSError, type(None)]
    for i in (0, 2, 4):
        assert pool.slot_bytes(slots[i]) == data[i].tobytes()
    assert _all_staging_free(pool)
    for slot in slots:
        pool.abort(slot)


async def test_slot_bytes_land_in_device_memory(cuda: Cuda, keys: list[bytes]) -> None:
    pool = cuda.pool(2)
    data = _blocks(1)[0]
    slot = _reserve(pool, keys[0])
    await pool.copy_in([slot], [BlockBuffer(data.data)])
    assert pool.slot_bytes(slot) == data.tobytes()
    stats = pool.transfer_statistics()
    assert stats.bytes_to_device == BLOCK
    assert stats.abandoned_copies == 0


async def test_gpu_buffers_in_scattered_slots_round_trip(cuda: Cuda) -> None:
    """Slot runs that are contiguous on one side only are split, never merged."""
    pool = cuda.pool(8)
    keys = block_keys(list(range(32)), 4, namespace=os.urandom(8))
    slots = [_reserve(pool, k) for k in keys[:8]]
    order = [slots[i] for i in (2, 3, 0, 1, 7, 5)]  # runs (2,3) (0,1) 7 5
    data = _blocks(len(order))
    before = cuda.fake.calls.get("memcpyAsync", 0) if cuda.fake else 0
    await pool.copy_in(order, [BlockBuffer(None, a) for a in cuda.device_blocks(data)])
    if cuda.fake is not None:
        assert cuda.fake.calls["memcpyAsync"] - before == 4  # adjacent blocks merged
    for i, slot in enumerate(order):
        assert pool.slot_bytes(slot) == data[i].tobytes()
    out = cuda.device_blocks(np.zeros_like(data))
    await pool.copy_out(order[::-1], [BlockBuffer(None, a) for a in out])
    assert np.array_equal(cuda.read(out), data[::-1])
    for slot in slots:
        pool.abort(slot)


async def test_cuda_pool_checks_its_arguments(cuda: Cuda, keys: list[bytes]) -> None:
    count = cuda.runtime.getDeviceCount()
    with pytest.raises(InvalidArgumentError, match="device"):
        cuda.pool(2, device=count)
    with pytest.raises(InvalidArgumentError, match="staging_buffers"):
        cuda.pool(2, staging_buffers=0)
    with pytest.raises(InvalidArgumentError, match="engine_stream"):
        cuda.pool(2, engine_stream="default")

    class OtherDevice:
        ptr = 0
        device_id = 1

    with pytest.raises(InvalidArgumentError, match="engine_stream is on cuda:1"):
        cuda.pool(2, engine_stream=OtherDevice())
    pool = cuda.pool(2)
    slot = _reserve(pool, keys[0])
    short = _blocks(1, BLOCK // 2)
    with pytest.raises(InvalidArgumentError, match="holds 32768 bytes"):
        await pool.copy_in([slot], [BlockBuffer(short[0].data)])
    with pytest.raises(InvalidArgumentError, match="holds 32768 bytes"):
        await pool.copy_in([slot], [BlockBuffer(None, cuda.device_blocks(short)[0])])
    pool.abort(slot)
    assert _all_staging_free(pool)


async def test_closed_cuda_pool_refuses_copies(cuda: Cuda, keys: list[bytes]) -> None:
    pool = cuda.pool(2)
    slot = _reserve(pool, keys[0])
    await pool.aclose()
    await pool.aclose()  # idempotent
    with pytest.raises(LifecycleError):
        await pool.copy_in([slot], [BlockBuffer(_blocks(1)[0].data)])
    assert "closed" in repr(pool)


async def test_close_frees_device_memory_pinned_staging_and_streams(fake: FakeCuda) -> None:
    allocations, streams = fake.live_allocations(), fake.live_streams()
    pool = CudaPool(4, BLOCK, runtime=fake)
    assert fake.live_allocations() == allocations + 4  # slots, three staging sets
    assert fake.live_streams() == streams + 3
    await pool.aclose()
    assert (fake.live_allocations(), fake.live_streams()) == (allocations, streams)


# -- ordering, cancellation, close and errors (on the stand-in) --------------------------------


@pytest.mark.parametrize("named_by", ["the buffer", "the pool's engine_stream"])
async def test_device_copies_wait_for_the_engine_stream(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes], named_by: str
) -> None:
    """A store from a GPU buffer the engine is still writing copies what it wrote, whether
    the buffer names the engine's stream or the pool's ``engine_stream`` option does (the
    buffer then says nothing: the option decides)."""
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    by_option = named_by != "the buffer"
    pool = cuda.pool(2, engine_stream=engine) if by_option else cuda.pool(2)
    slot = _reserve(pool, keys[0])
    old, new = _blocks(2)
    [array] = cuda.device_blocks(old[None], stream=None if by_option else engine)
    gate = fake.hold(stream=engine)
    fake.enqueue_write(engine, array.ptr, new.tobytes())  # the engine's own pending write
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.copy_in, [slot], [BlockBuffer(None, array)])
        await _until(gate.reached)
        await _quiet(fake)
        assert fake.log == []  # the pool's copy waits behind the engine's write
        fake.release(gate)
    assert pool.slot_bytes(slot) == new.tobytes()
    pool.abort(slot)


async def test_a_cancelled_copy_delayed_on_the_engine_stream_waits_for_it(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """A store from a GPU buffer, queued behind the engine's own write and cancelled there,
    waits (shielded, within settle_timeout) for the copy it enqueued rather than abandoning
    it: once the engine moves on, the copy lands and nothing is fenced."""
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    pool = cuda.pool(2, settle_timeout=HUNG_FAILSAFE)
    slot = _reserve(pool, keys[0])
    old, new = _blocks(2)
    [array] = cuda.device_blocks(old[None], stream=engine)
    gate = fake.hold(stream=engine)
    fake.enqueue_write(engine, array.ptr, new.tobytes())
    scope, returned = anyio.CancelScope(), anyio.Event()

    async def store() -> None:
        with scope:
            await pool.copy_in([slot], [BlockBuffer(None, array)])
        returned.set()

    copies = fake.calls.get("memcpyAsync", 0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(store)
        await _until(gate.reached)
        # The pool's copy is queued behind the engine's write (its CUDA thread may still be
        # enqueueing it when the streams are already quiet).
        await anyio.to_thread.run_sync(
            fake.wait_until, lambda: fake.calls.get("memcpyAsync", 0) > copies
        )
        await _quiet(fake)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        waited, in_flight = not returned.is_set(), pool.transfer_statistics().operations_in_flight
        fake.release(gate)
    assert (waited, in_flight) == (True, 1)  # cancelled, it still waited for its copy
    assert scope.cancelled_caught
    stats = pool.transfer_statistics()
    assert (stats.abandoned_copies, stats.operations_in_flight) == (0, 0)
    assert pool.slot_bytes(slot) == new.tobytes()
    pool.abort(slot)


async def test_a_cancelled_copy_stuck_behind_the_engine_stream_is_abandoned_and_fences_it(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """The same store with the engine's stream stuck past settle_timeout: abandoned, it
    fences the engine's stream, so the engine's next write to the buffer (its allocator
    reuses it) runs only after the copy read it."""
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    pool = cuda.pool(2, settle_timeout=0.01)
    slot = _reserve(pool, keys[0])
    old, new, reused = _blocks(3)
    [array] = cuda.device_blocks(old[None], stream=engine)
    stuck = fake.hold(stream=engine)
    fake.enqueue_write(engine, array.ptr, new.tobytes())
    copy = fake.hold(kind=fake.memcpyDeviceToDevice)  # the pool's copy, once it may run
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.copy_in, [slot], [BlockBuffer(None, array)])
            await _quiet(fake)
            scope.cancel()
    assert pool.transfer_statistics().abandoned_copies == 1
    fake.release(stuck)
    fake.enqueue_write(engine, array.ptr, reused.tobytes())
    await _quiet(fake)  # behind the fence; unfenced, the engine's write would have run
    assert array.read() == new.tobytes()
    fake.release(copy)
    await _quiet(fake)
    assert pool.slot_bytes(slot) == new.tobytes()
    assert array.read() == reused.tobytes()
    pool.abort(slot)


async def _cancel_when_parked(gate: Hold, operation: Any, *args: Any) -> None:
    """Run ``operation`` until the stand-in parks its copy at ``gate``, then cancel it."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(operation, *args)
            await _until(gate.reached)
            scope.cancel()


async def test_an_abandoned_device_copy_fences_the_engine_stream(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """A load into a GPU buffer, stuck past settle_timeout and cancelled, must land before
    anything the engine queues on its stream afterwards (its allocator reuses the buffer)."""
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    pool = cuda.pool(2, settle_timeout=0.01)
    slot = _reserve(pool, keys[0])
    stored, reused = _blocks(2)
    await pool.copy_in([slot], [BlockBuffer(stored.data)])
    pool.commit(slot)
    assert pool.pin(keys[0]) == slot
    [out] = cuda.device_blocks(np.zeros((1, BLOCK), np.uint8), stream=engine)
    gate = fake.hold(kind=fake.memcpyDeviceToDevice)
    await _cancel_when_parked(gate, pool.copy_out, [slot], [BlockBuffer(None, out)])
    assert pool.transfer_statistics().abandoned_copies == 1
    ptr, kept = out.ptr, weakref.ref(out)
    del out
    gc.collect()
    assert kept() is not None  # the pool holds the engine's array until the copy lands
    fake.enqueue_write(engine, ptr, reused.tobytes())  # the engine reuses the memory
    await _quiet(fake)
    fake.release(gate)
    await _quiet(fake)  # the abandoned copy and the engine's write have both run
    assert fake.peek(ptr, BLOCK) == reused.tobytes()  # the abandoned copy landed first
    # A later copy on the same stream completes after it: by then the array is let go.
    [again] = cuda.device_blocks(np.zeros((1, BLOCK), np.uint8), stream=engine)
    await pool.copy_out([slot], [BlockBuffer(None, again)])
    gc.collect()
    assert kept() is None
    pool.unpin(slot)


async def test_an_abandoned_read_fences_later_writes_to_its_slot(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """A write-through stuck past settle_timeout keeps its staging buffer until it lands,
    and a promotion into the same slot afterwards waits for it."""
    pool = cuda.pool(2, staging_buffers=2, settle_timeout=0.01)
    slot = _reserve(pool, keys[0])
    await pool.copy_in([slot], [BlockBuffer(_blocks(1)[0].data)])
    pool.commit(slot)
    gate = fake.hold(kind=fake.memcpyDeviceToHost)

    async def source(view: memoryview) -> None:
        raise AssertionError("the copy never finished")

    await _cancel_when_parked(gate, pool.drain, slot, source)
    stats = pool.transfer_statistics()
    assert (stats.abandoned_copies, stats.download_staging_free) == (1, 1)
    assert pool.discard(keys[0])
    slot = _reserve(pool, keys[1])  # the manager hands the slot to someone else

    async def sink(view: memoryview) -> None:
        view[:] = bytes(BLOCK)

    fill_done = anyio.Event()

    async def fill() -> None:
        await pool.fill(slot, sink)
        fill_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(fill)
        await _quiet(fake)
        assert not fill_done.is_set()  # behind the fence
        assert [kind for kind, _, _ in fake.log].count(fake.memcpyHostToDevice) == 1
        fake.release(gate)
    kinds = [kind for kind, _, _ in fake.log]
    assert kinds[-2:] == [fake.memcpyDeviceToHost, fake.memcpyHostToDevice]
    # The read's buffer goes back when the loop learns that it landed, from the download
    # lane's waiter, which may be after the fill returned: close waits for every lane.
    await pool.aclose()
    assert _all_staging_free(pool)
    pool.abort(slot)


async def test_an_abandoned_copy_without_an_event_gets_a_fence_of_its_own(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """Recording the copy's event failed and the copy outlives settle_timeout: a new event
    fences its slot, and is destroyed once the copy lands."""
    pool = cuda.pool(2, settle_timeout=0.01)
    slot = _reserve(pool, keys[0])
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    fake.refuse("eventRecord")

    async def sink(view: memoryview) -> None:
        view[:] = bytes(BLOCK)

    await _cancel_when_parked(gate, pool.fill, slot, sink)
    assert pool.transfer_statistics().abandoned_copies == 1
    destroyed = fake.calls.get("eventDestroy", 0)
    fake.release(gate)
    await pool.copy_in([slot], [BlockBuffer(_blocks(1)[0].data)])  # behind the fence
    # The fence is destroyed by the thread that saw it complete, which may come after the
    # copy behind it has returned.
    await anyio.to_thread.run_sync(
        fake.wait_until, lambda: fake.calls.get("eventDestroy", 0) > destroyed
    )
    await _quiet(fake)
    assert fake.calls.get("eventDestroy", 0) == destroyed + 1
    assert _all_staging_free(pool)
    pool.abort(slot)


async def test_close_waits_for_an_operation_parked_in_a_sink(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """The tier is still writing into pinned memory: close frees nothing until it is done,
    and the promotion, resumed after close began, enqueues no copy."""
    allocations = fake.live_allocations()
    pool = cuda.pool(2)
    slot = _reserve(pool, keys[0])
    in_sink, resume = anyio.Event(), anyio.Event()

    async def sink(view: memoryview) -> None:
        in_sink.set()
        await resume.wait()
        view[:] = bytes(BLOCK)

    failures: list[BaseException] = []

    async def fill() -> None:
        try:
            await pool.fill(slot, sink)
        except LifecycleError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(fill)
        await in_sink.wait()
        closed = anyio.Event()

        async def close() -> None:
            await pool.aclose()
            closed.set()

        tg.start_soon(close)
        # A bound on something that must not happen: a correct pool never gets there.
        with anyio.move_on_after(0.5):
            await closed.wait()
        assert not closed.is_set()
        assert fake.live_allocations() == allocations + 4  # nothing freed under the sink
        resume.set()
    assert len(failures) == 1
    assert fake.calls.get("memcpyAsync", 0) == 0
    assert fake.live_allocations() == allocations
    pool.abort(slot)


async def test_close_keeps_memory_a_wedged_copy_may_touch(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    allocations = fake.live_allocations()
    pool = cuda.pool(2, settle_timeout=0.01)
    slot = _reserve(pool, keys[0])
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.copy_in, [slot], [BlockBuffer(_blocks(1)[0].data)])
        await _until(gate.reached)
        await pool.aclose()  # gives up after settle_timeout: the copy is still queued
        assert fake.live_allocations() == allocations + 4
        fake.release(gate)
    pool.abort(slot)


async def test_close_gives_up_on_a_waiter_stuck_on_a_copy(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter still waits on an abandoned copy as close begins: the marks close queues
    behind it never complete, so close gives up after settle_timeout, says so, and frees
    nothing the copy may touch."""
    allocations, streams = fake.live_allocations(), fake.live_streams()
    pool = cuda.pool(2, settle_timeout=1.0)
    slot = _reserve(pool, keys[0])
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    await _cancel_when_parked(gate, pool.copy_in, [slot], [BlockBuffer(_blocks(1)[0].data)])
    assert pool.transfer_statistics().abandoned_copies == 1
    with _failsafe(fake), anyio.fail_after(HUNG_FAILSAFE / 2):
        await pool.aclose()
    assert "its memory is kept" in caplog.text
    assert "did not finish" not in caplog.text  # the drain gave up, not the free's bound
    assert (fake.live_allocations(), fake.live_streams()) == (allocations + 4, streams + 3)
    fake.release(gate)
    pool.abort(slot)


async def test_close_gives_up_on_a_free_held_up_by_the_engines_stream(
    cuda: Cuda, fake: FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    """cudaFree waits for the whole device, the engine's streams included: with one stuck,
    close returns after its bound and says so; the memory is freed once the stream moves."""
    engine = fake.streamCreateWithFlags(fake.streamNonBlocking)
    [array] = cuda.device_blocks(_blocks(1))
    allocations = fake.live_allocations()
    pool = cuda.pool(2, settle_timeout=1.0)  # the free's bound is twice that
    stuck = fake.hold(stream=engine)
    fake.enqueue_write(engine, array.ptr, bytes(BLOCK))
    with _failsafe(fake), anyio.fail_after(HUNG_FAILSAFE / 2):
        await pool.aclose()
    assert "freeing its memory did not finish" in caplog.text
    assert fake.live_allocations() == allocations + 5  # the slots, staging, the engine's source
    fake.release(stuck)
    await anyio.to_thread.run_sync(
        fake.wait_until, lambda: fake.live_allocations() == allocations + 1
    )


@pytest.mark.parametrize(("refused", "skip"), [("eventRecord", 0), ("memcpyAsync", 1)])
async def test_an_enqueue_error_releases_staging_only_after_the_copy_landed(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes], refused: str, skip: int
) -> None:
    """Recording the completion event fails after the copy was enqueued, or the second copy
    of a batch is refused after the first: the buffers stay out until the stream drained."""
    pool = cuda.pool(4, staging_buffers=4)
    slots = [_reserve(pool, k) for k in keys[:4]]
    order = [slots[0], slots[2]]  # two runs: two copies
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    fake.refuse(refused, skip)
    failures: list[BaseException] = []

    async def copy_in() -> None:
        try:
            await pool.copy_in(order, [BlockBuffer(row.data) for row in _blocks(2)])
        except FakeCudaError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(copy_in)
        await _until(gate.reached)
        await _quiet(fake)
        assert failures == []
        assert pool.transfer_statistics().engine_staging_free == 2  # the DMA may still run
        fake.release(gate)
    assert len(failures) == 1 and "refused" in str(failures[0])
    assert _all_staging_free(pool)
    for slot in slots:
        pool.abort(slot)


async def test_a_context_error_mid_batch_fails_every_pending_operation(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """An illegal access kills the context: the batch that hit it, and a write-through
    waiting on another stream, fail instead of hanging; staging is accounted for and close
    returns."""
    pool = cuda.pool(8, staging_buffers=4)
    ready = _reserve(pool, keys[7])
    await pool.copy_in([ready], [BlockBuffer(_blocks(1)[0].data)])
    pool.commit(ready)
    assert pool.pin(keys[7]) == ready
    slots = [_reserve(pool, k) for k in keys[:6]]
    held = fake.hold(kind=fake.memcpyDeviceToHost)
    fake.fault(kind=fake.memcpyHostToDevice, skip=1)  # the second chunk's copy faults
    errors: list[str] = []

    async def source(view: memoryview) -> None:
        raise AssertionError("no bytes after a context error")

    async def run(operation: Any, *args: Any) -> None:
        try:
            await operation(*args)
        except FakeCudaError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, pool.drain, ready, source)
        await _until(held.reached)
        blocks = [BlockBuffer(row.data) for row in _blocks(6)]
        tg.start_soon(run, pool.copy_in, slots, blocks)
    assert len(errors) == 2 and all("illegal address" in e for e in errors)
    assert _all_staging_free(pool)
    assert pool.transfer_statistics().operations_in_flight == 0
    for slot in slots:
        pool.abort(slot)
    pool.unpin(ready)
    await pool.aclose()  # the frees fail on a dead context: logged, not raised


async def test_a_copy_slower_than_copy_timeout_fails_and_is_abandoned(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    """A wedged copy fails its operation after copy_timeout; its staging buffer comes back
    only once the copy lands (a later copy on the same stream lands after it)."""
    pool = cuda.pool(4, staging_buffers=2, copy_timeout=0.01, settle_timeout=0.01)
    first, second = _reserve(pool, keys[0]), _reserve(pool, keys[1])
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    with pytest.raises(TimeoutError):
        await pool.copy_in([first], [BlockBuffer(_blocks(1)[0].data)])
    stats = pool.transfer_statistics()
    assert (stats.abandoned_copies, stats.engine_staging_free) == (1, 1)
    fake.release(gate)
    await pool.copy_in([second], [BlockBuffer(_blocks(1)[0].data)])
    assert _all_staging_free(pool)
    pool.abort(first)
    pool.abort(second)


async def test_waits_hold_no_default_thread_limiter_tokens(
    cuda: Cuda, fake: FakeCuda, keys: list[bytes]
) -> None:
    pool = cuda.pool(4)
    slots = [_reserve(pool, k) for k in keys[:3]]
    gate = fake.hold(kind=fake.memcpyHostToDevice)
    async with anyio.create_task_group() as tg:
        for slot in slots:
            tg.start_soon(pool.copy_in, [slot], [BlockBuffer(_blocks(1)[0].data)])
        await _until(gate.reached)
        await anyio.wait_all_tasks_blocked()
        limiter = anyio.to_thread.current_default_thread_limiter()
        assert limiter.borrowed_tokens == 0
        assert pool.transfer_statistics().operations_in_flight == 3
        fake.release(gate)
    for slot in slots:
        pool.abort(slot)


def test_no_python_host_function_runs_on_a_cuda_stream() -> None:
    package = pathlib.Path(__file__).parents[2] / "kvtier"
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert "launch_host_func" not in text and "LaunchHostFunc" not in text, path


# -- engine buffers on the GPU, torch and CuPy (both pools, real GPU only) ---------------------


def _torch_cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch"
    return True, ""


@pytest.fixture
def gpu() -> None:
    """Skips the test where CuPy sees no GPU."""
    if not CUDA_OK:
        pytest.skip(CUDA_REASON)


def _gpu_blocks(framework: str, data: np.ndarray) -> Any:
    if framework == "torch":
        ok, reason = _torch_cuda()
        if not ok:
            pytest.skip(reason)
        import torch

        return torch.from_numpy(data).to("cuda").view(torch.float16)
    import cupy

    return cupy.asarray(data).view(cupy.float16)


def _to_numpy(framework: str, array: Any) -> np.ndarray:
    if framework == "torch":
        import torch

        result: np.ndarray = array.view(torch.uint8).cpu().numpy()
        return result
    import cupy

    host: np.ndarray = cupy.asnumpy(array.view(cupy.uint8))
    return host


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["host", "cuda"])
@pytest.mark.parametrize("framework", ["torch", "cupy"])
async def test_gpu_engine_buffers_round_trip(gpu: None, kind: str, framework: str) -> None:
    keys = block_keys(list(range(24)), 4, namespace=os.urandom(8))
    data = _blocks(len(keys))
    blocks = _gpu_blocks(framework, data)
    pool = HostPool(8, BLOCK) if kind == "host" else CudaPool(8, BLOCK)
    async with TieringManager(pool, dtype="float16") as manager:
        assert await manager.store(keys, blocks) == len(keys)
        out = _gpu_blocks(framework, np.zeros_like(data))
        assert await manager.load(keys, out) == len(keys)
    await pool.aclose()
    assert np.array_equal(_to_numpy(framework, out), data)


@pytest.mark.gpu
async def test_loads_follow_an_explicit_torch_engine_stream(gpu: None, keys: list[bytes]) -> None:
    ok, reason = _torch_cuda()
    if not ok:
        pytest.skip(reason)
    import torch

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    pool = CudaPool(4, BLOCK, engine_stream=stream)
    try:
        data = _blocks(2)
        with torch.cuda.stream(stream):
            src = torch.from_numpy(data).to("cuda", non_blocking=True)
            out = torch.zeros_like(src)
        async with TieringManager(pool) as manager:
            assert await manager.store(keys[:2], src) == 2
            assert await manager.load(keys[:2], out) == 2
        assert np.array_equal(out.cpu().numpy(), data)
    finally:
        await pool.aclose()


# -- without a GPU -----------------------------------------------------------------------------


@pytest.mark.skipif(CUDA_OK, reason="a CUDA GPU is visible")
def test_cuda_pool_without_a_gpu_says_why() -> None:
    with pytest.raises((ExtraNotInstalledError, CudaUnavailableError)) as info:
        CudaPool(2, BLOCK)
    message = str(info.value)
    if isinstance(info.value, ExtraNotInstalledError):
        assert "cupy" in message
        assert "kvtier[cuda]" in message
        assert CUDA_REASON == "no CUDA GPU: cupy not installed"
    else:
        assert "no CUDA device visible" in message
        assert "HostPool" in message


def test_two_cupy_builds_are_refused_before_cupy_warns() -> None:
    assert cupy_packages(["numpy", "cupy-cuda12x", "cupy_cuda13x", "anyio"]) == [
        "cupy-cuda12x",
        "cupy-cuda13x",
    ]
    assert cupy_packages(["cupy-cuda12x", "fastrlock"]) == ["cupy-cuda12x"]


def test_import_kvtier_and_host_pool_need_no_cupy() -> None:
    code = (
        "import sys, kvtier\n"
        "kvtier.HostPool(2, 64)\n"
        "import kvtier.pools._cuda\n"
        "assert 'cupy' not in sys.modules, 'cupy imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=60)
