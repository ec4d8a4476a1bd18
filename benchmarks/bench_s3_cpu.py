"""Client CPU per S3 request: S3Tier load/store beside raw aiobotocore get/put, same run.

On a machine with few cores the S3 tier competes with the engine for CPU: what a request
costs in *this* process (botocore's request building and signing, aiohttp, kvtier's retry and
breaker wrapper, the checksum and copy) decides whether loading a block beats recomputing it.
The figure is ``time.process_time()`` of this process (every thread, so work handed to worker
threads counts too) divided by the requests made; the server is another process and is not
counted. Wall time per request is printed beside it.

Sides, for each block size and concurrency:

- ``raw``: a plain aiobotocore client with botocore's defaults (as a user's would be):
  ``put_object`` of the payload, ``get_object`` + ``read()``;
- ``raw-tuned``: the same calls through a client made as the tier makes its own (its
  ``AioConfig``, session and handlers: no payload signing, checksums only when required, a
  fixed user agent, no parameter validation, a cheaper timestamp parser, ``bytes`` bodies
  sent as they are), to tell the client
  configuration's share from the tier's own work (header, checksums, copy, retry wrapper);
- ``tier``: ``S3Tier.store`` (header, xxh3, CRC32, conditional put) and ``S3Tier.load``
  (checksum verified, copied into a block buffer).

Sides alternate within each round and each figure is the median of ``--repeat`` rounds, so
drift on a shared machine hits all sides alike. It runs against ``--s3-endpoint``;
``nox -s bench -- bench_s3_cpu`` starts a SeaweedFS on 127.0.0.1 for it. ``--json`` prints one
JSON object: a row per case, side and operation, and the tier's CPU as a ratio of each raw side.

The ``raw-tuned`` side builds its client with the tier's own (private) client helpers: it
measures the tier's configuration, so it cannot use anything else.

    python3 -m nox -s bench -- bench_s3_cpu
    python3 -m nox -s bench -- bench_s3_cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio

from benchmarks.bench_s3 import Loader, raw_get
from benchmarks.common import (
    add_json_flag,
    add_s3_options,
    json_output,
    raw_client,
    s3_tier,
    settings,
)
from kvtier import S3Config, S3Tier, block_keys
from kvtier.tiers.s3._client import client_config, send_bodies_as_given, shared_session

KiB = 1 << 10
SIDES = ("raw", "raw-tuned", "tier")


async def _measure(
    concurrency: int, jobs: Sequence[Callable[[], Awaitable[Any]]]
) -> tuple[float, float]:
    """Run ``jobs`` with at most ``concurrency`` at once; (CPU s, wall s) per job."""
    limiter = anyio.CapacityLimiter(concurrency)

    async def run(job: Callable[[], Awaitable[Any]]) -> None:
        async with limiter:
            await job()

    cpu, wall = time.process_time(), time.perf_counter()
    if concurrency == 1:
        for job in jobs:
            await job()
    else:
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(run, job)
    return (time.process_time() - cpu) / len(jobs), (time.perf_counter() - wall) / len(jobs)


@contextlib.asynccontextmanager
async def tuned_client(args: argparse.Namespace) -> AsyncIterator[Any]:
    """A client built as ``S3Tier.open`` builds its own: same session, same ``AioConfig``."""
    config = S3Config(
        bucket=args.s3_bucket,
        endpoint_url=args.s3_endpoint,
        region_name=args.s3_region,
        read_timeout=30.0,
        max_attempts=1,
    )
    async with shared_session().create_client(
        "s3",
        endpoint_url=args.s3_endpoint,
        region_name=args.s3_region,
        aws_access_key_id=args.access_key,
        aws_secret_access_key=args.secret_key,
        config=client_config(config),
    ) as client:
        send_bodies_as_given(client)
        yield client


async def _case(
    args: argparse.Namespace,
    clients: dict[str, Any],
    tier: S3Tier,
    block: int,
    concurrency: int,
    order: Sequence[str],
) -> dict[tuple[str, str], tuple[float, float]]:
    """One round of one (block, concurrency) case: put/store then get/load on every side."""
    run_id = uuid.uuid4().hex[:12]
    payloads = [os.urandom(block) for _ in range(4)]
    keys = block_keys(list(range(args.n * 4)), 4, namespace=run_id.encode())
    data = [payloads[i % len(payloads)] for i in range(len(keys))]
    names = {side: [f"cpu-{side}/{run_id}/{k.hex()}" for k in keys] for side in SIDES[:2]}
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for side in order:
        if side == "tier":
            jobs = [
                functools.partial(tier.store, k, memoryview(d))
                for k, d in zip(keys, data, strict=True)
            ]
        else:
            c = clients[side]
            jobs = [
                functools.partial(c.put_object, Bucket=args.s3_bucket, Key=n, Body=d)
                for n, d in zip(names[side], data, strict=True)
            ]
        out[(side, "put")] = await _measure(concurrency, jobs)
    for side in order:
        if side == "tier":
            loader = Loader(tier, concurrency, block)
            jobs = [functools.partial(loader.load, k) for k in keys]
        else:
            jobs = [
                functools.partial(raw_get, clients[side], args.s3_bucket, n) for n in names[side]
            ]
        out[(side, "get")] = await _measure(concurrency, jobs)
    return out


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with (
        raw_client(args, max_pool_connections=32, read_timeout=30.0) as raw,
        tuned_client(args) as tuned,
    ):
        with contextlib.suppress(Exception):  # it may exist already
            await raw.create_bucket(Bucket=args.s3_bucket)
        clients = {"raw": raw, "raw-tuned": tuned}
        async with s3_tier(args, f"cpu-tier/{uuid.uuid4().hex[:12]}") as tier:
            # One warm-up round (connections, botocore's lazily built handlers), not counted.
            await _case(args, clients, tier, 64 * KiB, 8, SIDES)
            for block in args.block_kib:
                for concurrency in args.concurrency:
                    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
                    for r in range(args.repeat):
                        order = SIDES if r % 2 == 0 else SIDES[::-1]
                        got = await _case(args, clients, tier, block * KiB, concurrency, order)
                        for k, v in got.items():
                            samples.setdefault(k, []).append(v)
                    for (side, op), vs in samples.items():
                        rows.append(
                            {
                                "block_kib": block,
                                "concurrency": concurrency,
                                "side": side,
                                "op": op,
                                "cpu_ms": 1e3 * statistics.median(v[0] for v in vs),
                                "wall_ms": 1e3 * statistics.median(v[1] for v in vs),
                            }
                        )
    return rows


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Print the table; return the tier's CPU per request against each raw side, per case."""
    print(
        f"S3 client CPU per request: N={args.n} per side, median of {args.repeat} rounds, "
        f"endpoint {args.s3_endpoint} (process_time of this process; the server is not counted)"
    )
    by = {(r["block_kib"], r["concurrency"], r["side"], r["op"]): r for r in rows}
    print(
        f"  {'block':>8} {'conc':>4} {'op':<4} "
        + " ".join(f"{s + ' cpu ms':>16}" for s in SIDES)
        + f" {'tier/raw':>9} {'tier/tuned':>10}   wall ms (raw/tuned/tier)"
    )
    ratios = []
    for block in args.block_kib:
        for concurrency in args.concurrency:
            for op in ("put", "get"):
                got = [by[(block, concurrency, s, op)] for s in SIDES]
                cpu = [g["cpu_ms"] for g in got]
                wall = "/".join(f"{g['wall_ms']:.2f}" for g in got)
                ratios.append(
                    {
                        "block_kib": block,
                        "concurrency": concurrency,
                        "op": op,
                        "tier_cpu_of_raw": cpu[2] / cpu[0],
                        "tier_cpu_of_raw_tuned": cpu[2] / cpu[1],
                    }
                )
                print(
                    f"  {block:>5} KiB {concurrency:>4} {op:<4} "
                    + " ".join(f"{c:>16.3f}" for c in cpu)
                    + f" {cpu[2] / cpu[0]:>9.2f} {cpu[2] / cpu[1]:>10.2f}   {wall}"
                )
    print("  (put: raw put_object / tier store; get: raw get_object + read() / tier load)")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_s3_options(parser, bucket="kvtier-bench-cpu")
    add_json_flag(parser)
    parser.add_argument("-n", type=int, default=200, help="requests per side per round")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N=100, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.repeat = 100, 1
    with json_output(args.json) as out:
        out["settings"] = settings(
            args, "quick", "n", "block_kib", "concurrency", "repeat", "s3_endpoint"
        )
        out["rows"] = rows = anyio.run(run, args)
        out["ratios"] = _print(rows, args)
        out["baselines"] = {"tier_cpu_of_raw": "raw", "tier_cpu_of_raw_tuned": "raw-tuned"}
    return 0


if __name__ == "__main__":
    sys.exit(main())
