"""One script for a GPU machine: run the GPU tests, then measure CudaPool's copies against raw
CuPy copies of the same bytes in the same run, and print a short table.

    python benchmarks/gpu_check.py            # tests + measurements, well under 5 minutes
    python benchmarks/gpu_check.py --no-tests --blocks 256 --repeats 3

Needs nothing from the network: torch, CuPy (any CUDA build; ``import cupy``), numpy, and
kvtier from this working tree (put on ``sys.path`` here). kvtier itself needs anyio and xxhash,
and the tests need pytest, pytest-asyncio, pytest-timeout and hypothesis; if the machine's
Python lacks them, install them on a machine with the same Python into ``.gpu_deps`` at the
repository root (``pip install --target .gpu_deps ...``) and bring that folder along: this
script puts it on ``sys.path`` and on the tests' ``PYTHONPATH``.

What is measured (2 MiB blocks, ``--blocks`` of them per run, median of ``--repeats``):

- raw H2D / D2H: ``cudaMemcpyAsync`` between one pinned host buffer and device memory on one
  stream, per block and as one bulk copy; the pool's ratio is taken against the faster of the
  two;
- promotion: ``CudaPool.fill`` for every block at once (the manager starts one per key) with a
  sink that leaves the staging buffer as it is (a tier that reads straight into the buffer, as
  an O_DIRECT file read does): staging + stream + completion machinery; and, for information,
  with a sink that copies 2 MiB of host bytes in (what MemoryTier does, on the event loop);
- store (write-through): ``CudaPool.drain`` for every block with a source that reads nothing;
- engine store/load: ``TieringManager.store``/``load`` from/into a torch CUDA tensor
  (device-to-device) beside raw device-to-device copies;
- completion latency: one block fill at a time, median microseconds, per completion mode.

Aim: promotion and store at least 0.8x raw.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".gpu_deps"
for extra in (DEPS, ROOT):
    if extra.is_dir() and str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

MiB = 1 << 20
BLOCK = 2 * MiB
AIM = 0.8
NEEDED = ["numpy", "cupy", "anyio", "xxhash"]
FOR_TESTS = ["pytest", "pytest_asyncio", "pytest_timeout", "hypothesis"]


def missing(modules: list[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def run_tests() -> tuple[bool, str]:
    """The GPU tests, as a subprocess so a crash there cannot take the measurements down."""
    lacking = missing(FOR_TESTS)
    if lacking:
        return False, f"not run: missing {', '.join(lacking)} (see the docstring: .gpu_deps)"
    env = dict(os.environ)
    if DEPS.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(DEPS), str(ROOT), env.get("PYTHONPATH", "")) if p
        )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/pools/test_cuda_pool.py",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=240, check=False)
    except subprocess.TimeoutExpired:
        return False, "timed out after 240 s"
    return proc.returncode == 0, f"exit status {proc.returncode}"


# -- raw CuPy copies ---------------------------------------------------------------------------


class Raw:
    """Raw copies of ``blocks`` x 2 MiB between pinned host memory and device memory."""

    def __init__(self, cupy: Any, blocks: int) -> None:
        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        self.blocks = blocks
        nbytes = blocks * BLOCK
        self.host = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(nbytes), 0)
        self.dev = cupy.cuda.Memory(nbytes)
        self.dev2 = cupy.cuda.Memory(nbytes)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _time(self, dst: int, src: int, kind: int, bulk: bool) -> float:
        started = time.perf_counter()
        if bulk:
            self.rt.memcpyAsync(dst, src, self.blocks * BLOCK, kind, self.stream.ptr)
        else:
            for i in range(self.blocks):
                off = i * BLOCK
                self.rt.memcpyAsync(dst + off, src + off, BLOCK, kind, self.stream.ptr)
        self.stream.synchronize()
        return time.perf_counter() - started

    def h2d(self, bulk: bool) -> float:
        return self._time(self.dev.ptr, self.host.ptr, self.rt.memcpyHostToDevice, bulk)

    def d2h(self, bulk: bool) -> float:
        return self._time(self.host.ptr, self.dev.ptr, self.rt.memcpyDeviceToHost, bulk)

    def d2d(self, bulk: bool) -> float:
        return self._time(self.dev2.ptr, self.dev.ptr, self.rt.memcpyDeviceToDevice, bulk)

    def latency_us(self, n: int) -> float:
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            self.rt.memcpyAsync(
                self.dev.ptr, self.host.ptr, BLOCK, self.rt.memcpyHostToDevice, self.stream.ptr
            )
            self.stream.synchronize()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1e6


def median_time(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm up
    return statistics.median(fn() for _ in range(repeats))


# -- CudaPool ----------------------------------------------------------------------------------


async def _noop_sink(view: memoryview) -> None:
    return None


def _keys(blocks: int, salt: int) -> list[bytes]:
    import kvtier

    return kvtier.block_keys(list(range(blocks * 4)), 4, namespace=b"gpu-check-%d" % salt)


async def promote(pool: Any, keys: list[bytes], sink: Callable[..., Awaitable[None]]) -> float:
    import anyio

    slots = [pool.try_reserve(k) for k in keys]
    assert None not in slots
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, slot in enumerate(slots):
            tg.start_soon(pool.fill, slot, lambda view, i=i: sink(view, i))
    elapsed = time.perf_counter() - started
    for slot in slots:
        pool.commit(slot)
    return elapsed


async def drain(pool: Any, keys: list[bytes]) -> float:
    import anyio

    slots = [pool.pin(k) for k in keys]
    assert None not in slots
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for slot in slots:
            tg.start_soon(pool.drain, slot, _noop_sink)
    elapsed = time.perf_counter() - started
    for slot in slots:
        pool.unpin(slot)
    return elapsed


def clear(pool: Any, keys: list[bytes]) -> None:
    for key in keys:
        pool.discard(key)


async def pool_runs(
    cupy: Any, mode: str, staging: int, blocks: int, repeats: int, payload: list[bytes]
) -> dict[str, float]:
    """Seconds (median) for promotion (no-op sink and memcpy sink) and store."""
    import numpy as np

    from kvtier.pools._cuda import CudaPool

    pool = CudaPool(blocks, BLOCK, completion=mode, staging_buffers=staging)
    try:
        keys = _keys(blocks, staging)

        async def noop(view: memoryview, i: int) -> None:
            return None

        async def memcpy(view: memoryview, i: int) -> None:
            view[:] = payload[i % len(payload)]

        out: dict[str, list[float]] = {"promote": [], "promote_memcpy": [], "store": []}
        for rep in range(repeats + 1):  # the first round warms up
            t_fill = await promote(pool, keys, noop)
            t_store = await drain(pool, keys)
            clear(pool, keys)
            t_memcpy = await promote(pool, keys, memcpy)
            if rep == 0:
                # the bytes really landed: spot-check a few slots against the payload
                for i in (0, blocks // 2, blocks - 1):
                    slot = pool.pin(keys[i])
                    assert slot is not None
                    got = cupy.asnumpy(pool.slot_array(slot))
                    want = np.frombuffer(payload[i % len(payload)], np.uint8)
                    pool.unpin(slot)
                    assert np.array_equal(got, want), f"slot {slot} holds wrong bytes"
            clear(pool, keys)
            if rep:
                out["promote"].append(t_fill)
                out["store"].append(t_store)
                out["promote_memcpy"].append(t_memcpy)
        assert pool.transfer_statistics().abandoned_copies == 0
        return {name: statistics.median(times) for name, times in out.items()}
    finally:
        await pool.aclose()


async def latency_us(mode: str, n: int) -> float:
    from kvtier.pools._cuda import CudaPool

    pool = CudaPool(2, BLOCK, completion=mode)
    try:
        key = _keys(1, 99)[0]
        samples = []
        for _ in range(n + 5):
            slot = pool.try_reserve(key)
            assert slot is not None
            started = time.perf_counter()
            await pool.fill(slot, _noop_sink)
            samples.append(time.perf_counter() - started)
            pool.abort(slot)
        return statistics.median(samples[5:]) * 1e6
    finally:
        await pool.aclose()


async def torch_runs(mode: str, blocks: int, repeats: int) -> dict[str, float] | str:
    """Engine store and load through a torch CUDA tensor (device-to-device), seconds."""
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from kvtier import TieringManager
    from kvtier.pools._cuda import CudaPool

    pool = CudaPool(blocks, BLOCK, completion=mode)
    keys = _keys(blocks, 7)
    src = torch.randint(0, 256, (blocks, BLOCK), dtype=torch.uint8, device="cuda")
    out = torch.zeros_like(src)
    torch.cuda.synchronize()
    stores: list[float] = []
    loads: list[float] = []
    try:
        async with TieringManager(pool) as manager:
            for rep in range(repeats + 1):
                started = time.perf_counter()
                assert await manager.store(keys, src) == blocks
                t_store = time.perf_counter() - started
                started = time.perf_counter()
                assert await manager.load(keys, out) == blocks
                t_load = time.perf_counter() - started
                if rep == 0:
                    assert torch.equal(out, src), "load returned different bytes"
                else:
                    stores.append(t_store)
                    loads.append(t_load)
                clear(pool, keys)
    finally:
        await pool.aclose()
    return {"store": statistics.median(stores), "load": statistics.median(loads)}


# -- report ------------------------------------------------------------------------------------


def gbps(blocks: int, seconds: float) -> float:
    return blocks * BLOCK / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512, help="2 MiB blocks per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    args = parser.parse_args()

    lacking = missing(NEEDED)
    if lacking:
        print(f"cannot run: missing {', '.join(lacking)} (see the docstring: .gpu_deps)")
        return 2
    tests_ok, tests_note = (True, "skipped (--no-tests)") if args.no_tests else run_tests()

    import anyio
    import cupy

    from kvtier.pools._cupy import cuda_available

    ok, reason = cuda_available()
    if not ok:
        print(f"tests: {tests_note}\nno measurements: {reason}")
        return 1
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"\ndevice 0: {name}; cupy {cupy.__version__}; {args.blocks} x 2 MiB blocks per run")

    n, reps = args.blocks, args.repeats
    raw = Raw(cupy, n)
    raw_h2d = max(gbps(n, median_time(functools.partial(raw.h2d, b), reps)) for b in (False, True))
    raw_d2h = max(gbps(n, median_time(functools.partial(raw.d2h, b), reps)) for b in (False, True))
    raw_d2d = max(gbps(n, median_time(functools.partial(raw.d2d, b), reps)) for b in (False, True))
    raw_latency = raw.latency_us(200)
    payload = [os.urandom(BLOCK) for _ in range(32)]

    rows: list[tuple[str, str, float, float]] = []  # (operation, config, GB/s, raw GB/s)
    ratios: dict[tuple[str, str], float] = {}
    latencies: dict[str, float] = {}
    torch_note = ""
    for mode in ("callback", "thread"):
        for staging in (8, 32):
            times = anyio.run(pool_runs, cupy, mode, staging, n, reps, payload)
            config = f"{mode}, staging={staging}"
            for op, key, ref in (
                ("promotion H2D", "promote", raw_h2d),
                ("store D2H", "store", raw_d2h),
                ("promotion, memcpy sink", "promote_memcpy", raw_h2d),
            ):
                rate = gbps(n, times[key])
                rows.append((op, config, rate, ref))
                ratios[(key, config)] = rate / ref
        latencies[mode] = anyio.run(latency_us, mode, 200)
        result = anyio.run(torch_runs, mode, n, reps)
        if isinstance(result, str):
            torch_note = result
        else:
            rows.append(("engine store torch D2D", mode, gbps(n, result["store"]), raw_d2d))
            rows.append(("engine load torch D2D", mode, gbps(n, result["load"]), raw_d2d))

    print(f"\n{'operation':<26}{'config':<22}{'GB/s':>8}{'raw GB/s':>10}{'ratio':>7}")
    for op, config, rate, ref in rows:
        print(f"{op:<26}{config:<22}{rate:>8.1f}{ref:>10.1f}{rate / ref:>7.2f}")
    if torch_note:
        print(f"engine store/load via torch: not measured ({torch_note})")
    print(
        f"\ncompletion latency, one 2 MiB fill: callback {latencies['callback']:.0f} us, "
        f"thread {latencies['thread']:.0f} us; raw memcpy+synchronize {raw_latency:.0f} us"
    )

    verdicts = []
    for key in ("promote", "store"):
        for staging in (8, 32):
            cb = ratios[(key, f"callback, staging={staging}")]
            th = ratios[(key, f"thread, staging={staging}")]
            best = "callback" if cb >= th else "thread"
            verdicts.append(
                f"{key:<8} staging={staging:<3} callback {cb:.2f}x  thread {th:.2f}x  "
                f"better: {best}  aim {AIM}x: {'met' if max(cb, th) >= AIM else 'NOT met'}"
            )
    faster = min(latencies, key=lambda m: latencies[m])
    print("\n" + "\n".join(verdicts))
    print(f"lower latency: {faster}")
    print(f"tests: {'passed' if tests_ok else 'FAILED'} ({tests_note})")
    aims = all(ratios[(k, "callback, staging=8")] >= AIM for k in ("promote", "store"))
    return 0 if tests_ok and aims else 1


if __name__ == "__main__":
    sys.exit(main())
