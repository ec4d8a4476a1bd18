"""The demo's TTFT speedup for several tier setups, each against a baseline from the same round.

One ``serve_demo.py`` invocation measures one setup, and a shared machine drifts between
invocations, so comparing the FS-only speedup of one run with the FS + S3 speedup of another
says more about the machine than about kvtier. This benchmark runs the demo's workload in one
process, round after round: each round first without kvtier, then once per setup (in an order
that rotates between rounds), each setup with an empty pool, an empty file tier and a fresh S3
prefix. It prints, per setup, the median over rounds of the TTFT p50 and p95 speedup against
that round's own baseline, and each setup's p50 speedup as a share of the FS-only one in the
same round.

Each setup runs twice a round, with the demo engine's prefetch (``OffloadScheduler.prefetch``
when a request joins the queue, the default) and without it (the prefetch rows; the order
alternates between rounds): the gain is the TTFT p50 (and p95) without prefetch over the TTFT
with it, in the same round, medians over rounds. ``--no-prefetch-rows`` skips them.

    python3 -m nox -s bench -- bench_demo_tiers          # 3 rounds, about 5 minutes
    python3 -m nox -s bench -- bench_demo_tiers --rounds 5 --setups fs fs+s3 fs+s3-through

Setups: ``fs`` (the demo's default), ``fs+s3`` (S3 below the file tier, its writes paced and
deferred, the demo's default there), ``fs+s3-through`` (every block written through to S3 as
it is stored), ``s3`` (S3 only), ``memory`` (a ``MemoryTier`` instead of S3: it answers every
lookup at once and loads without waiting, so no request waits for a block it holds). The
memory setup is the ceiling of prefetch: prefetching can hide a tier's waits, and it has none.
It runs once a round, without the prefetch rows; with it, each setup's p50 speedup is also
given as a share of the memory setup's in the same round, and each setup's prefetch gain
beside its bound, the memory setup's TTFT p50 against the setup's without prefetch.
``delayed`` (a ``DelayedTier`` over memory, the demo's ``--slow-tier``: every existence check,
load and store waits ``DELAY_S``, and costs no CPU) splits that bound in two: an object store
costs the engine both its waits and its CPU (here SeaweedFS and the S3 client run on the
engine's cores), and prefetch can hide only the waits. The delayed setup has an object
store's waits and none of its CPU, so its bound is what prefetch could gain from waits alone.

Needs the ``s3`` and ``torch`` extras and an S3 endpoint (``--s3-endpoint``; ``nox -s bench``
starts a SeaweedFS on 127.0.0.1 and passes it with its process id, whose CPU is reported). The
demo's engine comes from ``examples/demo_engine.py``, imported as ``examples.demo_engine``:
run it from the repository root as ``python -m benchmarks.bench_demo_tiers``. ``--json`` prints
one JSON object: per setup the median speedups against the round's baseline without kvtier,
the share of the FS-only speedup and the store's CPU, every round's ratios, and (``no_prefetch``,
``prefetch_gain_p50``/``_p95``) the same setup without prefetch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import kvtier
from benchmarks.common import add_json_flag, add_s3_options, json_output, server_cpu_reader
from examples import demo_engine as demo

DELAY_S = 0.03
"""Seconds per operation of the ``delayed`` setup's tier: about what one request to a
regional object store waits before its first byte."""

SETUPS: dict[str, list[str]] = {
    "fs": [],
    "fs+s3": ["--s3"],  # the demo's default: S3 writes paced and deferred
    "fs+s3-through": ["--s3", "--s3-write-through"],
    "s3": ["--s3", "--fs-capacity-mb", "0"],
    "memory": ["--fs-capacity-mb", "0"],  # and a MemoryTier: see `measure`
    "delayed": ["--fs-capacity-mb", "0", "--slow-tier", str(DELAY_S)],
}
CEILING = "memory"


async def measure(
    demo_args: argparse.Namespace,
    engine: demo.Engine,
    sessions: Sequence[Sequence[demo.Request]],
    label: str,
    server_cpu: Callable[[], float],
    prefetch: bool = True,
    *,
    in_memory: bool = False,
) -> tuple[demo.RunResult, float]:
    """One run of the workload with kvtier set up as ``demo_args`` say (``in_memory``: a
    ``MemoryTier`` as the one secondary tier), from empty tiers, and the CPU seconds SeaweedFS
    spent while it served (it runs on the engine's cores here)."""
    async with AsyncExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-demo-"))
        tiers: list[kvtier.SecondaryTier] = (
            [kvtier.MemoryTier(CEILING)] if in_memory else demo.make_tiers(demo_args, scratch)
        )
        pool = kvtier.HostPool(demo_args.pool_blocks, engine.config.block_bytes)
        manager = await stack.enter_async_context(
            demo.make_manager(demo_args, pool, tiers, kvtier.LatencyHistograms())
        )
        tiering = demo.KVTier(manager, kvtier.OffloadScheduler(manager), prefetch=prefetch)
        before = server_cpu()
        run = await demo.run_workload(label, engine, sessions, tiering, demo_args.decode_tokens)
        return run, server_cpu() - before


def speedups(base: demo.RunResult, run: demo.RunResult) -> tuple[float, float]:
    b, t = base.ttfts(), run.ttfts()
    p50, p95 = (demo.percentile(b, q) / demo.percentile(t, q) for q in (50, 95))
    return p50, p95


async def amain(
    args: argparse.Namespace, seaweed_cpu: Callable[[], float], out: dict[str, Any]
) -> None:
    common = ["--quick"] if args.quick else []
    base_args = demo.parse_args(common)
    engine, sessions = await demo.start_engine(base_args)

    ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in args.setups}
    without_prefetch: dict[str, list[tuple[float, float]]] = {name: [] for name in args.setups}
    gains: dict[str, list[tuple[float, float]]] = {name: [] for name in args.setups}
    server_cpu: dict[str, list[float]] = {name: [] for name in args.setups}
    bounds: dict[str, list[float]] = {name: [] for name in args.setups}
    for round_ in range(args.rounds):
        base = await demo.run_workload(
            "without kvtier", engine, sessions, None, base_args.decode_tokens
        )
        shift = round_ % len(args.setups)
        for name in args.setups[shift:] + args.setups[:shift]:
            s3 = ["--s3-endpoint", args.s3_endpoint, "--s3-bucket", args.s3_bucket]
            setup = [flag for f in SETUPS[name] for flag in (s3 if f == "--s3" else [f])]
            flags = [*common, *setup, "--s3-prefix", f"bench-demo/{round_}/{name}/"]
            if not args.prefetch_rows or name == CEILING:
                demo_args = demo.parse_args(flags)
                run, cpu = await measure(
                    demo_args, engine, sessions, name, seaweed_cpu, in_memory=name == CEILING
                )
                ratios[name].append(speedups(base, run))
                server_cpu[name].append(cpu / run.wall)
                continue
            runs: dict[bool, demo.RunResult] = {}
            for prefetch in (True, False) if round_ % 2 == 0 else (False, True):
                prefix = flags[-1] + ("" if prefetch else "no-prefetch/")  # empty tiers
                demo_args = demo.parse_args([*flags[:-1], prefix])
                label = name + ("" if prefetch else " no prefetch")
                runs[prefetch], cpu = await measure(
                    demo_args, engine, sessions, label, seaweed_cpu, prefetch
                )
                if prefetch:
                    server_cpu[name].append(cpu / runs[prefetch].wall)
            ratios[name].append(speedups(base, runs[True]))
            without_prefetch[name].append(speedups(base, runs[False]))
            gains[name].append(speedups(runs[False], runs[True]))
        if CEILING in ratios and args.prefetch_rows:
            # The ceiling's speedup over this setup's without prefetch: all prefetch could gain.
            ceiling = ratios[CEILING][-1][0]
            for name in args.setups:
                if name != CEILING:
                    bounds[name].append(ceiling / without_prefetch[name][-1][0])
        line = ", ".join(f"{n} {ratios[n][-1][0]:.2f}x" for n in args.setups)
        if args.prefetch_rows:
            line += "; prefetch gain " + ", ".join(
                f"{n} {gains[n][-1][0]:.2f}x"
                + (f" (bound {bounds[n][-1]:.2f}x)" if bounds[n] else "")
                for n in args.setups
                if n != CEILING
            )
        print(f"round {round_ + 1}/{args.rounds}: TTFT p50 speedup {line}", flush=True)

    print()
    print(
        f"{'setup':<16}{'TTFT p50':>10}{'TTFT p95':>10}{'p50 share of fs':>17}{'SeaweedFS CPU':>15}"
        + (f"{'share of memory':>17}" if CEILING in ratios else "")
    )
    setups: dict[str, Any] = {}
    out["setups"] = setups
    for name in args.setups:
        p50 = statistics.median(r[0] for r in ratios[name])
        p95 = statistics.median(r[1] for r in ratios[name])
        share = "-"
        setups[name] = {
            "baseline": "without kvtier, same round",
            "ttft_p50_speedup": p50,
            "ttft_p95_speedup": p95,
            "rounds": [{"ttft_p50": a, "ttft_p95": b} for a, b in ratios[name]],
        }
        if "fs" in ratios:
            shares = [r[0] / f[0] for r, f in zip(ratios[name], ratios["fs"], strict=True)]
            setups[name]["p50_share_of_fs"] = statistics.median(shares)
            share = f"{statistics.median(shares):.0%}"
        cores = statistics.median(server_cpu[name])
        setups[name]["server_cpu_cores"] = cores
        of_memory = ""
        if CEILING in ratios:
            shares = [r[0] / c[0] for r, c in zip(ratios[name], ratios[CEILING], strict=True)]
            setups[name]["p50_share_of_memory"] = statistics.median(shares)
            of_memory = f"{statistics.median(shares):>17.0%}"
        print(f"{name:<16}{p50:>8.2f} x{p95:>8.2f} x{share:>17}{cores:>9.2f} cores{of_memory}")
        if args.prefetch_rows and name != CEILING:
            off = without_prefetch[name]
            setups[name]["no_prefetch"] = {
                "ttft_p50_speedup": statistics.median(r[0] for r in off),
                "ttft_p95_speedup": statistics.median(r[1] for r in off),
                "rounds": [{"ttft_p50": a, "ttft_p95": b} for a, b in off],
            }
            gain_p50 = statistics.median(g[0] for g in gains[name])
            gain_p95 = statistics.median(g[1] for g in gains[name])
            setups[name]["prefetch_gain_p50"] = gain_p50
            setups[name]["prefetch_gain_p95"] = gain_p95
            setups[name]["prefetch_gain_rounds"] = [
                {"ttft_p50": a, "ttft_p95": b} for a, b in gains[name]
            ]
            bound = ""
            if bounds[name]:
                setups[name]["prefetch_gain_bound_p50"] = statistics.median(bounds[name])
                bound = f" (bound p50 {statistics.median(bounds[name]):.2f} x)"
            print(
                f"{'  no prefetch':<16}{setups[name]['no_prefetch']['ttft_p50_speedup']:>8.2f} x"
                f"{setups[name]['no_prefetch']['ttft_p95_speedup']:>8.2f} x"
                f"   prefetch gain p50 {gain_p50:.2f} x, p95 {gain_p95:.2f} x{bound}"
            )
    print(
        f"(medians over {args.rounds} rounds; each speedup against its own round's baseline; "
        f"SeaweedFS CPU: its CPU seconds per second of serving, of the {os.cpu_count()} cores "
        "the engine also runs on)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the demo's small workload")
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument(
        "--no-prefetch-rows",
        dest="prefetch_rows",
        action="store_false",
        help="run each setup only with prefetch (the demo engine's default)",
    )
    add_s3_options(p, bucket="kvtier-bench")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.rounds <= 0:
        p.error("--rounds must be positive")
    seaweed_cpu = server_cpu_reader(args.s3_server_pid) or (lambda: float("nan"))
    with json_output(args.json) as out:
        out["settings"] = {
            "rounds": args.rounds,
            "quick": args.quick,
            "setups": args.setups,
            "prefetch_rows": args.prefetch_rows,
            "s3_endpoint": args.s3_endpoint,
            "cpu_count": os.cpu_count(),
        }
        asyncio.run(amain(args, seaweed_cpu, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
