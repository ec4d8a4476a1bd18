"""``python -m benchmarks.soak``: the seeded multi-process soak with faults and an oracle.

    python -m benchmarks.soak --quick            # about 2 minutes: fixed seeds plus a random one
    python -m benchmarks.soak                    # the long mode: --duration 1800 s
    python -m benchmarks.soak --duration 300 --seed 7 --json
    python -m benchmarks.soak --replay soak-repro-7.json
    nox -s soak [-- --quick | -- --duration 600]

It starts its own SeaweedFS on free 127.0.0.1 ports (``weed`` from the test dependencies),
mounts a tmpfs per FS folder where it may (as root; elsewhere the folders stay on disk, the
table says so, and ENOSPC is not injected; the mounts are undone at the end), and prints one
table (stderr with ``--json``, where stdout gets one JSON object). A failing run
(any wrong bytes, foreign bytes, durable loss, leak, crash or exception kvtier let out, or a
rate over its limit) writes ``soak-repro-<seed>.json`` (``--repro-dir``) and exits 1;
``--replay`` runs that file's settings again. A replay repeats every seeded choice (the ops,
the keys, the faults and their order); what it cannot repeat is the timing between
processes, so a race may take a few replays, or a longer run with the same seed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from benchmarks.soak.coordinator import RunResult, run_one, serve
from benchmarks.soak.report import failed_run, reproducer, summarize, table
from benchmarks.soak.settings import SoakSettings

QUICK_SEEDS = (20240611,)
QUICK_SECONDS = 30.0
LONG_SECONDS = 1800.0


@contextlib.contextmanager
def json_output(as_json: bool) -> Iterator[dict[str, Any]]:
    """With ``as_json``, the body's prints go to stderr and the dict is printed to stdout as
    one JSON object at the end (``benchmarks.common``'s, without importing kvtier here: the
    coordinator never imports it, so the workers alone say which kvtier a run tests)."""
    figures: dict[str, Any] = {}
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr if as_json else stdout):
        yield figures
    if as_json:
        stdout.write(json.dumps(figures, allow_nan=False) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fixed seeds plus one random seed, ~2 min")
    p.add_argument("--duration", type=float, help=f"seconds of workload (default {LONG_SECONDS:g})")
    p.add_argument("--seed", type=int, help="the seed (default: random, printed)")
    p.add_argument("--workers", type=int, default=3, help="worker processes (at least 3)")
    p.add_argument("--replay", metavar="FILE", help="run a reproducer's settings again")
    p.add_argument("--repro-dir", default=".", help="where a failing run writes its reproducer")
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs, counters)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout (the figures); the table goes to stderr",
    )
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> tuple[list[SoakSettings], int]:
    """The runs to make, and the seed to report (the random one)."""
    if args.replay:
        with open(args.replay) as f:
            data: dict[str, Any] = json.load(f)
        settings = SoakSettings.from_json(data["settings"])
        return [settings], settings.seed
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    if args.quick:
        duration = args.duration or QUICK_SECONDS
        quick = [
            SoakSettings(
                seed=s,
                duration=duration,
                workers=args.workers,
                kill_every=10.0,
                reopen_every=200,
                disk_full_every=6.0,
            )
            for s in (*QUICK_SEEDS, seed)
        ]
        return quick, seed
    long = SoakSettings(
        seed=seed,
        duration=args.duration or LONG_SECONDS,
        workers=args.workers,
        fs_fault_rate=40.0,
        s3_fault_rate=10.0,
        proxy_fault_share=0.35,
        call_fault_rate=10.0,
        call_eio_share=0.97,
        call_fault_calls=4,
        shared_fs_bytes=6 << 20,
        disk_full_every=4.0,
        lookup_run=100,
    )
    return [long], seed


async def soak(runs: list[SoakSettings], base: str, out: Any) -> list[RunResult]:
    results = []
    async with serve(base) as servers:
        for settings in runs:
            print(f"soak: seed {settings.seed}, {settings.duration:g} s ...", file=out, flush=True)
            results.append(
                await run_one(settings, servers, os.path.join(base, f"run-{settings.seed}"))
            )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workers < 3:
        raise SystemExit("--workers must be at least 3 (two share a folder, one owns one)")
    runs, seed = plan(args)
    base = tempfile.mkdtemp(prefix="kvtier-soak-")
    print(
        f"soak: seeds {[r.seed for r in runs]} (random seed {seed}); run folder {base}",
        file=sys.stderr,
    )
    failed = False
    with json_output(args.json) as figures:
        results = asyncio.run(soak(runs, base, sys.stdout))
        summary = summarize(results, seed=seed)
        print(table(summary))
        for result in results:
            if failed_run(result):
                os.makedirs(args.repro_dir, exist_ok=True)
                path = os.path.join(args.repro_dir, f"soak-repro-{result.settings.seed}.json")
                reproducer(result, path)
                summary.setdefault("reproducers", []).append(os.path.abspath(path))
                print(f"reproducer: {path} (python -m benchmarks.soak --replay {path})")
        failed = bool(summary["failures"])
        for run in summary["runs"] if failed else []:
            for finding in run["findings"][:10]:
                print(f"  seed {run['seed']}: {finding}")
        figures.update(summary)
        figures["settings"] = [dataclasses.asdict(r) for r in runs]
    if args.keep or failed:
        print(f"soak: run folder kept: {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
