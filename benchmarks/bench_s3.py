"""S3Tier against raw aiobotocore on the same server, in the same run, at the same concurrency.

Measures, for blocks of ``--block-mib`` MiB:

- store throughput: ``S3Tier.store`` beside raw ``put_object`` of the same payload bytes,
  ``--store-passes`` passes per side in each round, each writing its part of the blocks;
- load throughput: ``S3Tier.load`` (streamed into a block buffer, checksum verified) beside
  raw ``get_object`` + ``read()``, ``--load-passes`` passes per side in each round;
- signed blocks: the same stores and loads through a tier with an integrity key (a keyed
  BLAKE3 MAC on store; on load the MAC replaces the xxh3 check), beside the unsigned tier;
- existence of ``--keys`` keys: a cold ``S3Tier.lookup`` of every key until every verdict has
  landed, in ``lookup_mode="ask"`` (batched HEADs behind the AsyncLookupManager; the default
  index mode answers at once, without a request) beside as many raw concurrent
  ``head_object`` calls.

Raw and tier rounds alternate and each figure is the median of ``--repeat`` rounds, so drift on a
shared machine hits both sides alike. It runs against ``--s3-endpoint``; ``nox -s bench``
starts a SeaweedFS (``weed server`` with its S3 gateway) on 127.0.0.1 for it; the ratios are
the point. The raw client uses botocore's defaults (payload signed,
CRC32), as a user's plain client would. Aim: tier >= 0.95x raw throughput, existence within
1.2x of raw. ``--json`` prints the figures, each ratio with its baseline and the settings as one
JSON object.

    python3 -m nox -s bench -- bench_s3 --quick
    python -m benchmarks.bench_s3 --s3-endpoint http://127.0.0.1:9000 --s3-bucket kv --blocks 64
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from benchmarks.common import add_json_flag, add_s3_options, json_output, raw_client, s3_tier
from kvtier import S3Tier, block_keys

MiB = 1 << 20


async def _bounded(concurrency: int, jobs: Sequence[Callable[[], Awaitable[Any]]]) -> float:
    """Run ``jobs`` with at most ``concurrency`` at once; wall seconds."""
    limiter = anyio.CapacityLimiter(concurrency)

    async def run(job: Callable[[], Awaitable[Any]]) -> None:
        async with limiter:
            await job()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(run, job)
    return time.perf_counter() - started


async def _existence_tier(tier: S3Tier, keys: list[bytes]) -> float:
    """Seconds from the first lookup of every key until every verdict has landed."""
    waiting = set(keys)
    done = anyio.Event()

    def on_key(key: bytes) -> None:
        waiting.discard(key)
        if not waiting:
            done.set()

    remove = tier.add_listener(on_key)
    try:
        started = time.perf_counter()
        for key in keys:
            tier.lookup(key)
        with anyio.fail_after(120):
            await done.wait()
        return time.perf_counter() - started
    finally:
        remove()


class Loader:
    """Loads into a fixed set of block buffers, one per concurrent load."""

    def __init__(self, tier: S3Tier, concurrency: int, block: int) -> None:
        self.tier = tier
        self.buffers = [bytearray(block) for _ in range(concurrency)]
        self.free = list(range(concurrency))

    async def load(self, key: bytes) -> None:
        slot = self.free.pop()
        try:
            await self.tier.load(key, memoryview(self.buffers[slot]))
        finally:
            self.free.append(slot)


async def raw_get(client: Any, bucket: str, name: str) -> None:
    response = await client.get_object(Bucket=bucket, Key=name)
    async with response["Body"] as body:
        await body.read()


async def _raw_head(client: Any, bucket: str, name: str) -> None:
    with contextlib.suppress(Exception):  # a 404 is an answer too
        await client.head_object(Bucket=bucket, Key=name)


async def _round(
    args: argparse.Namespace,
    client: Any,
    make_tier: Callable[..., S3Tier],
    payloads: list[bytes],
    results: dict[str, list[float]],
    raw_first: bool,
) -> None:
    run_id = uuid.uuid4().hex[:12]
    c, bucket = args.concurrency, args.s3_bucket
    keys = block_keys(list(range(args.blocks * 4)), 4, namespace=run_id.encode())
    raw_names = [f"bench-raw/{run_id}/{k.hex()}" for k in keys]
    data = [payloads[i % len(payloads)] for i in range(len(keys))]
    order = ("raw", "tier", "signed") if raw_first else ("signed", "tier", "raw")
    async with (
        make_tier(f"bench-tier/{run_id}") as tier,
        make_tier(f"bench-signed/{run_id}", signed=True) as signed,
    ):
        tiers = {"tier": tier, "signed": signed}
        # Stores in passes too, each side writing its own share of the blocks in turn, in ABBA
        # order: SeaweedFS stalls while it grows new volumes (every few hundred MiB here), and
        # one side writing all its blocks at once caught whole stalls the other did not.
        stored = {"put": 0.0, "store": 0.0, "signed_store": 0.0}
        passes = max(1, min(args.store_passes, len(keys)))
        for done in range(passes):
            share = slice(done * len(keys) // passes, (done + 1) * len(keys) // passes)
            for side in order if done % 2 == 0 else order[::-1]:
                if side == "raw":
                    jobs = [
                        functools.partial(client.put_object, Bucket=bucket, Key=n, Body=d)
                        for n, d in zip(raw_names[share], data[share], strict=True)
                    ]
                    stored["put"] += await _bounded(c, jobs)
                else:
                    jobs = [
                        functools.partial(tiers[side].store, k, memoryview(d))
                        for k, d in zip(keys[share], data[share], strict=True)
                    ]
                    stored["store" if side == "tier" else "signed_store"] += await _bounded(c, jobs)
        for name, seconds in stored.items():
            results[name].append(seconds)
        # Loads take a fraction of a second per pass: several passes per side, in ABBA order
        # (raw, tier, signed, then signed, tier, raw, ...), each side's figure the sum of its
        # passes, so that drift on a shared machine hits all sides alike.
        # The client's CPU (this process, every thread) is measured too: on a loaded machine
        # it says more steadily than wall time what each side costs per block.
        spent = {"get": 0.0, "load": 0.0, "signed_load": 0.0}
        cpu = dict.fromkeys(spent, 0.0)
        for done in range(args.load_passes):
            for side in order if done % 2 == 0 else order[::-1]:
                name = {"raw": "get", "tier": "load", "signed": "signed_load"}[side]
                if side == "raw":
                    jobs = [functools.partial(raw_get, client, bucket, n) for n in raw_names]
                else:
                    loader = Loader(tiers[side], c, len(payloads[0]))
                    jobs = [functools.partial(loader.load, k) for k in keys]
                before = time.process_time()
                spent[name] += await _bounded(c, jobs)
                cpu[name] += time.process_time() - before
        for name, seconds in spent.items():
            results[name].append(seconds / args.load_passes)
            results[name + "_cpu"].append(cpu[name] / (args.load_passes * len(keys)))
    # Existence: half the probed keys exist (stored above), half do not.
    absent = block_keys(list(range(args.keys * 4)), 4, namespace=(run_id + "-absent").encode())
    probe = keys[: args.keys // 2] + absent[: args.keys - len(keys[: args.keys // 2])]
    names = [f"bench-tier/{run_id}/{k.hex()[:2]}/{k.hex()}" for k in probe]
    for side in order[::2]:  # raw and the unsigned tier
        if side == "raw":
            jobs = [functools.partial(_raw_head, client, bucket, n) for n in names]
            results["head"].append(await _bounded(c, jobs))
        else:
            async with make_tier(f"bench-tier/{run_id}") as cold:  # a cold verdict cache
                results["lookup"].append(await _existence_tier(cold, probe))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    block = args.block_mib * MiB
    payloads = [os.urandom(block) for _ in range(min(args.blocks, 8))]
    results: dict[str, list[float]] = {
        k: []
        for k in (
            *("put", "store", "get", "load", "signed_store", "signed_load", "head", "lookup"),
            *("get_cpu", "load_cpu", "signed_load_cpu"),
        )
    }

    def make_tier(prefix: str, *, signed: bool = False) -> S3Tier:
        return s3_tier(
            args,
            prefix,
            max_concurrency=args.concurrency,
            lookup_timeout=120.0,
            lookup_mode="ask",
            integrity_key=os.urandom(32) if signed else None,  # a fresh prefix each round
        )

    config = {"max_pool_connections": args.concurrency, "connect_timeout": 2.0}
    async with raw_client(args, read_timeout=30.0, **config) as client:
        if args.create_bucket:
            with contextlib.suppress(Exception):  # it may exist already
                await client.create_bucket(Bucket=args.s3_bucket)
        for n in range(args.repeat):
            await _round(args, client, make_tier, payloads, results, raw_first=n % 2 == 0)

    moved = args.blocks * block / MiB
    best = {k: statistics.median(v) for k, v in results.items()}  # robust to one lucky round
    if os.environ.get("BENCH_S3_ROUNDS"):
        print({k: [round(x, 3) for x in v] for k, v in results.items()})
    report: dict[str, Any] = {
        "block_mib": args.block_mib,
        "blocks": args.blocks,
        "concurrency": args.concurrency,
        "keys": args.keys,
        "repeat": args.repeat,
        "load_passes": args.load_passes,
        "store_passes": args.store_passes,
        "raw_put_mib_s": moved / best["put"],
        "tier_store_mib_s": moved / best["store"],
        "raw_get_mib_s": moved / best["get"],
        "tier_load_mib_s": moved / best["load"],
        "signed_store_mib_s": moved / best["signed_store"],
        "signed_load_mib_s": moved / best["signed_load"],
        "raw_head_s": best["head"],
        "tier_lookup_s": best["lookup"],
        "raw_get_cpu_ms_per_block": best["get_cpu"] * 1e3,
        "tier_load_cpu_ms_per_block": best["load_cpu"] * 1e3,
        "signed_load_cpu_ms_per_block": best["signed_load_cpu"] * 1e3,
    }
    report["store_ratio"] = report["tier_store_mib_s"] / report["raw_put_mib_s"]
    report["load_ratio"] = report["tier_load_mib_s"] / report["raw_get_mib_s"]
    report["signed_store_ratio"] = report["signed_store_mib_s"] / report["tier_store_mib_s"]
    report["signed_load_ratio"] = report["signed_load_mib_s"] / report["tier_load_mib_s"]
    report["existence_ratio"] = report["tier_lookup_s"] / report["raw_head_s"]
    report["baselines"] = {ratio: base for ratio, _, base in RATIOS}
    return report


RATIOS = (  # each ratio, the figure it divides and the baseline it divides by
    ("store_ratio", "tier_store_mib_s", "raw_put_mib_s"),
    ("load_ratio", "tier_load_mib_s", "raw_get_mib_s"),
    ("signed_store_ratio", "signed_store_mib_s", "tier_store_mib_s"),
    ("signed_load_ratio", "signed_load_mib_s", "tier_load_mib_s"),
    ("existence_ratio", "tier_lookup_s", "raw_head_s"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_s3_options(parser, bucket="kvtier-bench")
    parser.add_argument("--no-create-bucket", dest="create_bucket", action="store_false")
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--load-passes", type=int, default=4, help="load passes per side in each round"
    )
    parser.add_argument(
        "--store-passes",
        type=int,
        default=4,
        help="each side stores its blocks in this many parts per round, the sides in turn",
    )
    parser.add_argument(
        "--quick", action="store_true", help="8 blocks, 200 keys, 2 rounds: about 20 s"
    )
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.keys, args.repeat, args.load_passes = 8, 200, 2, 2
        args.store_passes = 2
    with json_output(args.json) as out:
        out["settings"] = {"quick": args.quick, "endpoint": args.s3_endpoint}
        out["figures"] = report = anyio.run(run, args)
        _print(args, report)
    return 0


def _print(args: argparse.Namespace, report: dict[str, Any]) -> None:
    print(
        f"S3 benchmark: {args.blocks} blocks of {args.block_mib} MiB, concurrency "
        f"{args.concurrency}, median of {args.repeat} rounds ({args.store_passes} store and "
        f"{args.load_passes} load passes each), endpoint {args.s3_endpoint}"
    )
    rows = [
        ("store", "tier_store_mib_s", "raw put", "raw_put_mib_s", "MiB/s", "store_ratio"),
        ("load", "tier_load_mib_s", "raw get", "raw_get_mib_s", "MiB/s", "load_ratio"),
        (
            "signed store",
            "signed_store_mib_s",
            "tier",
            "tier_store_mib_s",
            "MiB/s",
            "signed_store_ratio",
        ),
        (
            "signed load",
            "signed_load_mib_s",
            "tier",
            "tier_load_mib_s",
            "MiB/s",
            "signed_load_ratio",
        ),
        ("exists", "tier_lookup_s", "raw head", "raw_head_s", "s", "existence_ratio"),
    ]
    for label, tier_key, raw_label, raw_key, unit, ratio in rows:
        print(
            f"  {label:<12} {report[tier_key]:9.3f} {unit:<5}  {raw_label:<8} "
            f"{report[raw_key]:9.3f} {unit:<5}  ratio {report[ratio]:.3f}"
        )
    print(f"  (exists: {args.keys} keys; a ratio there is time, lower is better)")
    print(
        f"  client CPU per block loaded: tier {report['tier_load_cpu_ms_per_block']:.2f} ms, "
        f"raw get {report['raw_get_cpu_ms_per_block']:.2f} ms, signed "
        f"{report['signed_load_cpu_ms_per_block']:.2f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
