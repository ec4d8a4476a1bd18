"""Packs against one object per block: what storing and loading a request's blocks costs.

A serving engine stores a request's new blocks together and, on another node, loads a
request's prefix together. This benchmark does exactly that with 256 KiB blocks, ``--group``
blocks per request, ``--requests`` requests, ``--concurrency`` requests at a time, three ways
on the same SeaweedFS in the same run:

- ``raw``: plain aiobotocore (botocore's defaults), one PUT and one GET per block;
- ``tier, 1 per object``: ``S3Tier(pack_blocks=1)``, one object per block;
- ``tier, packs``: ``S3Tier`` with its default packs: a request's stores share one PUT, and its
  loads, on a fresh tier that learnt the packs from its listing at open (another node), share
  one ranged GET.

Figures: MiB/s, requests sent, and CPU per block: this process's (``time.process_time``, all
threads) and the store's (given its process id, ``--s3-server-pid``, as ``nox -s bench``
gives SeaweedFS's). Sides alternate and each figure is the median of ``--repeat`` rounds, so
drift on a shared machine hits every side alike. ``--json`` prints one JSON object: per side
the figures and requests sent, and each tier side's throughput as a ratio of raw's.

    python3 -m nox -s bench -- bench_s3_packs
    python -m benchmarks.bench_s3_packs --s3-endpoint URL --quick
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio

from benchmarks.common import (
    add_json_flag,
    add_s3_options,
    json_output,
    s3_tier,
    server_cpu_reader,
    settings,
)
from kvtier import S3Tier, block_keys

MiB = 1 << 20
SIDES = ("raw", "tier, 1 per object", "tier, packs")


class Meter:
    """Wall, this process's CPU and the server's CPU over one phase."""

    def __init__(self, server_cpu: Callable[[], float] | None) -> None:
        self._server_cpu = server_cpu

    async def run(self, phase: Callable[[], Awaitable[None]]) -> tuple[float, float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        server = self._server_cpu() if self._server_cpu else 0.0
        await phase()
        server = (self._server_cpu() - server) if self._server_cpu else float("nan")
        return time.perf_counter() - wall, time.process_time() - cpu, server


async def _in_groups(
    args: argparse.Namespace,
    groups: list[list[int]],
    job: Callable[[int], Coroutine[Any, Any, None]],
) -> None:
    """``--concurrency`` requests at a time; each request's blocks all at once."""
    limiter = anyio.CapacityLimiter(args.concurrency)

    async def request(group: list[int]) -> None:
        async with limiter, anyio.create_task_group() as tg:
            for i in group:
                tg.start_soon(job, i)

    async with anyio.create_task_group() as tg:
        for group in groups:
            tg.start_soon(request, group)


def _tier(args: argparse.Namespace, prefix: str, packs: bool) -> S3Tier:
    return s3_tier(args, prefix, pack_blocks=args.group if packs else 1)


Phase = tuple[float, float, float]  # wall, client CPU, server CPU seconds


async def _raw(
    args: argparse.Namespace, meter: Meter, prefix: str, payloads: list[bytes], out: list[bytearray]
) -> tuple[Phase, Phase, tuple[int, int]]:
    import aiobotocore.session

    groups = _groups(args)
    async with aiobotocore.session.get_session().create_client(
        "s3",
        endpoint_url=args.s3_endpoint,
        region_name=args.s3_region,
        aws_access_key_id=args.access_key,
        aws_secret_access_key=args.secret_key,
    ) as client:

        async def put(i: int) -> None:
            body = payloads[i % len(payloads)]
            await client.put_object(Bucket=args.s3_bucket, Key=f"{prefix}/{i}", Body=body)

        async def get(i: int) -> None:
            response = await client.get_object(Bucket=args.s3_bucket, Key=f"{prefix}/{i}")
            async with response["Body"] as body:
                out[i][:] = await body.read()

        store = await meter.run(lambda: _in_groups(args, groups, put))
        load = await meter.run(lambda: _in_groups(args, groups, get))
    return store, load, (len(out), len(out))


