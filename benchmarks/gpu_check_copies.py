"""The copy measurements of ``benchmarks.gpu_check`` at 2 MiB blocks: CudaPool's promotions,
stores and engine copies beside raw CuPy copies of the same bytes, with the bytes checked.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

MiB = 1 << 20
BLOCK = 2 * MiB


# -- raw CuPy copies ---------------------------------------------------------------------------


class Raw:
    """Raw copies of ``blocks`` x 2 MiB between pinned host memory and device memory, with
    the same host work as the pool's realistic sinks and sources."""

    def __init__(self, cupy: Any, blocks: int, payload: list[bytes], path: str) -> None:
        import numpy as np

        self.np = np
        self.rt = cupy.cuda.runtime
        self.blocks = blocks
        self.payload = payload
        self.path = path
        nbytes = blocks * BLOCK
        self._host = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(nbytes), 0)
        self.host = np.frombuffer(self._host, np.uint8, nbytes)
        self.dev = cupy.cuda.Memory(nbytes)
        self.dev2 = cupy.cuda.Memory(nbytes)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.fd = os.open(path, os.O_RDONLY)

    def _copy(
        self, dst: int, src: int, kind: int, bulk: bool, host_work: Callable[[int], None]
    ) -> float:
        started = time.perf_counter()
        if bulk:
            for i in range(self.blocks):
                host_work(i)
            self.rt.memcpyAsync(dst, src, self.blocks * BLOCK, kind, self.stream.ptr)
        else:
            for i in range(self.blocks):
                off = i * BLOCK
                host_work(i)
                self.rt.memcpyAsync(dst + off, src + off, BLOCK, kind, self.stream.ptr)
        self.stream.synchronize()
        return float(time.perf_counter() - started)

    def _fill_host(self, sink: str) -> Callable[[int], None]:
        if sink == "noop":
            return lambda i: None
        if sink == "memcpy":

            def memcpy(i: int) -> None:
                chunk = self.host[i * BLOCK : (i + 1) * BLOCK]
                chunk[:] = self.np.frombuffer(self.payload[i % len(self.payload)], self.np.uint8)

            return memcpy

        def pread(i: int) -> None:
            view = self.host[i * BLOCK : (i + 1) * BLOCK].data
            os.preadv(self.fd, [view], (i % len(self.payload)) * BLOCK)

        return pread

    def h2d(self, sink: str, bulk: bool) -> float:
        host = int(self._host.ptr)
        kind = self.rt.memcpyHostToDevice
        return self._copy(int(self.dev.ptr), host, kind, bulk, self._fill_host(sink))

    def d2h(self, source: str, bulk: bool) -> float:
        host = int(self._host.ptr)
        kind = self.rt.memcpyDeviceToHost
        elapsed = self._copy(host, int(self.dev.ptr), kind, bulk, lambda i: None)
        started = time.perf_counter()
        if source == "memcpy":
            for i in range(self.blocks):
                bytes(self.host[i * BLOCK : (i + 1) * BLOCK].data)
        elif source == "file":
            with open(self.path + ".out", "wb") as f:
                for i in range(self.blocks):
                    f.write(self.host[i * BLOCK : (i + 1) * BLOCK].data)
        return elapsed + time.perf_counter() - started

    def d2d(self, bulk: bool) -> float:
        kind = self.rt.memcpyDeviceToDevice
        return self._copy(int(self.dev2.ptr), int(self.dev.ptr), kind, bulk, lambda i: None)

    def latency_us(self, n: int) -> float:
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            self.rt.memcpyAsync(
                self.dev.ptr,
                int(self._host.ptr),
                BLOCK,
                self.rt.memcpyHostToDevice,
                self.stream.ptr,
            )
            self.stream.synchronize()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1e6


