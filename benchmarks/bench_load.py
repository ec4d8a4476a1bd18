"""The event loop under load: closed-loop scheduler lookups over slow tiers, and what they cost.

    python -m benchmarks.bench_load                     # 256, 1,000 and 2,000 in flight
    python -m benchmarks.bench_load --quick             # 256 in flight, fewer lookups
    python -m benchmarks.bench_load --in-flight 256 --gc-freeze --json
    python -m benchmarks.bench_load --rate 2000 3000     # open loop: lookups arriving per second

An engine's decode loop shares kvtier's event loop, so kvtier's loop time is the engine's
latency. Each run keeps ``--in-flight`` lookups going (closed-loop workers: one ends, the
same worker starts the next), each a prefix of 1 to 31 keys from a shared key space over two
tiers that answer slowly (half the keys are in the slower one), then stores what it missed.
Each tier starts with ``--cached-keys`` existence verdicts already cached, as a node that has
run for a while has. Everything is set up before the measured window opens. A worker whose
lookup and store did not suspend yields to the loop before its next lookup (one loop step,
counted in the figures), as an engine that asks for each request from its own step does.

``--rate`` runs an open loop instead: lookups arrive at that many per second whatever the loop
does (each its own task, at most ``--max-in-flight`` at once), as requests reach an engine. A
closed loop keeps the loop saturated, and its timer lag is then about two rounds of every ready
worker whatever each lookup costs; below saturation the lag shows what each lookup's work
costs the engine at that request rate.

Per run it prints, beside the same loop idle (measured in the same process just before):

- loop lag: how late a 5 ms timer fires (p50, p99, max);
- loop time per lookup: the time the loop spent running callbacks, divided by the lookups,
  split into kvtier's (and the tiers') work and the garbage collector's (a collection runs
  inside whichever callback allocated last; the probe's own counting is left out), and the
  CPU time the loop's thread got per lookup (on a shared machine, less than the loop's time
  when other processes ran: lag and the longest step include such pauses);
- loop steps per lookup and the longest step;
- collector passes by generation, their total time, full passes per 1,000 lookups, and the
  objects that reached the oldest generation per lookup: what makes full passes frequent
  (CPython starts one when the objects promoted since the last exceed a quarter of those
  already there).

``--gc-freeze`` moves everything alive at the start into the permanent generation first
(``gc.freeze()``, what vLLM does after start-up); ``--gc-threshold N`` sets the youngest
generation's threshold (CPython's default is 700).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

import kvtier
from benchmarks.common import add_json_flag, json_output
from kvtier.testing import SlowTier

BB = 256  # bytes per block: the loop's cost, not the bytes', is measured here
KEY_SPACE = 20_000
TIMER = 0.005


@dataclass
class LoopProbe:
    """Times every callback the asyncio loop runs and every collector pass, and counts the
    objects each middle-generation pass moves to the oldest generation."""

    busy: float = 0.0
    steps: int = 0
    longest: float = 0.0
    gc_seconds: float = 0.0
    passes: list[int] = field(default_factory=lambda: [0, 0, 0])
    promoted: int = 0
    own: float = 0.0  # the probe's own counting of young objects: neither kvtier's nor gc's
    _started: float = 0.0
    _young: int = 0
    _original: Any = None

    def _collector(self, phase: str, info: dict[str, int]) -> None:
        generation = info["generation"]
        if phase == "start":
            if generation == 1:  # what survives this pass moves to the oldest generation
                counting = time.perf_counter()
                self._young = len(gc.get_objects(0)) + len(gc.get_objects(1))
                self.own += time.perf_counter() - counting
            self._started = time.perf_counter()
            return
        self.gc_seconds += time.perf_counter() - self._started
        self.passes[generation] += 1
        if generation == 1:
            self.promoted += max(self._young - info["collected"], 0)

    def __enter__(self) -> LoopProbe:
        self._original = original = asyncio.events.Handle._run
        probe = self

        def timed(handle: asyncio.events.Handle) -> None:
            started = time.perf_counter()
            original(handle)
            spent = time.perf_counter() - started
            probe.busy += spent
            probe.steps += 1
            probe.longest = max(probe.longest, spent)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        gc.callbacks.append(self._collector)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.events.Handle._run = self._original  # type: ignore[method-assign]
        gc.callbacks.remove(self._collector)


async def timer_lag(stop: anyio.Event, samples: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await anyio.sleep(TIMER)
        samples.append(time.perf_counter() - started - TIMER)


def lag_ms(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    values = np.array(samples) * 1e3
    return {
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


async def idle_lag(seconds: float = 1.0) -> dict[str, float]:
    stop, samples = anyio.Event(), list[float]()
    async with anyio.create_task_group() as tg:
        tg.start_soon(timer_lag, stop, samples)
        await anyio.sleep(seconds)
        stop.set()
    return lag_ms(samples)


async def tiers_with_history(cached_keys: int) -> tuple[list[bytes], SlowTier, SlowTier]:
    """The key space, and two slow tiers that hold half of it and remember ``cached_keys``
    verdicts about other keys each."""
    keys = kvtier.block_keys(list(range(KEY_SPACE)), 1, namespace=b"load")
    entries = 5_000 + cached_keys
    fast = SlowTier(delay=0.002, name="slow-a", max_pending=2_000, max_entries=entries)
    slow = SlowTier(delay=0.004, name="slow-b", max_pending=2_000, max_entries=entries)
    for key in keys[: KEY_SPACE // 2]:
        await slow.inner.store(key, memoryview(bytes(BB)))
    earlier = kvtier.block_keys(list(range(cached_keys)), 1, namespace=b"earlier")
    for tier in (fast, slow):
        for i, key in enumerate(earlier):
            tier.lookups.record(key, i % 2 == 0)
    return keys, fast, slow


async def one_lookup(
    scheduler: kvtier.OffloadScheduler,
    manager: kvtier.TieringManager,
    prefix: list[bytes],
    zeros: np.ndarray,
    outcome: dict[str, int],
) -> None:
    """One request: look its prefix up, then store what missed."""
    try:
        n = await scheduler.lookup(prefix, timeout=5.0)
        await manager.store(prefix[n:], zeros[: len(prefix) - n])
    except Exception:
        outcome["errors"] += 1
    else:
        outcome["hits"] += n
        outcome["keys"] += len(prefix)


async def open_loop(
    scheduler: kvtier.OffloadScheduler,
    manager: kvtier.TieringManager,
    keys: list[bytes],
    rate: float,
    lookups: int,
    max_in_flight: int,
) -> dict[str, int]:
    """``lookups`` lookups arriving at ``rate`` per second, each in a task of its own; an
    arrival finding ``max_in_flight`` lookups running is dropped (counted in ``dropped``)."""
    rng = random.Random(int(rate))
    outcome = {"errors": 0, "hits": 0, "keys": 0, "dropped": 0}
    zeros = np.zeros((32, BB), np.uint8)
    running = [0]

    async def request(prefix: list[bytes]) -> None:
        try:
            await one_lookup(scheduler, manager, prefix, zeros, outcome)
        finally:
            running[0] -= 1

    loop = asyncio.get_running_loop()
    started_at, arrived = loop.time(), 0
    async with anyio.create_task_group() as tg:
        while arrived < lookups:
            due = min(int((loop.time() - started_at) * rate) + 1, lookups)
            for _ in range(due - arrived):  # the arrivals due since the last round
                start = rng.randrange(0, KEY_SPACE - 32)
                prefix = keys[start : start + rng.randrange(1, 32)]
                if running[0] >= max_in_flight:
                    outcome["dropped"] += 1
                    continue
                running[0] += 1
                tg.start_soon(request, prefix)
            arrived = due
            await asyncio.sleep(max(started_at + arrived / rate - loop.time(), 0))
    return outcome


async def closed_loop(
    scheduler: kvtier.OffloadScheduler,
    manager: kvtier.TieringManager,
    keys: list[bytes],
    in_flight: int,
    lookups: int,
    steps: Callable[[], int],
) -> dict[str, int]:
    """``in_flight`` workers run ``lookups`` lookups (and stores of what missed) in all.

    ``steps`` counts the loop's steps: a worker whose last lookup and store never suspended
    (no other step ran since) yields before the next one. A lookup answered at once (misses,
    pool hits) and a store of small blocks never suspend, and without this one worker ran
    hundreds of lookups in one loop step (a 100 ms step at the start, when the tiers' queues
    are full); an engine asks for each request from a step of its own."""
    rng = random.Random(in_flight)
    left, outcome = [lookups], {"errors": 0, "hits": 0, "keys": 0}
    zeros = np.zeros((32, BB), np.uint8)

    async def worker() -> None:
        seen = -1
        while left[0] > 0:
            if steps() == seen:
                await anyio.lowlevel.checkpoint()
            seen = steps()
            left[0] -= 1
            start = rng.randrange(0, KEY_SPACE - 32)
            prefix = keys[start : start + rng.randrange(1, 32)]
            await one_lookup(scheduler, manager, prefix, zeros, outcome)

    async with anyio.create_task_group() as tg:
        for _ in range(in_flight):
            tg.start_soon(worker)
    return outcome


async def run(
    in_flight: int, lookups: int, cached_keys: int, rate: float | None = None
) -> dict[str, Any]:
    """One measured run, set up first; its figures. With ``rate``, an open loop of lookups
    arriving at that many per second, at most ``in_flight`` at once; else a closed loop of
    ``in_flight`` workers."""
    keys, fast, slow = await tiers_with_history(cached_keys)
    pool = kvtier.HostPool(2_000, BB)
    manager = kvtier.TieringManager(pool, [fast, slow], max_in_flight_bytes=64 * BB)
    async with manager:
        scheduler = kvtier.OffloadScheduler(manager)
        gc.collect()
        stop, samples = anyio.Event(), list[float]()
        with LoopProbe() as probe:
            started, cpu_started = time.perf_counter(), time.thread_time()
            async with anyio.create_task_group() as tg:
                tg.start_soon(timer_lag, stop, samples)
                if rate is None:
                    outcome = await closed_loop(
                        scheduler, manager, keys, in_flight, lookups, lambda: probe.steps
                    )
                else:
                    outcome = await open_loop(scheduler, manager, keys, rate, lookups, in_flight)
                stop.set()
            elapsed = time.perf_counter() - started
            cpu = time.thread_time() - cpu_started
        promotions = manager.statistics().promotions
    done = lookups - outcome.get("dropped", 0)
    per_lookup = 1e3 / max(done, 1)
    return {
        "in_flight": in_flight,
        "rate": rate,
        "lookups": done,
        "dropped": outcome.get("dropped", 0),
        "elapsed_s": elapsed,
        "lookups_per_s": done / elapsed,
        "errors": outcome["errors"],
        "prefix_hit_ratio": outcome["hits"] / max(outcome["keys"], 1),
        "promotions": promotions.succeeded,
        "lag_ms": lag_ms(samples),
        "loop_ms_per_lookup": {
            "all": (probe.busy - probe.own) * per_lookup,
            "kvtier_and_tiers": (probe.busy - probe.own - probe.gc_seconds) * per_lookup,
            "collector": probe.gc_seconds * per_lookup,
        },
        # CPU time the loop's thread got: below "all" when the machine took time away from
        # it (another process ran), which the wall-clock figures (lag, longest step) include.
        "cpu_ms_per_lookup": cpu * per_lookup,
        "steps_per_lookup": probe.steps / lookups,
        "longest_step_ms": probe.longest * 1e3,
        "gc": {
            "passes_by_generation": list(probe.passes),
            "seconds": probe.gc_seconds,
            "full_per_1000_lookups": probe.passes[2] * 1000 / lookups,
            "promoted_to_oldest_per_lookup": probe.promoted / lookups,
        },
    }


def report(idle: dict[str, float], runs: list[dict[str, Any]]) -> None:
    print(f"idle loop: timer lag p50 {idle['p50']:.2f} ms, p99 {idle['p99']:.2f} ms")
    head = (
        f"{'load':>9} {'lookups/s':>9} {'lag p50':>8} {'lag p99':>8} {'p99/idle':>9} "
        f"{'loop ms/lookup':>15} {'(gc)':>6} {'cpu':>6} {'steps':>6} {'longest':>8} "
        f"{'full gc/1k':>10} {'to oldest':>9} {'hits':>5} {'promoted':>8}"
    )
    print(head)
    for r in runs:
        lag, loop, g = r["lag_ms"], r["loop_ms_per_lookup"], r["gc"]
        print(
            f"{_load(r):>9} {r['lookups_per_s']:>9.0f} {lag['p50']:>6.1f}ms "
            f"{lag['p99']:>6.1f}ms {lag['p99'] / max(idle['p99'], 1e-3):>8.0f}x "
            f"{loop['all']:>15.3f} {loop['collector']:>6.3f} {r['cpu_ms_per_lookup']:>6.3f} "
            f"{r['steps_per_lookup']:>6.1f} "
            f"{r['longest_step_ms']:>6.1f}ms {g['full_per_1000_lookups']:>10.2f} "
            f"{g['promoted_to_oldest_per_lookup']:>9.1f} {r['prefix_hit_ratio']:>5.2f} "
            f"{r['promotions'] / r['lookups']:>8.1f}"
        )
    print("load: lookups in flight (closed loop), or arriving per second (open loop, /s)")
    if any(r["dropped"] for r in runs):
        print("dropped arrivals (in flight at the cap):", [r["dropped"] for r in runs])
    print("loop ms/lookup: callbacks run per lookup (gc: the collector's share of it); cpu: CPU")
    print("time the loop's thread got per lookup (less than loop ms when other processes took")
    print("the CPU: lag and the longest step include that); steps: callbacks per lookup;")
    print("to oldest: objects moved to the oldest generation per lookup; hits: the share of")
    print("the keys asked that the lookups counted; promoted: blocks promoted per lookup")


def _load(r: dict[str, Any]) -> str:
    return str(r["in_flight"]) if r["rate"] is None else f"{r['rate']:.0f}/s"


async def measure(args: argparse.Namespace, out: dict[str, Any]) -> None:
    idle = await idle_lag()
    runs = []
    loads: list[tuple[int, float | None]] = (
        [(n, None) for n in args.in_flight]
        if args.rate is None
        else [(args.max_in_flight, rate) for rate in args.rate]
    )
    for in_flight, rate in loads:
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        runs.append(await run(in_flight, args.lookups, args.cached_keys, rate))
        if args.gc_freeze:
            gc.unfreeze()
    out["idle_lag_ms"] = idle
    out["runs"] = runs
    out["lag_p99_of_idle"] = {
        "baseline": "idle loop, same process",
        "ratios": {_load(r): r["lag_ms"]["p99"] / max(idle["p99"], 1e-3) for r in runs},
    }
    report(idle, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--in-flight", type=int, nargs="+", default=[256, 1_000, 2_000], help="lookups in flight"
    )
    parser.add_argument(
        "--rate", type=float, nargs="+", help="open loop: lookups arriving per second (each run)"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=4_000, help="open loop: lookups running at most"
    )
    parser.add_argument("--lookups", type=int, default=20_000, help="lookups per run")
    parser.add_argument("--quick", action="store_true", help="256 in flight, 3,000 lookups")
    parser.add_argument(
        "--cached-keys", type=int, default=100_000, help="verdicts cached per tier at the start"
    )
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before each run")
    parser.add_argument("--gc-threshold", type=int, help="the youngest generation's threshold")
    add_json_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.in_flight, args.lookups = [256], 3_000
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    with json_output(args.json) as out:
        out["settings"] = {
            "in_flight": args.in_flight,
            "rate": args.rate,
            "max_in_flight": args.max_in_flight,
            "lookups": args.lookups,
            "cached_keys": args.cached_keys,
            "gc_freeze": args.gc_freeze,
            "gc_threshold": list(gc.get_threshold()),
        }
        asyncio.run(measure(args, out))


if __name__ == "__main__":
    main()
