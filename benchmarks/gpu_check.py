"""One script for a GPU machine: run the GPU tests (failing on any GPU test that skips), then
measure CudaPool's copies against raw CuPy copies of the same bytes in the same run, check the
bytes that landed, and print a short table (``--json``: one JSON object instead).

    python -m benchmarks.gpu_check            # tests + measurements, well under 5 minutes
    python -m benchmarks.gpu_check --no-tests --blocks 256 --repeats 3 --json

Needs nothing from the network: torch (a CUDA build), CuPy (``import cupy``), numpy, and
kvtier from this working tree (run from the repository root, ``-m`` puts it on the path).
kvtier itself needs anyio and xxhash, and the tests need pytest, pytest-asyncio,
pytest-timeout and hypothesis; if the machine's Python lacks them, install them on a machine
with the same Python into ``.gpu_deps`` at the repository root (``pip install --target
.gpu_deps ...``), bring that folder along and run ``PYTHONPATH=.gpu_deps python -m
benchmarks.gpu_check``: the tests it starts get the same path.

Tests: ``tests/pools/test_cuda_pool.py`` on every runtime. A skipped test fails the check,
except the stand-in-only cases on the ``cupy`` runtime (they need the stand-in's gates).

What is measured (2 MiB blocks, ``--blocks`` of them per run, median of ``--repeats``), each
pool figure beside the raw copy that does the same work:

- promotion (``CudaPool.fill`` for every block at once, as the manager starts one per key)
  with a realistic sink: ``memcpy`` (a MemoryTier: host bytes copied into the staging
  buffer) against raw memcpy-into-pinned + H2D, and ``file`` (an FS tier: ``preadv`` from a
  file in the page cache, in a thread) against raw ``preadv`` + H2D; ``noop`` (a sink that
  writes nothing) against raw H2D alone, for information;
- store (``CudaPool.drain`` for every block) with ``memcpy`` and ``file`` sources against raw
  D2H + the same host work, ``noop`` for information;
- engine store/load through a torch CUDA tensor (device-to-device, slot runs merged) against
  raw bulk D2D;
- raw copies per block (unmerged) and as one bulk copy (merged) are separate figures: a pool
  operation on one block is compared with the per-block figure, a merged one with the bulk.
- completion latency: one block fill at a time, median microseconds, beside raw
  memcpyAsync + synchronize.

Every promotion round checks the bytes that landed in device memory, every store round the
bytes the source saw, the engine round trip the tensor it loaded. Aim: the realistic
promotions and stores at least 0.8x their raw reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".gpu_deps"

MiB = 1 << 20
BLOCK = 2 * MiB
AIM = 0.8
NEEDED = ["numpy", "cupy", "anyio", "xxhash"]
FOR_TESTS = ["pytest", "pytest_asyncio", "pytest_timeout", "hypothesis"]
STAND_IN_ONLY = "needs the CUDA stand-in"  # the skip reason of stand-in-only cases on CuPy


def missing(modules: list[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def say(quiet: bool, *parts: object) -> None:
    if not quiet:
        print(*parts, flush=True)


def run_tests(quiet: bool) -> dict[str, Any]:
    """The pool tests, as a subprocess so a crash there cannot take the measurements down.
    Passes only when every test passed and none skipped for want of a GPU, torch or CuPy."""
    lacking = missing(FOR_TESTS)
    if lacking:
        return {"ok": False, "note": f"not run: missing {', '.join(lacking)} (.gpu_deps)"}
    env = dict(os.environ)
    if DEPS.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(DEPS), str(ROOT), env.get("PYTHONPATH", "")) if p
        )
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "tests/pools/test_cuda_pool.py",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ]
        say(quiet, "$", " ".join(cmd))
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, timeout=240, check=False, capture_output=quiet
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "note": "timed out after 240 s"}
        skipped, passed = [], 0
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                skip = case.find("skipped")
                if skip is None:
                    passed += case.find("failure") is None and case.find("error") is None
                elif STAND_IN_ONLY not in (skip.get("message") or ""):
                    skipped.append(f"{case.get('name')}: {skip.get('message')}")
    ok = proc.returncode == 0 and not skipped and passed > 0
    note = f"exit status {proc.returncode}, {passed} passed"
    if skipped:
        note += f", {len(skipped)} GPU test(s) skipped: " + "; ".join(skipped[:5])
    return {"ok": ok, "note": note, "passed": passed, "skipped": skipped}


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

    def _copy(self, dst: int, src: int, kind: int, bulk: bool, host_work: Callable[[int], None]):
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
        return time.perf_counter() - started

    def _fill_host(self, sink: str) -> Callable[[int], None]:
        if sink == "noop":
            return lambda i: None
        if sink == "memcpy":

            def memcpy(i: int) -> None:
                chunk = self.host[i * BLOCK : (i + 1) * BLOCK]
                chunk[:] = self.np.frombuffer(self.payload[i % len(self.payload)], self.np.uint8)

            return memcpy

        def pread(i: int) -> None:
            view = memoryview(self.host[i * BLOCK : (i + 1) * BLOCK])
            os.preadv(self.fd, [view], (i % len(self.payload)) * BLOCK)

        return pread

    def h2d(self, sink: str, bulk: bool) -> float:
        host = int(self._host.ptr)
        kind = self.rt.memcpyHostToDevice
        return self._copy(self.dev.ptr, host, kind, bulk, self._fill_host(sink))

    def d2h(self, source: str, bulk: bool) -> float:
        host = int(self._host.ptr)
        elapsed = self._copy(host, self.dev.ptr, self.rt.memcpyDeviceToHost, bulk, lambda i: None)
        started = time.perf_counter()
        if source == "memcpy":
            for i in range(self.blocks):
                bytes(memoryview(self.host[i * BLOCK : (i + 1) * BLOCK]))
        elif source == "file":
            with open(self.path + ".out", "wb") as f:
                for i in range(self.blocks):
                    f.write(memoryview(self.host[i * BLOCK : (i + 1) * BLOCK]))
        return elapsed + time.perf_counter() - started

    def d2d(self, bulk: bool) -> float:
        kind = self.rt.memcpyDeviceToDevice
        return self._copy(self.dev2.ptr, self.dev.ptr, kind, bulk, lambda i: None)

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
    from kvtier.pools._cuda import CudaPool

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
    from kvtier.pools._cuda import CudaPool

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
    from kvtier import TieringManager
    from kvtier.pools._cuda import CudaPool

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


# -- report ------------------------------------------------------------------------------------


def gbps(blocks: int, seconds: float) -> float:
    return blocks * BLOCK / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512, help="2 MiB blocks per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    quiet = args.json
    result: dict[str, Any] = {"ok": False}

    def finish(code: int) -> int:
        result["ok"] = code == 0
        if quiet:
            print(json.dumps(result, indent=1))
        return code

    lacking = missing(NEEDED)
    if lacking:
        result["error"] = f"cannot run: missing {', '.join(lacking)} (.gpu_deps)"
        say(quiet, result["error"])
        return finish(2)
    tests = {"ok": True, "note": "not run (--no-tests)"} if args.no_tests else run_tests(quiet)
    result["tests"] = tests

    import anyio
    import cupy

    from kvtier.pools._cupy import cuda_available

    ok, reason = cuda_available()
    if not ok:
        result["error"] = f"no measurements: {reason}"
        say(quiet, f"tests: {tests['note']}\n{result['error']}")
        return finish(1)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    n, reps = args.blocks, args.repeats
    result.update(device=name, cupy=cupy.__version__, blocks=n, block_bytes=BLOCK)
    say(quiet, f"\ndevice 0: {name}; cupy {cupy.__version__}; {n} x 2 MiB blocks per run")

    payload = [os.urandom(BLOCK) for _ in range(32)]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "tier.bin")
        with open(path, "wb") as f:  # payload, then room for the stores
            f.write(b"".join(payload) + bytes(BLOCK * n))
        raw = Raw(cupy, n, payload, path)
        rawfig: dict[str, float] = {}
        for kind in ("noop", "memcpy", "file"):
            for bulk in (False, True):
                merged = "merged" if bulk else "per_block"
                t = median_time(lambda k=kind, b=bulk: raw.h2d(k, b), reps)
                rawfig[f"h2d_{kind}_{merged}"] = gbps(n, t)
                t = median_time(lambda k=kind, b=bulk: raw.d2h(k, b), reps)
                rawfig[f"d2h_{kind}_{merged}"] = gbps(n, t)
        for bulk in (False, True):
            rawfig[f"d2d_{'merged' if bulk else 'per_block'}"] = gbps(
                n, median_time(lambda b=bulk: raw.d2d(b), reps)
            )
        result["raw_gbps"] = rawfig
        result["raw_latency_us"] = raw.latency_us(200)

        rows: list[dict[str, Any]] = []
        for staging in (8, 32):
            times = anyio.run(pool_runs, staging, n, reps, payload, path)
            for kind in ("noop", "memcpy", "file"):
                for op, direction in (("promote", "h2d"), ("store", "d2h")):
                    rate = gbps(n, times[f"{op}_{kind}"])
                    ref = rawfig[f"{direction}_{kind}_per_block"]
                    rows.append(
                        {
                            "operation": f"{op} ({kind} tier)",
                            "config": f"staging={staging}",
                            "gbps": rate,
                            "raw_gbps": ref,
                            "ratio": rate / ref,
                            "judged": kind != "noop",
                        }
                    )
    result["latency_us"] = anyio.run(latency_us, 200)
    engine = anyio.run(torch_runs, n, reps)
    if isinstance(engine, str):
        result["engine_note"] = engine
    else:
        for op in ("store", "load"):
            rate, ref = gbps(n, engine[op]), rawfig["d2d_merged"]
            rows.append(
                {
                    "operation": f"engine {op} torch D2D",
                    "config": "merged runs",
                    "gbps": rate,
                    "raw_gbps": ref,
                    "ratio": rate / ref,
                    "judged": False,
                }
            )
    result["rows"] = rows
    judged = [r for r in rows if r["judged"]]
    aims = all(r["ratio"] >= AIM for r in judged)
    result["aim"] = {"ratio": AIM, "met": aims}

    say(quiet, f"\n{'operation':<28}{'config':<14}{'GB/s':>8}{'raw GB/s':>10}{'ratio':>7}")
    for r in rows:
        mark = "" if r["judged"] else "  (information)"
        say(
            quiet,
            f"{r['operation']:<28}{r['config']:<14}{r['gbps']:>8.1f}{r['raw_gbps']:>10.1f}"
            f"{r['ratio']:>7.2f}{mark}",
        )
    say(quiet, "raw GB/s, per block and merged: " + json.dumps(rawfig))
    if "engine_note" in result:
        say(quiet, f"engine store/load via torch: not measured ({result['engine_note']})")
    say(
        quiet,
        f"\ncompletion latency, one 2 MiB fill: {result['latency_us']:.0f} us; raw "
        f"memcpyAsync+synchronize {result['raw_latency_us']:.0f} us",
    )
    say(quiet, f"aim {AIM}x on the realistic promotions and stores: {'met' if aims else 'NOT met'}")
    say(quiet, f"tests: {'passed' if tests['ok'] else 'FAILED'} ({tests['note']})")
    return finish(0 if tests["ok"] and aims and "engine_note" not in result else 1)


if __name__ == "__main__":
    sys.exit(main())
