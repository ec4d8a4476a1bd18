"""Listing a prefix of many objects: pages parsed in a worker thread against botocore's own
parse on the event loop, same client configuration, same prefix, same run.

The S3 index lists the whole prefix at open (without a snapshot) and at every audit. botocore
parses each page on the thread that awaits it, after reading it once more for an error sent
with status 200; ``kvtier.tiers.s3._listing_xml`` parses pages over 32 KiB in a worker thread
instead. Sides, alternated within each round:

- ``botocore``: a client made as the tier made its own before (session, ``AioConfig``,
  handlers), pages parsed by botocore;
- ``thread``: the same client with the tier's listing hook (``parse_listings_off_the_loop``).

Each side lists the whole prefix page by page (1,000 objects a page) and reads every key, as
the index's listing does, while a task on the same loop sleeps 1 ms at a time and records how
late it wakes (the loop's stalls; the objects made before are frozen out of the collector's
reach, as docs/operating.md advises an engine after start-up). Figures, medians over
``--repeat`` rounds: wall time, this process's CPU (every thread), the longest stall and the
99th percentile; ratios of the thread side to botocore's. The object store is another
process and is not counted.

    python3 -m nox -s bench -- bench_s3_listing
    python3 -m nox -s bench -- bench_s3_listing --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import uuid
from typing import Any

import anyio

from benchmarks.bench_s3_cpu import tuned_client
from benchmarks.common import add_json_flag, add_s3_options, json_output, raw_client, settings
from kvtier.tiers.s3._listing_xml import parse_listings_off_the_loop

SIDES = ("botocore", "thread")


async def fill(args: argparse.Namespace, prefix: str) -> None:
    """Put ``--objects`` small objects under ``prefix``, named as the tier names blocks."""
    limiter = anyio.CapacityLimiter(64)
    async with raw_client(args) as client:

        async def put(index: int) -> None:
            name = uuid.UUID(int=index * 0x9E3779B97F4A7C15 % (1 << 128)).hex
            async with limiter:
                await client.put_object(
                    Bucket=args.s3_bucket, Key=f"{prefix}/{name[:2]}/{name}", Body=b"x" * 64
                )

        async with anyio.create_task_group() as tg:
            for index in range(args.objects):
                tg.start_soon(put, index)


async def empty(args: argparse.Namespace, prefix: str) -> None:
    async with raw_client(args) as client:
        paginator = client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=args.s3_bucket, Prefix=prefix + "/"):
            names = [{"Key": item["Key"]} for item in page.get("Contents", ())]
            if names:
                await client.delete_objects(Bucket=args.s3_bucket, Delete={"Objects": names})


async def list_all(client: Any, bucket: str, prefix: str) -> int:
    """Every key under ``prefix``, page by page; how many."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix + "/", "MaxKeys": 1000}
    found = 0
    while True:
        page = await client.list_objects_v2(**kwargs)
        found += sum(1 for item in page.get("Contents", ()) if item["Key"])
        if not page.get("IsTruncated"):
            return found
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


async def measure(client: Any, bucket: str, prefix: str) -> dict[str, float]:
    """One listing of the prefix with the loop's stalls recorded beside it."""
    stalls: list[float] = []
    listed = 0

    async def lister() -> None:
        nonlocal listed
        listed = await list_all(client, bucket, prefix)

    wall, cpu = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lister)
        while listed == 0:
            before = time.perf_counter()
            await anyio.sleep(0.001)
            stalls.append(time.perf_counter() - before - 0.001)
    stalls.sort()
    return {
        "objects": listed,
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "stall_max_ms": stalls[-1] * 1000,
        "stall_p99_ms": stalls[int(len(stalls) * 0.99)] * 1000,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"bench-listing-{uuid.uuid4().hex[:12]}"
    await fill(args, prefix)
    gc.collect()
    gc.freeze()  # what docs/operating.md asks of an engine after start-up: stalls are the work's
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    try:
        async with tuned_client(args) as plain, tuned_client(args) as hooked:
            parse_listings_off_the_loop(hooked)
            clients = {"botocore": plain, "thread": hooked}
            for round_ in range(args.repeat):
                order = SIDES if round_ % 2 == 0 else SIDES[::-1]
                for side in order:
                    row = await measure(clients[side], args.s3_bucket, prefix)
                    if row["objects"] != args.objects:
                        raise RuntimeError(f"{side} listed {row['objects']} of {args.objects}")
                    rows[side].append(row)
    finally:
        await empty(args, prefix)
    medians = {
        side: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
        for side, runs in rows.items()
    }
    ratios = {
        name: medians["thread"][name] / medians["botocore"][name]
        for name in ("wall_s", "cpu_s", "stall_max_ms", "stall_p99_ms")
        if medians["botocore"][name] > 0
    }
    return {"medians": medians, "thread_over_botocore": ratios, "rounds": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--objects", type=int, default=20_000, help="objects under the prefix")
    p.add_argument("--repeat", type=int, default=3, help="rounds, sides alternated")
    p.add_argument("--quick", action="store_true", help="2,000 objects, 2 rounds")
    add_json_flag(p)
    add_s3_options(p, "kvtier-bench")
    args = p.parse_args(argv)
    if args.quick:
        args.objects, args.repeat = 2_000, 2
    with json_output(args.json) as out:
        out.update(anyio.run(run, args))
        out["settings"] = settings(args, "objects", "repeat", "quick")
        for side, row in out["medians"].items():
            print(
                f"{side:>8}: {row['objects']:,.0f} objects, wall {row['wall_s']:.3f} s, "
                f"CPU {row['cpu_s']:.3f} s, loop stalls max {row['stall_max_ms']:.1f} ms, "
                f"p99 {row['stall_p99_ms']:.1f} ms"
            )
        cells = ", ".join(f"{k} {v:.2f}x" for k, v in out["thread_over_botocore"].items())
        print(f"thread / botocore: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