async def _tiered(
    args: argparse.Namespace,
    meter: Meter,
    prefix: str,
    payloads: list[bytes],
    out: list[bytearray],
    packs: bool,
) -> tuple[Phase, Phase, tuple[int, int]]:
    groups = _groups(args)
    keys = block_keys(list(range(len(out) * 4)), 4, namespace=os.urandom(8))
    async with _tier(args, prefix, packs) as writer:

        async def store_one(i: int) -> None:
            await writer.store(keys[i], memoryview(payloads[i % len(payloads)]))

        store = await meter.run(lambda: _in_groups(args, groups, store_one))
        written = writer.statistics()
    async with _tier(args, prefix, packs) as reader:  # another node: it lists the prefix
        await reader.wait_index_loaded()  # loads are timed, not the listing

        async def load_one(i: int) -> None:
            await reader.load(keys[i], memoryview(out[i]))

        load = await meter.run(lambda: _in_groups(args, groups, load_one))
        read = reader.statistics()
    puts = written.packs_written + written.stores - written.blocks_packed
    gets = read.pack_gets + read.loads - read.pack_sections_read
    return store, load, (puts, gets)


def _groups(args: argparse.Namespace) -> list[list[int]]:
    return [list(range(r * args.group, (r + 1) * args.group)) for r in range(args.requests)]


async def _round(
    args: argparse.Namespace,
    meter: Meter,
    payloads: list[bytes],
    results: dict[str, list[tuple[Phase, Phase, tuple[int, int]]]],
    number: int,
) -> None:
    n = args.requests * args.group
    for side in SIDES if number % 2 == 0 else reversed(SIDES):
        prefix = f"bench-packs/{uuid.uuid4().hex}"
        out = [bytearray(len(payloads[0])) for _ in range(n)]
        if side == "raw":
            result = await _raw(args, meter, prefix, payloads, out)
        else:
            result = await _tiered(args, meter, prefix, payloads, out, side == "tier, packs")
        assert all(out[i] == payloads[i % len(payloads)] for i in range(n)), side
        results.setdefault(side, []).append(result)


def _median(rounds: list[tuple[Phase, Phase, tuple[int, int]]], phase: int, what: int) -> float:
    return statistics.median(r[phase][what] for r in rounds)


def _report(
    args: argparse.Namespace,
    results: dict[str, list[tuple[Phase, Phase, tuple[int, int]]]],
    out: dict[str, Any],
) -> None:
    n = args.requests * args.group
    mib = n * args.block_kib / 1024
    print(
        f"S3 packs: {args.requests} requests x {args.group} blocks of {args.block_kib} KiB, "
        f"{args.concurrency} requests at a time, median of {args.repeat} rounds"
    )
    print(
        f"  {'side':<20}{'store MiB/s':>12}{'load MiB/s':>12}{'PUTs':>6}{'GETs':>6}"
        f"{'client ms/block store, load':>30}{'server ms/block store, load':>30}"
    )
    sides: dict[str, dict[str, Any]] = {}
    out["sides"] = sides
    for side in SIDES:
        rounds = results[side]
        med = functools.partial(_median, rounds)
        puts, gets = rounds[-1][2]
        row = sides[side] = {
            "store_mib_s": mib / med(0, 0),
            "load_mib_s": mib / med(1, 0),
            "puts": puts,
            "gets": gets,
            "client_ms_per_block": {"store": med(0, 1) * 1000 / n, "load": med(1, 1) * 1000 / n},
            "server_ms_per_block": {"store": med(0, 2) * 1000 / n, "load": med(1, 2) * 1000 / n},
        }
        client, server = row["client_ms_per_block"], row["server_ms_per_block"]
        print(
            f"  {side:<20}{row['store_mib_s']:>12.1f}{row['load_mib_s']:>12.1f}{puts:>6}{gets:>6}"
            f"{client['store']:>17.2f}, {client['load']:>5.2f}"
            f"{server['store']:>24.2f}, {server['load']:>5.2f}"
        )
        if side != "raw":
            row["of_raw"] = {
                "baseline": "raw",
                "store": row["store_mib_s"] / sides["raw"]["store_mib_s"],
                "load": row["load_mib_s"] / sides["raw"]["load_mib_s"],
            }
            print(
                f"  {'':<20}{row['of_raw']['store']:>11.2f}x{row['of_raw']['load']:>11.2f}x  of raw"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_s3_options(p, bucket="kvtier-bench")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--group", type=int, default=8, help="blocks per request (and per pack)")
    p.add_argument("--block-kib", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4, help="requests at a time")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a few requests, one round")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.repeat = 4, 1
    payloads = [os.urandom(args.block_kib << 10) for _ in range(args.group)]
    with json_output(args.json) as out:
        out["settings"] = settings(
            args, "quick", "requests", "group", "block_kib", "concurrency", "repeat"
        )
        results: dict[str, list[tuple[Phase, Phase, tuple[int, int]]]] = {}
        meter = Meter(server_cpu_reader(args.s3_server_pid))
        for number in range(args.repeat):
            anyio.run(_round, args, meter, payloads, results, number)
        _report(args, results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
