"""The primary-pool contract, run on HostPool everywhere and on CudaPool where a GPU is visible
(both completion modes), plus CudaPool specifics: bounded staging, cancellation, GPU buffers.

Without a GPU (CI) every ``cuda-*`` case skips with the reason ``cuda_available()`` gives.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier import (
    ExtraNotInstalledError,
    InvalidArgumentError,
    LifecycleError,
    OffloadScheduler,
    SlotState,
    TieringManager,
    block_keys,
)
from kvtier._buffers import BlockBuffer
from kvtier.pools._base import PrimaryPool
from kvtier.pools._cuda import CudaPool
from kvtier.pools._cupy import CudaUnavailableError, cuda_available
from kvtier.pools._host import HostPool
from kvtier.tiers._memory import MemoryTier

CUDA_OK, CUDA_REASON = cuda_available()
needs_gpu = pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)

BLOCK = 64 * 1024  # big enough that staged copies take the worker-thread path in batches


class MakePool:
    """Builds pools of one kind; CudaPool options are ignored for HostPool."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.pools: list[PrimaryPool] = []

    def __call__(
        self, num_blocks: int, block_bytes: int = BLOCK, **cuda_options: Any
    ) -> PrimaryPool:
        pool: PrimaryPool
        if self.kind == "host":
            pool = HostPool(num_blocks, block_bytes)
        else:
            completion = self.kind.removeprefix("cuda-")
            pool = CudaPool(num_blocks, block_bytes, completion=completion, **cuda_options)
        self.pools.append(pool)
        return pool


def _torch_cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch"
    return True, ""


@pytest.fixture(
    params=[
        "host",
        pytest.param("cuda-callback", marks=pytest.mark.gpu),
        pytest.param("cuda-thread", marks=pytest.mark.gpu),
    ]
)
async def make_pool(request: pytest.FixtureRequest) -> AsyncIterator[MakePool]:
    """Builds pools of the parametrised kind and closes them after the test."""
    kind: str = request.param
    if kind.startswith("cuda") and not CUDA_OK:
        pytest.skip(CUDA_REASON)
    make = MakePool(kind)
    yield make
    for pool in make.pools:
        pool.table.check_invariants()
        await pool.aclose()


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


def _staging_free(pool: PrimaryPool) -> tuple[int, int] | None:
    if isinstance(pool, CudaPool):
        stats = pool.transfer_statistics()
        assert stats.upload_staging_free <= stats.staging_buffers
        return stats.upload_staging_free, stats.download_staging_free
    return None


def _all_staging_free(pool: PrimaryPool) -> bool:
    free = _staging_free(pool)
    if free is None:
        return True
    assert isinstance(pool, CudaPool)
    return free == (pool.staging_buffers, pool.staging_buffers)


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


async def test_batches_larger_than_staging_round_trip(
    make_pool: MakePool, keys: list[bytes]
) -> None:
    pool = make_pool(24, staging_buffers=3)
    data = _blocks(20)
    slots = [_reserve(pool, k) for k in block_keys(list(range(80)), 4)]
    await pool.copy_in(slots, [BlockBuffer(row.data) for row in data])
    for slot in slots:
        pool.commit(slot)
    assert np.array_equal(await _read_back(pool, slots), data)
    assert _all_staging_free(pool)


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
    assert manager.statistics().cascades_succeeded == len(keys)

    # A fresh pool: every block comes back by promotion from the tier.
    async with TieringManager(make_pool(16), [tier]) as manager:
        scheduler = OffloadScheduler(manager)
        assert await scheduler.lookup(keys, timeout=30) == len(keys)
        out = np.zeros_like(data)
        assert await manager.load(keys, out) == len(keys)
        assert np.array_equal(out, data)
        assert manager.statistics().promotions_succeeded == len(keys)


# -- CudaPool specifics ------------------------------------------------------------------------


@needs_gpu
@pytest.mark.gpu
async def test_promotions_wait_for_a_staging_buffer_instead_of_allocating(
    keys: list[bytes],
) -> None:
    pool = CudaPool(4, BLOCK, staging_buffers=1)
    first_in, release_first = anyio.Event(), anyio.Event()
    entered: list[int] = []

    async def first(view: memoryview) -> None:
        entered.append(1)
        first_in.set()
        await release_first.wait()

    async def second(view: memoryview) -> None:
        entered.append(2)

    try:
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
    finally:
        await pool.aclose()


@needs_gpu
@pytest.mark.gpu
async def test_slot_bytes_land_in_device_memory(keys: list[bytes]) -> None:
    import cupy

    pool = CudaPool(2, BLOCK)
    try:
        data = _blocks(1)[0]
        slot = _reserve(pool, keys[0])
        await pool.copy_in([slot], [BlockBuffer(data.data)])
        assert np.array_equal(cupy.asnumpy(pool.slot_array(slot)), data)
        stats = pool.transfer_statistics()
        assert stats.bytes_to_device == BLOCK
        assert stats.abandoned_copies == 0
    finally:
        await pool.aclose()


@needs_gpu
@pytest.mark.gpu
async def test_cuda_pool_checks_its_arguments() -> None:
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(InvalidArgumentError, match="device"):
        CudaPool(2, BLOCK, device=count)
    with pytest.raises(InvalidArgumentError, match="staging_buffers"):
        CudaPool(2, BLOCK, staging_buffers=0)
    with pytest.raises(InvalidArgumentError, match="completion"):
        CudaPool(2, BLOCK, completion="poll")
    with pytest.raises(InvalidArgumentError, match="engine_stream"):
        CudaPool(2, BLOCK, engine_stream="default")


@needs_gpu
@pytest.mark.gpu
async def test_closed_cuda_pool_refuses_copies(keys: list[bytes]) -> None:
    pool = CudaPool(2, BLOCK)
    slot = _reserve(pool, keys[0])
    await pool.aclose()
    await pool.aclose()  # idempotent
    with pytest.raises(LifecycleError):
        await pool.copy_in([slot], [BlockBuffer(_blocks(1)[0].data)])
    assert "closed" in repr(pool)


# -- engine buffers on the GPU (both pools) ----------------------------------------------------


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


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "cupy"])
async def test_gpu_engine_buffers_round_trip(make_pool: MakePool, framework: str) -> None:
    keys = block_keys(list(range(24)), 4, namespace=os.urandom(8))
    data = _blocks(len(keys))
    blocks = _gpu_blocks(framework, data)
    async with TieringManager(make_pool(8), dtype="float16") as manager:
        assert await manager.store(keys, blocks) == len(keys)
        out = _gpu_blocks(framework, np.zeros_like(data))
        assert await manager.load(keys, out) == len(keys)
    assert np.array_equal(_to_numpy(framework, out), data)


@needs_gpu
@pytest.mark.gpu
async def test_loads_follow_an_explicit_engine_stream(keys: list[bytes]) -> None:
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


def test_import_kvtier_and_host_pool_need_no_cupy() -> None:
    code = (
        "import sys, kvtier\n"
        "kvtier.HostPool(2, 64)\n"
        "import kvtier.pools._cuda\n"
        "assert 'cupy' not in sys.modules, 'cupy imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=60)
