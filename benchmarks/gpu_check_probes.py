"""The behaviour checks of ``benchmarks.gpu_check``: where a real GPU differs from the CUDA
stand-in the tests run on, each answered on the GPU itself.

- ``engine_ordering``: blocks stored and loaded without synchronising the engine first, on
  torch's default stream, a torch side stream and a CuPy current stream, into CudaPool and
  HostPool; the engine's later work is queued behind a busy stream, so a copy not ordered
  after it reads or writes the wrong bytes;
- ``capture_beside_copies``: another thread captures a CUDA graph (global mode, torch's
  default) while stores run; the capture must succeed, and a store that failed must not land
  later in a slot the next store reuses;
- ``sticky_fault``: in a subprocess, a device-side assert while a store is queued behind it;
  the store fails within its bound and closing returns;
- ``thread_context``: in a subprocess, a fresh thread's device and context before and after
  a pool on the last GPU switched to it, and whether GPU 0 got a context;
- ``slot_bytes_queued``: ``slot_bytes`` read from a thread while a store's copies are queued
  holds the stored bytes, never older ones.

Each returns a JSON-ready dict with ``ok``; none may be skipped on a GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SPIN = 200_000_000  # GPU clock cycles torch.cuda._sleep keeps a stream busy (~0.1 s)

PROBES = (
    "engine_ordering",
    "capture_beside_copies",
    "sticky_fault",
    "thread_context",
    "slot_bytes_queued",
)


def _keys(n: int) -> list[bytes]:
    import kvtier

    return kvtier.block_keys(list(range(n * 4)), 4, namespace=os.urandom(8))


async def _until_queued(pool: Any, moved: int, bound: float) -> None:
    """Until ``pool`` has queued copies past ``moved`` bytes to the device (its statistics
    are all a user can watch), at most ``bound`` seconds."""
    import anyio

    with anyio.move_on_after(bound):
        while pool.transfer_statistics().bytes_to_device == moved:  # noqa: ASYNC110
            await anyio.sleep(0.0002)


def _busy_cupy(cupy: Any) -> None:
    """Keep CuPy's current stream busy for a while (CuPy has no sleep kernel)."""
    x = cupy.ones(1 << 24, cupy.float32)
    for _ in range(300):
        x = cupy.sin(x)


async def engine_ordering(block: int = MiB, n: int = 32) -> dict[str, Any]:
    import cupy
    import torch

    import kvtier

    cases: dict[str, bool] = {}
    for pool_kind in ("cuda", "host"):
        for engine in ("torch_default", "torch_side", "cupy_current"):
            pool: kvtier.PrimaryPool
            pool = kvtier.CudaPool(n, block) if pool_kind == "cuda" else kvtier.HostPool(n, block)
            value = 1 + len(cases)
            keys = _keys(n)
            try:
                async with kvtier.TieringManager(pool) as manager:
                    if engine.startswith("torch"):
                        src = torch.zeros((n, block), dtype=torch.uint8, device="cuda")
                        out = torch.zeros_like(src)
                        torch.cuda.synchronize()
                        stream = (
                            torch.cuda.current_stream()
                            if engine == "torch_default"
                            else torch.cuda.Stream()  # type: ignore[no-untyped-call]
                        )
                        with torch.cuda.stream(stream):
                            torch.cuda._sleep(SPIN)  # type: ignore[no-untyped-call]
                            src.fill_(value)
                            stored = await manager.store(keys, src)  # no synchronize first
                            torch.cuda._sleep(SPIN)  # type: ignore[no-untyped-call]
                            out.fill_(255)
                            loaded = await manager.load(keys, out)
                            right = out.eq(value).all()
                        torch.cuda.synchronize()
                        good = bool(right.item())
                    else:
                        with cupy.cuda.Stream(non_blocking=True) as side:
                            csrc = cupy.zeros((n, block), cupy.uint8)
                            cout = cupy.zeros_like(csrc)
                            side.synchronize()
                            _busy_cupy(cupy)
                            csrc.fill(value)
                            stored = await manager.store(keys, csrc)
                            _busy_cupy(cupy)
                            cout.fill(255)
                            loaded = await manager.load(keys, cout)
                            cright = (cout == value).all()
                            side.synchronize()
                        good = bool(cright.get())
                    cases[f"{pool_kind}/{engine}"] = good and stored == n and loaded == n
            finally:
                await pool.aclose()
    return {"ok": all(cases.values()), "cases": cases}