def median_time(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm up
    return statistics.median(fn() for _ in range(repeats))


# -- CudaPool ----------------------------------------------------------------------------------


def _keys(blocks: int, salt: int) -> list[bytes]:
    import kvtier

    return kvtier.block_keys(list(range(blocks * 4)), 4, namespace=b"gpu-check-%d" % salt)


class Tier:
    """The host side of a promotion or a store, like a tier's: ``memcpy`` (MemoryTier),
    ``file`` (an FS tier reading or writing a page-cached file in a thread), ``noop``."""

    def __init__(self, kind: str, payload: list[bytes], path: str) -> None:
        self.kind = kind
        self.payload = payload
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        self.seen: dict[int, bytes] = {}

    def want(self, i: int) -> bytes:
        return self.payload[i % len(self.payload)]

    def sink(self, i: int) -> Callable[[memoryview], Awaitable[None]]:
        async def sink(view: memoryview) -> None:
            import anyio.to_thread

            if self.kind == "memcpy":
                view[:] = self.want(i)
            elif self.kind == "file":
                offset = (i % len(self.payload)) * BLOCK
                await anyio.to_thread.run_sync(os.preadv, self.fd, [view], offset)

        return sink

    def source(self, i: int) -> Callable[[memoryview], Awaitable[None]]:
        async def source(view: memoryview) -> None:
            import anyio.to_thread

            if self.kind == "memcpy":
                self.seen[i] = bytes(view)
            elif self.kind == "file":
                offset = (len(self.payload) + i) * BLOCK
                await anyio.to_thread.run_sync(os.pwritev, self.fd, [view], offset)

        return source


async def promote(pool: Any, keys: list[bytes], tier: Tier) -> float:
    import anyio

    slots = [pool.try_reserve(k) for k in keys]
    assert None not in slots
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, slot in enumerate(slots):
            tg.start_soon(pool.fill, slot, tier.sink(i))
    elapsed = time.perf_counter() - started
    for slot in slots:
        pool.commit(slot)
    return elapsed


async def store(pool: Any, keys: list[bytes], tier: Tier) -> float:
    import anyio

    slots = [pool.pin(k) for k in keys]
    assert None not in slots
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, slot in enumerate(slots):
            tg.start_soon(pool.drain, slot, tier.source(i))
    elapsed = time.perf_counter() - started
    for slot in slots:
        pool.unpin(slot)
    return elapsed


def check_slots(pool: Any, keys: list[bytes], tier: Tier, every: int) -> None:
    """The bytes in device memory are the ones the sink wrote (every ``every``-th block)."""
    for i in range(0, len(keys), every):
        slot = pool.pin(keys[i])
        assert slot is not None
        try:
            assert pool.slot_bytes(slot) == tier.want(i), f"slot {slot} holds wrong bytes"
        finally:
            pool.unpin(slot)


def check_stored(tier: Tier, blocks: int) -> None:
    """The bytes a store handed to the tier are the ones promoted."""
    for i in range(blocks):
        if tier.kind == "memcpy":
            got = tier.seen[i]
        elif tier.kind == "file":
            got = os.pread(tier.fd, BLOCK, (len(tier.payload) + i) * BLOCK)
        else:
            return
        assert got == tier.want(i), f"block {i} was stored with wrong bytes"


def clear(pool: Any, keys: list[bytes]) -> None:
    for key in keys:
        pool.discard(key)


async def pool_runs(
    staging: int, blocks: int, repeats: int, payload: list[bytes], path: str
) -> dict[str, float]:
    """Seconds (median) for promotion and store with each kind of tier."""
    from kvtier import CudaPool

    pool = CudaPool(blocks, BLOCK, staging_buffers=staging)
    out: dict[str, list[float]] = {}
    try:
        keys = _keys(blocks, staging)
        for kind in ("noop", "memcpy", "file"):
            # the store reads what the memcpy sink wrote: promote with memcpy bytes first
            reference = Tier("memcpy", payload, path)
            for rep in range(repeats + 1):  # the first round warms up
                tier = Tier(kind, payload, path)
                t_fill = await promote(pool, keys, tier)
                if kind != "noop":
                    check_slots(pool, keys, tier, 1 if rep == 0 else max(1, blocks // 8))
                clear(pool, keys)
                await promote(pool, keys, reference)
                t_store = await store(pool, keys, tier)
                check_stored(tier, blocks)
                clear(pool, keys)
                if rep:
                    out.setdefault(f"promote_{kind}", []).append(t_fill)
                    out.setdefault(f"store_{kind}", []).append(t_store)
                os.close(tier.fd)
            os.close(reference.fd)
        assert pool.transfer_statistics().abandoned_copies == 0
        return {name: statistics.median(times) for name, times in out.items()}
    finally:
        await pool.aclose()


async def latency_us(n: int) -> float:
    from kvtier import CudaPool

    async def noop(view: memoryview) -> None:
        return None

    pool = CudaPool(2, BLOCK)
    try:
        key = _keys(1, 99)[0]
        samples = []
        for _ in range(n + 5):
            slot = pool.try_reserve(key)
            assert slot is not None
            started = time.perf_counter()
            await pool.fill(slot, noop)
            samples.append(time.perf_counter() - started)
            pool.abort(slot)
        return statistics.median(samples[5:]) * 1e6
    finally:
        await pool.aclose()


async def torch_runs(blocks: int, repeats: int) -> dict[str, float] | str:
    """Engine store and load through a torch CUDA tensor (device-to-device), seconds."""
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from kvtier import CudaPool, TieringManager

    pool = CudaPool(blocks, BLOCK)
    keys = _keys(blocks, 7)
    src = torch.randint(0, 256, (blocks, BLOCK), dtype=torch.uint8, device="cuda")
    out = torch.zeros_like(src)
    torch.cuda.synchronize()
    stores: list[float] = []
    loads: list[float] = []
    try:
        async with TieringManager(pool) as manager:
            for rep in range(repeats + 1):
                out.zero_()
                torch.cuda.synchronize()
                started = time.perf_counter()
                assert await manager.store(keys, src) == blocks
                t_store = time.perf_counter() - started
                started = time.perf_counter()
                assert await manager.load(keys, out) == blocks
                t_load = time.perf_counter() - started
                assert torch.equal(out, src), "load returned different bytes"
                if rep:
                    stores.append(t_store)
                    loads.append(t_load)
                clear(pool, keys)
    finally:
        await pool.aclose()
    return {"store": statistics.median(stores), "load": statistics.median(loads)}
