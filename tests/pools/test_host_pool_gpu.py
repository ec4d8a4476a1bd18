"""HostPool with engine buffers on a GPU, on the CUDA stand-in (``devtools.fake_cuda``): copies
in batches on the engine's stream with one event each, never a wait for the engine's whole
stream; the mapping page-locked once; no CUDA call on the event loop thread, none at all for a
pool that only sees host buffers, and no context on a GPU the buffers are not on.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from devtools.fake_cuda import FakeCuda, FakeCudaError, FakeDeviceArray
from kvtier import HostPool, InvalidArgumentError
from kvtier.common._buffers import BlockBuffer
from kvtier.pools import _cupy
from tests.pools.stand_in import close_on_stand_in, threads_parked_at
from tests.support import fresh_keys

BLOCK = 64 * 1024
PoolOf = Callable[..., HostPool]


@pytest.fixture
async def pool_of(fake: FakeCuda) -> AsyncIterator[PoolOf]:
    """Builds HostPools on the stand-in; closes them and checks that no copy touched memory
    it must not and that closing left nothing registered or allocated."""
    pools: list[HostPool] = []

    def make(num_blocks: int, **options: Any) -> HostPool:
        pool = HostPool(num_blocks, BLOCK, runtime=fake, **options)
        pools.append(pool)
        return pool

    yield make
    await close_on_stand_in(fake, pools)
    assert fake.registered_bytes() == 0
    assert fake.live_events() == 0


def _blocks(n: int) -> np.ndarray:
    return np.random.default_rng(n + 11).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def _slots(pool: HostPool, n: int) -> list[int]:
    slots = [pool.try_reserve(key) for key in fresh_keys(n)]
    assert None not in slots
    return [s for s in slots if s is not None]


def _engine(fake: FakeCuda, data: np.ndarray, stream: int | None, device: int = 0) -> list[Any]:
    """One engine tensor of ``data``'s rows, handed over as one GPU array per block."""
    whole = FakeDeviceArray(fake, data.nbytes, stream=stream, device=device)
    whole.write(data.tobytes())
    return whole.split(len(data))


def _read(arrays: list[Any]) -> bytes:
    return b"".join(array.read() for array in arrays)


async def _stream(fake: FakeCuda, device: int = 0) -> int:
    """The engine's non-blocking stream on ``device``, made off the loop thread."""

    def make() -> int:
        fake.setDevice(device)
        return fake.streamCreateWithFlags(fake.streamNonBlocking)

    return await anyio.to_thread.run_sync(make)


def _counts(fake: FakeCuda, before: dict[str, int]) -> dict[str, int]:
    names = ("memcpyAsync", "eventRecord", "eventSynchronize", "streamSynchronize", "memcpy")
    return {name: fake.calls.get(name, 0) - before.get(name, 0) for name in names}


ONE_BATCH = {
    "memcpyAsync": 1,
    "eventRecord": 1,
    "eventSynchronize": 1,
    "streamSynchronize": 0,
    "memcpy": 0,
}