async def capture_beside_copies(rounds: int = 20, n: int = 8) -> dict[str, Any]:
    import anyio
    import anyio.to_thread
    import torch

    import kvtier

    block = 2 * MiB
    pool = kvtier.CudaPool(n, block, copy_timeout=10.0)
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    capture_errors: list[str] = []
    failed_ops = wrong = 0
    rng = np.random.default_rng(5)
    try:
        async with kvtier.TieringManager(pool) as manager:
            for _ in range(rounds):
                first, second = (rng.integers(0, 256, (n, block), np.uint8) for _ in range(2))
                first_keys, second_keys = _keys(n), _keys(n)
                begun = threading.Event()

                def capture(begun: threading.Event = begun) -> None:
                    graph = torch.cuda.CUDAGraph()
                    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                    try:
                        with torch.cuda.stream(side), torch.cuda.graph(graph):
                            begun.set()
                            y = x * 2
                            for _ in range(50):
                                y = y * 2
                        graph.replay()
                    except Exception as exc:
                        capture_errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    finally:
                        begun.set()

                async def store_first(keys: list[bytes] = first_keys, data: Any = first) -> None:
                    nonlocal failed_ops
                    try:
                        await manager.store(keys, data)
                    except Exception:
                        failed_ops += 1

                thread = threading.Thread(target=capture)
                async with anyio.create_task_group() as tg:
                    moved = pool.transfer_statistics().bytes_to_device
                    tg.start_soon(store_first)
                    await _until_queued(pool, moved, 5)  # the capture begins beside copies
                    thread.start()
                    await anyio.to_thread.run_sync(begun.wait, 30)
                stored = await manager.store(second_keys, second)  # may reuse those slots
                await anyio.to_thread.run_sync(thread.join, 60)
                torch.cuda.synchronize()
                out = np.zeros_like(second)
                loaded = await manager.load(second_keys[:stored], out[:stored])
                wrong += int(not np.array_equal(out[:loaded], second[:loaded]))
    finally:
        await pool.aclose()
    return {
        "ok": not capture_errors and wrong == 0,
        "rounds": rounds,
        "failed_operations": failed_ops,
        "slot_changed_after_failure": wrong,
        "capture_errors": capture_errors[:5],
    }


_FAULT_CHILD = """
import json, time, anyio, numpy as np, torch, kvtier
async def main():
    n, block = 16, 1 << 20
    pool = kvtier.CudaPool(n, block, copy_timeout=20.0, settle_timeout=5.0)
    src = torch.ones((n, block), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    keys = kvtier.block_keys(list(range(n * 4)), 4)
    out = {}
    manager = kvtier.TieringManager(pool)
    await manager.__aenter__()
    torch.cuda._sleep(%d)
    bad = torch.zeros(1, device="cuda")
    bad[torch.tensor([1 << 40], device="cuda")] = 1.0  # a device-side assert: sticky
    started = time.monotonic()
    try:
        out["stored"] = await manager.store(keys, src)  # queued behind the fault
        out["outcome"] = "returned"
    except Exception as exc:
        out["outcome"] = "raised"
        out["error"] = (type(exc).__name__ + ": " + str(exc))[:300]
    out["store_s"] = round(time.monotonic() - started, 3)
    started = time.monotonic()
    with anyio.move_on_after(60):
        try:
            await manager.__aexit__(None, None, None)
            await pool.aclose()
        except Exception as exc:
            out["close_error"] = (type(exc).__name__ + ": " + str(exc))[:300]
        out["closed_s"] = round(time.monotonic() - started, 3)
    print("RESULT " + json.dumps(out), flush=True)
anyio.run(main)
"""


