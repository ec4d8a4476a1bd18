"""Many concurrent scheduler lookups over a shared key space, with tiers that answer slowly.

    python -m benchmarks.bench_load [--requests 5000] [--quick] [--cached-keys 100000] [--json]

Reports the event loop's lag (how late a 5 ms timer fires) during the run beside the lag of
the same loop idle, measured in the same process just before; the longest single callback
(one uninterrupted step of any task: what "blocking the loop" means); peak sizes of the
bounded structures (lookup cache, pending checks, in-flight bytes) against their limits; and
errors. Lag under load is queueing: with thousands of tasks woken by one batch of verdicts the
loop runs all their (short) steps before the timer; the longest step shows nothing blocks.

Each tier starts with ``--cached-keys`` existence verdicts already cached (a long-running
node's state), and the report gives the garbage collector's pauses: a full collection timed
before the run, and the longest and total collector time during it. Long-lived per-key state
that the collector tracks makes every full pass walk it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from typing import Any

import anyio
import numpy as np

import kvtier
from benchmarks.common import add_json_flag, json_output
from kvtier.testing import SlowTier

BB = 256


class StepTimer:
    """Times every callback the asyncio loop runs (patches Handle._run for the measurement),
    and Python's garbage-collector passes, which stop the loop wherever they happen to start."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.longest_gc = 0.0
        self.total_gc = 0.0
        self.full_passes = 0
        self._gc_started = 0.0
        self._original = asyncio.events.Handle._run

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            pause = time.perf_counter() - self._gc_started
            self.longest_gc = max(self.longest_gc, pause)
            self.total_gc += pause
            self.full_passes += info.get("generation") == 2

    def __enter__(self) -> StepTimer:
        original = self._original
        timer = self

        def timed(handle: asyncio.events.Handle) -> None:
            start = time.perf_counter()
            original(handle)
            timer.longest = max(timer.longest, time.perf_counter() - start)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.events.Handle._run = self._original  # type: ignore[method-assign]
        gc.callbacks.remove(self._gc)


async def measure_lag(stop: anyio.Event, samples: list[float], period: float = 0.005) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await anyio.sleep(period)
        samples.append(time.perf_counter() - start - period)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else 0.0


def full_collection_ms() -> float:
    """The pause of one full collection now, as a full pass would stop the loop."""
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1e3


