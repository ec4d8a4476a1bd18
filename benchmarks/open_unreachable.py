"""How long a manager over FS + S3 takes to open when the S3 endpoint cannot be reached,
against the same manager over FS alone, in the same run.

    python -m benchmarks.open_unreachable            # 5 opens of each case
    python -m benchmarks.open_unreachable --opens 20 --json

A tier that cannot open must not stop the manager: it opens with the tiers that do and takes
the other in when it answers (docs/operating.md, "Failure modes"). The cases, with the
manager's default settings, each opened ``--opens`` times in turn:

- ``fs_alone``: ``TieringManager(HostPool, [FSTier])``, the baseline;
- ``s3_refused``: FS + an S3 tier whose endpoint is a closed port on 127.0.0.1 (refused at
  once; the first attempt fails and is not waited for);
- ``s3_silent``: FS + an S3 tier whose endpoint accepts connections and never answers a byte
  (``tier_answer_wait`` lets it go).

Each figure is from entering the manager until its ``__aenter__`` returns, in a process whose
S3 model is already parsed (``S3Tier.warm_up``: local work a fresh process does once, before
the wait starts); every open checks that the S3 tier is unavailable and the FS tier serves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import kvtier
from benchmarks.common import add_json_flag, json_output
from devtools.silent_endpoint import silent_endpoint

BLOCK = 4096


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opens", type=int, default=5, help="opens of each case")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.opens < 1:
        parser.error("--opens must be at least 1")
    return args


def refused_endpoint() -> str:
    """The URL of a port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def s3_tier(url: str) -> kvtier.S3Tier:
    return kvtier.S3Tier(
        "kvtier-open",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="unused",
        aws_secret_access_key="unused",
        prefix="open",
        name="s3",
    )


async def one_open(root: str, key: bytes, url: str | None) -> float:
    """Seconds to enter a manager over the FS tier at ``root`` (and S3 at ``url``)."""
    tiers: list[kvtier.SecondaryTier] = [kvtier.FSTier(root, fsync="never", name="fs")]
    if url is not None:
        tiers.append(s3_tier(url))
    manager = kvtier.TieringManager(kvtier.HostPool(8, BLOCK), tiers)
    started = time.perf_counter()
    async with manager:
        seconds = time.perf_counter() - started
        expected = () if url is None else ("s3",)
        if manager.statistics().opens.unavailable != expected:
            raise RuntimeError(f"unavailable tiers {manager.statistics().opens.unavailable}")
        if await manager.wait_settled(key, timeout=10) is not kvtier.LookupResult.HIT:
            raise RuntimeError("the FS tier did not serve its block")
    return seconds


async def run(opens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvtier-open-") as root:
        key = os.urandom(16)
        async with kvtier.FSTier(root, fsync="never") as fs:
            await fs.store(key, memoryview(os.urandom(BLOCK)))
        await s3_tier(refused_endpoint()).warm_up()
        seconds: dict[str, list[float]] = {"fs_alone": [], "s3_refused": [], "s3_silent": []}
        async with silent_endpoint() as silent:
            for _ in range(opens):
                seconds["fs_alone"].append(await one_open(root, key, None))
                seconds["s3_refused"].append(await one_open(root, key, refused_endpoint()))
                seconds["s3_silent"].append(await one_open(root, key, silent))
    medians = {case: statistics.median(values) for case, values in seconds.items()}
    return {
        "opens": opens,
        "tier_answer_wait": kvtier.ManagerConfig().tier_answer_wait,
        "seconds": {
            case: {"min": min(v), "median": medians[case], "max": max(v)}
            for case, v in seconds.items()
        },
        "over_fs_alone": {
            case: medians[case] / medians["fs_alone"] for case in ("s3_refused", "s3_silent")
        },
        "aim_seconds": 1.0,
        "load_average": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with json_output(args.json) as out:
        result = asyncio.run(run(args.opens))
        out.update(result)
        print(
            f"{args.opens} opens of each case, tier_answer_wait {result['tier_answer_wait']:g} s, "
            f"load average {result['load_average']:.1f}"
        )
        for case, s in result["seconds"].items():
            print(
                f"  {case:11} min {s['min']:.3f} s  median {s['median']:.3f} s  "
                f"max {s['max']:.3f} s"
            )
        ratios = result["over_fs_alone"]
        print(
            f"  over fs_alone: refused {ratios['s3_refused']:.1f}x, "
            f"silent {ratios['s3_silent']:.1f}x (aim: open within {result['aim_seconds']:g} s)"
        )


if __name__ == "__main__":
    main()