def _child(code: str, timeout: float) -> tuple[dict[str, Any] | None, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"hung: no answer within {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            found: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return found, f"exit status {proc.returncode}"
    return None, f"exit status {proc.returncode}: {proc.stderr[-400:]}"


def sticky_fault() -> dict[str, Any]:
    found, note = _child(_FAULT_CHILD % SPIN, 120)
    if found is None:
        return {"ok": False, "note": note}
    ok = found.get("outcome") == "raised" and "closed_s" in found and found["store_s"] < 25
    return {"ok": ok, "note": note, **found}


_CONTEXT_CHILD = """
import ctypes, json, threading, anyio, cupy, numpy as np, kvtier
rt, drv = cupy.cuda.runtime, cupy.cuda.driver
def primary_active(device):
    lib = ctypes.CDLL("libcuda.so.1")
    flags, active = ctypes.c_uint(), ctypes.c_int()
    lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
    return bool(active.value)
out = {}
def fresh():
    out["before"] = {"device": rt.getDevice(), "context": drv.ctxGetCurrent() != 0}
    last = rt.getDeviceCount() - 1
    out["devices"] = last + 1
    pool = kvtier.CudaPool(2, 1 << 20, device=last)
    out["after_build"] = {"device": rt.getDevice(), "context": drv.ctxGetCurrent() != 0}
    async def use():
        async with kvtier.TieringManager(pool) as manager:
            data = np.arange(1 << 20, dtype=np.uint8).reshape(1, -1)
            keys = kvtier.block_keys(list(range(4)), 4)
            back = np.zeros_like(data)
            await manager.store(keys, data)
            await manager.load(keys, back)
            out["bytes_ok"] = bool((back == data).all())
        await pool.aclose()
    anyio.run(use)
    out["after_close"] = {"device": rt.getDevice(), "context": drv.ctxGetCurrent() != 0}
    out["gpu0_context"] = primary_active(0)
    out["pool_device"] = last
thread = threading.Thread(target=fresh)
thread.start()
thread.join()
print("RESULT " + json.dumps(out), flush=True)
"""


def thread_context() -> dict[str, Any]:
    found, note = _child(_CONTEXT_CHILD, 120)
    if found is None:
        return {"ok": False, "note": note}
    last = found["pool_device"]
    ok = (
        found["before"]["context"] is False
        and found["after_close"]["device"] == last
        and found.get("bytes_ok") is True
        and (last == 0 or found["gpu0_context"] is False)
    )
    return {"ok": ok, "note": note, **found}


async def slot_bytes_queued(n: int = 128) -> dict[str, Any]:
    import anyio
    import anyio.to_thread
    import cupy

    import kvtier

    block = 2 * MiB
    pinned = cupy.cuda.alloc_pinned_memory(n * block)
    host = np.frombuffer(pinned, np.uint8, n * block).reshape(n, block)
    host[:] = np.random.default_rng(9).integers(0, 256, (n, block), np.uint8)
    want = {hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in host}
    pool = kvtier.CudaPool(n, block)
    seen: list[bool] = []
    try:
        async with kvtier.TieringManager(pool) as manager, anyio.create_task_group() as tg:
            tg.start_soon(manager.store, _keys(n), host)
            await _until_queued(pool, 0, 10)

            def read_all() -> None:
                for slot in range(n):
                    digest = hashlib.blake2b(pool.slot_bytes(slot), digest_size=16).digest()
                    seen.append(digest in want)

            await anyio.to_thread.run_sync(read_all)
    finally:
        await pool.aclose()
    return {"ok": len(seen) == n and all(seen), "slots": n, "stale": seen.count(False)}


async def run_probes(deadline: float) -> dict[str, Any]:
    """Every probe, each caught on its own; one that cannot start before ``deadline``
    (``time.monotonic()``) is reported as not run, which fails the check."""
    import anyio.to_thread

    results: dict[str, Any] = {}
    for name in PROBES:
        if time.monotonic() > deadline:
            results[name] = {"ok": False, "note": "not run: out of time"}
            continue
        started = time.monotonic()
        try:
            if name == "engine_ordering":
                results[name] = await engine_ordering()
            elif name == "capture_beside_copies":
                results[name] = await capture_beside_copies()
            elif name == "sticky_fault":
                results[name] = await anyio.to_thread.run_sync(sticky_fault)
            elif name == "thread_context":
                results[name] = await anyio.to_thread.run_sync(thread_context)
            else:
                results[name] = await slot_bytes_queued()
        except Exception as exc:
            results[name] = {"ok": False, "note": f"{type(exc).__name__}: {exc}"[:400]}
        results[name]["seconds"] = round(time.monotonic() - started, 2)
    return results
