"""The block-size sweep of ``benchmarks.gpu_check``: engine stores and loads from 16 KiB to
2 MiB blocks, each beside raw CuPy copies of the same bytes between the same memories.

- CudaPool with host engine buffers, ``pageable`` (numpy) and ``pinned`` (CuPy pinned
  memory), ``merged`` (one array: adjacent blocks, one copy per run) and unmerged (every
  other row of an array: one copy per block); raw: ``memcpyAsync`` from that host memory to
  device memory, as one bulk copy or one per block;
- HostPool with engine buffers on the GPU (a CuPy array), merged and unmerged; raw: the same
  copies between the device and pinned host memory.

Every configuration checks the bytes of its first load. Rows carry GB/s, raw GB/s and their
ratio.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KiB = 1 << 10
SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB, 2048 * KiB)
TOTAL = 64 << 20  # bytes per measured operation


def _keys(n: int) -> list[bytes]:
    import kvtier

    return kvtier.block_keys(list(range(n * 4)), 4, namespace=os.urandom(8))


def _raw(cupy: Any, host_ptrs: list[int], dev: int, size: int, *, to_device: bool) -> float:
    """Seconds for raw copies of ``size`` bytes at each host address (one bulk copy when
    ``host_ptrs`` holds one address for them all)."""
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    kind = rt.memcpyHostToDevice if to_device else rt.memcpyDeviceToHost
    n = TOTAL // size
    started = time.perf_counter()
    if len(host_ptrs) == 1:
        ends = (dev, host_ptrs[0]) if to_device else (host_ptrs[0], dev)
        rt.memcpyAsync(ends[0], ends[1], n * size, kind, stream.ptr)
    else:
        for i, ptr in enumerate(host_ptrs):
            ends = (dev + i * size, ptr) if to_device else (ptr, dev + i * size)
            rt.memcpyAsync(ends[0], ends[1], size, kind, stream.ptr)
    stream.synchronize()
    return time.perf_counter() - started


def _same(want: Any, got: Any, rows: slice) -> bool:
    return bool(np.array_equal(got[rows], want[rows]))


def _same_gpu(want: Any, got: Any, rows: slice) -> bool:
    return bool((got[rows] == want[rows]).all().get())


def _median(fn: Callable[[], float], repeats: int) -> float:
    fn()
    return statistics.median(fn() for _ in range(repeats))


async def _pool_times(
    pool: Any, blocks: Any, out: Any, same: Callable[[], bool], repeats: int
) -> tuple[float, float, bool]:
    """Median seconds of a store of ``blocks`` and a load into ``out``; whether the first
    load brought the stored bytes back."""
    import kvtier

    stores: list[float] = []
    loads: list[float] = []
    checked = False
    n = TOTAL // pool.block_bytes
    async with kvtier.TieringManager(pool) as manager:
        for rep in range(repeats + 1):
            keys = _keys(n)
            started = time.perf_counter()
            stored = await manager.store(keys, blocks)
            stores.append(time.perf_counter() - started)
            started = time.perf_counter()
            loaded = await manager.load(keys, out)
            loads.append(time.perf_counter() - started)
            if rep == 0:
                checked = stored == loaded == n and same()
            for key in keys:
                pool.discard(key)
    return statistics.median(stores[1:]), statistics.median(loads[1:]), checked


def _row(pool: str, memory: str, merged: bool, size: int, op: str, t: float, raw: float) -> Any:
    rate, ref = TOTAL / t / 1e9, TOTAL / raw / 1e9
    return {
        "pool": pool,
        "memory": memory,
        "merged": merged,
        "block_bytes": size,
        "operation": op,
        "gbps": rate,
        "raw_gbps": ref,
        "ratio": rate / ref,
    }


async def sweep(repeats: int = 3) -> dict[str, Any]:
    import cupy

    import kvtier

    rows: list[dict[str, Any]] = []
    wrong: list[str] = []
    for size in SIZES:
        n = TOTAL // size
        dev = cupy.cuda.Memory(TOTAL)
        pinned = cupy.cuda.alloc_pinned_memory(2 * TOTAL)
        memories = {
            "pageable": np.empty((2 * n, size), np.uint8),
            "pinned": np.frombuffer(pinned, np.uint8, 2 * TOTAL).reshape(2 * n, size),
        }
        for memory, host in memories.items():
            host[:] = np.random.default_rng(size).integers(0, 256, host.shape, np.uint8)
            back = np.zeros_like(host)
            for merged in (True, False):
                rows_of = slice(0, n) if merged else slice(0, 2 * n, 2)
                src = host[rows_of] if merged else list(host[rows_of])
                dst = back[rows_of] if merged else list(back[rows_of])
                base = int(host.ctypes.data)
                ptrs = [base] if merged else [base + 2 * i * size for i in range(n)]
                pool = kvtier.CudaPool(n, size)
                try:
                    t_store, t_load, ok = await _pool_times(
                        pool,
                        src,
                        dst,
                        functools.partial(_same, host, back, rows_of),
                        repeats,
                    )
                finally:
                    await pool.aclose()
                if not ok:
                    wrong.append(f"cuda/{memory}/{'merged' if merged else 'unmerged'}/{size}")
                for op, t, to_device in (("store", t_store, True), ("load", t_load, False)):
                    raw = _median(
                        functools.partial(
                            _raw, cupy, ptrs, int(dev.ptr), size, to_device=to_device
                        ),
                        repeats,
                    )
                    rows.append(_row("cuda", memory, merged, size, op, t, raw))
        engine = cupy.random.randint(0, 256, (2 * n, size), dtype=cupy.uint8)
        engine_back = cupy.zeros_like(engine)
        pinned_view = memories["pinned"]
        for merged in (True, False):
            rows_of = slice(0, n) if merged else slice(0, 2 * n, 2)
            gsrc = engine[rows_of] if merged else [engine[i] for i in range(0, 2 * n, 2)]
            gdst = engine_back[rows_of] if merged else [engine_back[i] for i in range(0, 2 * n, 2)]
            host_pool = kvtier.HostPool(n, size)
            try:
                t_store, t_load, ok = await _pool_times(
                    host_pool,
                    gsrc,
                    gdst,
                    functools.partial(_same_gpu, engine, engine_back, rows_of),
                    repeats,
                )
            finally:
                await host_pool.aclose()
            if not ok:
                wrong.append(f"host/gpu/{'merged' if merged else 'unmerged'}/{size}")
            base = int(pinned_view.ctypes.data)
            ptrs = [base] if merged else [base + i * size for i in range(n)]
            for op, t, to_device in (("store", t_store, False), ("load", t_load, True)):
                raw = _median(
                    functools.partial(
                        _raw, cupy, ptrs, int(engine.data.ptr), size, to_device=to_device
                    ),
                    repeats,
                )
                rows.append(_row("host", "gpu", merged, size, op, t, raw))
    return {"ok": not wrong, "wrong_bytes": wrong, "rows": rows}