async def test_gpu_buffers_are_copied_in_batches_with_one_event_each(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four adjacent blocks of one engine tensor, stored and loaded back through the default
    runtime (CuPy's, made when the first GPU buffer arrives): one copy and one event per
    batch, never a synchronisation of the engine's whole stream or a copy per block."""
    monkeypatch.setattr(_cupy, "cupy_runtime", lambda: fake)
    pool = HostPool(8, BLOCK)
    try:
        slots = _slots(pool, 4)
        assert slots == list(range(slots[0], slots[0] + 4))
        stream = await _stream(fake)
        data = _blocks(4)
        before = dict(fake.calls)
        await pool.copy_in(slots, [BlockBuffer(None, a) for a in _engine(fake, data, stream)])
        assert _counts(fake, before) == ONE_BATCH
        assert b"".join(pool.copy_slot(s) for s in slots) == data.tobytes()
        for slot in slots:
            pool.commit(slot)
        out = _engine(fake, np.zeros_like(data), stream)
        before = dict(fake.calls)
        await pool.copy_out(slots, [BlockBuffer(None, a) for a in out])
        assert _counts(fake, before) == ONE_BATCH
        assert _read(out) == data.tobytes()
        assert fake.calls["hostRegister"] == 1
    finally:
        await pool.aclose()
    assert fake.violations == []
    assert fake.registered_bytes() == 0
    assert fake.live_events() == 0


async def test_a_store_waits_for_the_engines_queued_work_on_its_stream(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    """The engine's write, still queued on its stream, lands before the store reads the
    block: the copy follows it on that stream, with no synchronisation first."""
    pool = pool_of(4)
    stream = await _stream(fake)
    (slot,) = _slots(pool, 1)
    (array,) = _engine(fake, np.zeros((1, BLOCK), np.uint8), stream)
    data = _blocks(1)[0]
    gate = fake.hold(kind=fake.memcpyHostToDevice, stream=stream)
    fake.enqueue_write(stream, array.ptr, data.tobytes())
    stored = anyio.Event()

    async def store() -> None:
        await pool.copy_in([slot], [BlockBuffer(None, array)])
        stored.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(store)
        await anyio.to_thread.run_sync(gate.reached.wait, 30)
        await anyio.to_thread.run_sync(fake.wait_quiet)
        assert not stored.is_set()
        fake.release(gate)
    assert pool.copy_slot(slot) == data.tobytes()
    assert fake.calls.get("streamSynchronize", 0) == 0
    pool.abort(slot)


async def test_a_batch_of_host_and_gpu_buffers_is_one_trip(fake: FakeCuda, pool_of: PoolOf) -> None:
    pool = pool_of(4)
    stream = await _stream(fake)
    slots = _slots(pool, 3)
    data = _blocks(3)
    gpu = _engine(fake, data[1:], stream)
    blocks = [BlockBuffer(data[0].data), *(BlockBuffer(None, a) for a in gpu)]
    await pool.copy_in(slots, blocks)
    assert b"".join(pool.copy_slot(s) for s in slots) == data.tobytes()
    for slot in slots:
        pool.commit(slot)
    host = np.zeros(BLOCK, np.uint8)
    out = _engine(fake, np.zeros((2, BLOCK), np.uint8), stream)
    await pool.copy_out(slots, [BlockBuffer(host.data), *(BlockBuffer(None, a) for a in out)])
    assert host.tobytes() + _read(out) == data.tobytes()
    with pytest.raises(InvalidArgumentError, match="no memory"):
        await pool.copy_out(slots[:1], [BlockBuffer(None)])


async def test_a_pool_that_sees_only_host_buffers_makes_no_cuda_call(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    pool = pool_of(40)
    slots = _slots(pool, 20)  # past the inline bound: the copy goes to a thread
    data = np.random.default_rng(3).integers(0, 256, (20, BLOCK), dtype=np.uint8)
    await pool.copy_in(slots, [BlockBuffer(row.data) for row in data])
    for slot in slots:
        pool.commit(slot)
    out = np.zeros_like(data)
    await pool.copy_out(slots, [BlockBuffer(row.data) for row in out])
    await pool.aclose()
    assert np.array_equal(out, data)
    assert fake.calls == {}


async def test_the_mapping_is_page_locked_once_and_released_at_close(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    pool = pool_of(8)
    stream = await _stream(fake)
    slots = _slots(pool, 4)
    for batch in (slots[:2], slots[2:]):
        arrays = _engine(fake, _blocks(2), stream)
        await pool.copy_in(batch, [BlockBuffer(None, a) for a in arrays])
    assert fake.calls["hostRegister"] == 1
    assert fake.registered_bytes() == 8 * BLOCK
    assert fake.live_events() == 1  # one event, reused batch after batch
    for slot in slots:
        pool.abort(slot)
    await pool.aclose()
    assert fake.registered_bytes() == 0
    assert fake.live_events() == 0


async def test_buffers_on_gpu_1_make_no_context_on_gpu_0(fake: FakeCuda, pool_of: PoolOf) -> None:
    """Neither the loop thread nor the worker threads chose a device: registering, copying,
    waiting and closing must happen on the buffers' device without making device 0's
    context."""
    pool = pool_of(4)
    stream = await _stream(fake, device=1)
    slots = _slots(pool, 2)
    data = _blocks(2)
    await pool.copy_in(slots, [BlockBuffer(None, a) for a in _engine(fake, data, stream, 1)])
    for slot in slots:
        pool.commit(slot)
    out = _engine(fake, np.zeros_like(data), stream, 1)
    await pool.copy_out(slots, [BlockBuffer(None, a) for a in out])
    await pool.aclose()
    assert _read(out) == data.tobytes()
    assert set(fake.contexts) == {1}, f"contexts made by {fake.contexts}"


async def test_a_wait_neither_breaks_nor_is_refused_by_an_engines_graph_capture(
    fake: FakeCuda, pool_of: PoolOf
) -> None:
    pool = pool_of(2)
    stream = await _stream(fake)
    captured = await _stream(fake)
    (slot,) = _slots(pool, 1)
    data = _blocks(1)
    capture: list[Any] = []
    starter = threading.Thread(target=lambda: capture.append(fake.begin_capture(captured)))
    starter.start()
    starter.join()
    try:
        await pool.copy_in([slot], [BlockBuffer(None, _engine(fake, data, stream)[0])])
    finally:
        refused = list(capture[0].refused)
        with contextlib.suppress(FakeCudaError):
            fake.end_capture(capture[0])
    assert refused == [], f"the pool's {refused} broke the engine's capture"
    assert pool.copy_slot(slot) == data.tobytes()
    pool.abort(slot)


@pytest.mark.parametrize("call", ["memcpyAsync", "eventRecord", "pointerGetAttributes"])
async def test_a_cuda_call_that_blocks_never_blocks_the_event_loop(
    fake: FakeCuda, pool_of: PoolOf, call: str
) -> None:
    pool = pool_of(2)
    stream = await _stream(fake)
    (slot,) = _slots(pool, 1)
    data = _blocks(1)
    array = _engine(fake, data, stream)[0]
    copy = functools.partial(pool.copy_in, [slot], [BlockBuffer(None, array)])
    parked = await threads_parked_at(fake, call, copy)
    assert threading.get_ident() not in parked, f"{call} blocked the event loop thread"
    assert pool.copy_slot(slot) == data.tobytes()
    pool.abort(slot)