async def workload(
    requests: int, concurrency: int, key_space: int, cached_keys: int, seed: int = 0
) -> dict[str, float]:
    """Run the load; return peaks, errors and the scheduler's results."""
    rng = random.Random(seed)
    keys = kvtier.block_keys(list(range(key_space)), 1, namespace=b"load")
    entries = 5_000 + cached_keys
    slow_a = SlowTier(delay=0.002, name="slow-a", max_pending=2_000, max_entries=entries)
    slow_b = SlowTier(delay=0.004, name="slow-b", max_pending=2_000, max_entries=entries)
    for key in keys[: key_space // 2]:
        await slow_b.inner.store(key, memoryview(bytes(BB)))
    peaks = {"full_gc_ms_empty": full_collection_ms()}
    old = kvtier.block_keys(list(range(cached_keys)), 1, namespace=b"earlier")
    for tier in (slow_a, slow_b):  # what a long-running node has learnt about other keys
        for i, key in enumerate(old):
            tier.lookups.record(key, i % 2 == 0)
    del old
    peaks["full_gc_ms_cached"] = full_collection_ms()
    peaks["tracked_objects"] = len(gc.get_objects())
    limit = 64 * BB
    peaks.update({"cached": 0.0, "pending": 0.0, "in_flight_bytes": 0.0, "errors": 0.0})
    manager = kvtier.TieringManager(
        kvtier.HostPool(2_000, BB), [slow_a, slow_b], max_in_flight_bytes=limit
    )
    async with manager:
        scheduler = kvtier.OffloadScheduler(manager)
        limiter = anyio.Semaphore(concurrency)

        async def request() -> None:
            async with limiter:
                start = rng.randrange(0, key_space - 32)
                prefix = keys[start : start + rng.randrange(1, 32)]
                try:
                    n = await scheduler.lookup(prefix, timeout=5.0)
                    assert 0 <= n <= len(prefix)
                    await manager.store(prefix[n:], np.zeros((len(prefix) - n, BB), np.uint8))
                except Exception:
                    peaks["errors"] += 1

        async def monitor(done: anyio.Event) -> None:
            """Sample the bounded structures every millisecond of loop time."""
            while not done.is_set():
                for tier in (slow_a, slow_b):
                    stats = tier.lookups.statistics()
                    peaks["cached"] = max(peaks["cached"], stats.cached_verdicts)
                    peaks["pending"] = max(peaks["pending"], stats.pending + stats.in_flight)
                peaks["in_flight_bytes"] = max(
                    peaks["in_flight_bytes"], manager.statistics().in_flight_bytes
                )
                await anyio.sleep(0.001)

        done = anyio.Event()
        async with anyio.create_task_group() as outer:
            outer.start_soon(monitor, done)
            async with anyio.create_task_group() as tg:
                for i in range(requests):
                    tg.start_soon(request)
                    if i % 32 == 31:  # requests arrive over time, not in one loop step
                        await anyio.lowlevel.checkpoint()
            done.set()
    peaks["limit_cached"] = entries
    peaks["limit_pending"] = 2_000
    peaks["limit_in_flight_bytes"] = limit
    peaks["timeouts"] = scheduler.statistics().timeouts
    return peaks


async def run(requests: int, concurrency: int, cached_keys: int, out: dict[str, Any]) -> None:
    stop = anyio.Event()
    idle: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(measure_lag, stop, idle)
        await anyio.sleep(1.0)
        stop.set()
    stop = anyio.Event()
    busy: list[float] = []
    started = time.perf_counter()
    with StepTimer() as steps:
        async with anyio.create_task_group() as tg:
            tg.start_soon(measure_lag, stop, busy)
            peaks = await workload(requests, concurrency, 20_000, cached_keys)
            stop.set()
    elapsed = time.perf_counter() - started
    out["elapsed_s"] = elapsed
    out["loop_lag_ms"] = {
        name: {"p50": pct(lag, 50), "p99": pct(lag, 99), "max": max(lag) * 1e3}
        for name, lag in (("idle", idle), ("under_load", busy))
    }
    out["p99_lag_ratio"] = {
        "baseline": "idle",
        "value": pct(busy, 99) / max(pct(idle, 99), 1e-3),
    }
    out["longest_step_ms"] = steps.longest * 1e3
    out["gc"] = {
        "full_passes": steps.full_passes,
        "longest_pass_ms": steps.longest_gc * 1e3,
        "all_passes_ms": steps.total_gc * 1e3,
    }
    out["peaks"] = peaks
    print(f"{requests} scheduler lookups, {concurrency} concurrent, in {elapsed:.1f} s")
    print(f"{'loop lag (5 ms timer)':<28} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    print(
        f"{'idle loop (baseline)':<28} {pct(idle, 50):8.2f} {pct(idle, 99):8.2f} "
        f"{max(idle) * 1e3:8.2f}"
    )
    print(f"{'under load':<28} {pct(busy, 50):8.2f} {pct(busy, 99):8.2f} {max(busy) * 1e3:8.2f}")
    print(f"p99 lag ratio (load / idle): {pct(busy, 99) / max(pct(idle, 99), 1e-3):.1f}x")
    print(
        f"longest single loop step under load: {steps.longest * 1e3:.2f} ms "
        f"(longest garbage-collector pass: {steps.longest_gc * 1e3:.2f} ms)"
    )
    for name in ("cached", "pending", "in_flight_bytes"):
        print(f"peak {name:<16} {peaks[name]:>10.0f} (limit {peaks['limit_' + name]:.0f})")
    print(f"errors {peaks['errors']:.0f}, lookups that hit their deadline {peaks['timeouts']:.0f}")
    print(
        f"garbage collector with {cached_keys:,} cached verdicts per tier: a full collection "
        f"takes {peaks['full_gc_ms_cached']:.1f} ms (before caching them: "
        f"{peaks['full_gc_ms_empty']:.1f} ms; {peaks['tracked_objects']:,.0f} tracked objects); "
        f"during the run {steps.full_passes} full passes, longest pass "
        f"{steps.longest_gc * 1e3:.1f} ms, all passes {steps.total_gc * 1e3:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=2_000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--cached-keys", type=int, default=100_000, help="verdicts cached per tier at the start"
    )
    add_json_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.concurrency = 3_000, 1_000
    with json_output(args.json) as out:
        out["settings"] = {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "cached_keys": args.cached_keys,
        }
        asyncio.run(run(args.requests, args.concurrency, args.cached_keys, out))


if __name__ == "__main__":
    main()
