"""A fleet of kvtier nodes on one S3 bucket: hit ratio, index upkeep, staleness and open time.

Each node is a real ``TieringManager`` over a small ``HostPool`` and an ``S3Tier``; every
node of a fleet shares one prefix of one bucket, and all the nodes of a fleet run in this one
process (one event loop, one aiobotocore client each). There is no file tier per node: on a
2-core machine it would only add the disk's cost to every store, and the question here is
what the shared tier and its index do. The trace's requests are replayed at their trace time,
scaled by ``--speed`` (trace seconds per wall second), each on the node a router picks:

- ``sticky``: by the request's first block (a Mooncake trace has no session id; requests that
  share their first block share a system prompt or a conversation), as a prefix-aware router
  would;
- ``random``: any node, as a plain load balancer would.

A node serves a request the way an engine does (``scheduler.lookup``, ``load`` the hit prefix,
``store`` the rest, written through to S3). With ``index_refresh`` scaled by the same factor
(``--refresh``, 0.5 s at ``--speed 4``: the default 2 s in trace time), a block another node
stored is found as late as it would be in a real fleet. The table shows, per fleet size and
router:

- ``hit``: prefix blocks served / blocks requested, fleet-wide; ``bound``: the same for one
  global cache that never forgets (what a perfect shared tier could do); ``alone``: the same
  fleet and router with no shared tier (each node its pool only), for contrast;
- ``req/refresh``: index-upkeep requests (LIST, GET, PUT, DELETE of the journal, its digests
  with ``--digests on``, and the snapshots, counted at each tier) per node per refresh, and how
  they split;
- ``stale p50/p99``: seconds from a store landing on one node until a lookup on another node
  (picked at random, polling every ``refresh / 20``) answers HIT, over the stores probed;
- ``index B/s``: journal bytes each node read per second, and the keys each index held.

Then the time a new node takes to open (its ``S3Tier.open()``, which indexes what the bucket
holds before it returns) against a prefix of ``--open-blocks`` indexed blocks. Those blocks
are written directly as pack objects of 64 blocks with a real pack table (sections of a few
bytes, never loaded): the listing at open reads exactly what it reads for real packs.

    python -m benchmarks.cluster_replay --s3-endpoint URL                  # 1-16 nodes
    python -m benchmarks.cluster_replay --s3-endpoint URL --nodes 1,2,4,8,16,32,64 --json
    python -m benchmarks.cluster_replay --s3-endpoint URL --nodes 1,8,32,64 --digests on
    nox -s bench -- cluster_replay --nodes 1,4                             # starts a SeaweedFS
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import kvtier
from benchmarks.common import (
    add_json_flag,
    add_s3_options,
    json_output,
    raw_client,
    s3_tier,
    settings,
)
from benchmarks.replay_trace import DEFAULT_TRACE, infinite_hits, load_trace, payload_of
from kvtier.tiers.s3._pack_format import Location, encode_table, pack_name

PAYLOAD_BYTES = 64
LOOKUP_TIMEOUT = 5.0
PACK_KEYS = 64
ROUTERS = ("sticky", "random")


@dataclass
class Node:
    """One node of the fleet: its manager, scheduler and S3 tier, and the requests it got."""

    manager: kvtier.TieringManager
    scheduler: kvtier.OffloadScheduler
    tier: kvtier.S3Tier
    requests: list[tuple[float, list[bytes]]] = field(default_factory=list)


@dataclass
class Fleet:
    """What one fleet's replay measured."""

    hits: int = 0
    requested: int = 0
    verified: int = 0
    staleness: list[float] = field(default_factory=list)
    unseen: int = 0  # probes that never hit within their deadline
    lag: list[float] = field(default_factory=list)  # how late requests started


def route(requests: Sequence[list[bytes]], nodes: int, router: str, seed: int) -> list[int]:
    """The node of each request."""
    if router == "sticky":
        return [int.from_bytes(keys[0][:4], "little") % nodes for keys in requests]
    rng = random.Random(seed)
    return [rng.randrange(nodes) for _ in requests]


def trace_times(path: Path, limit: int) -> list[float]:
    """Each request's trace time in seconds, in the order ``load_trace`` returns them."""
    import json

    stamps: list[float] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            if line.strip():
                stamps.append(float(json.loads(line).get("timestamp", 0)) / 1000)
    return sorted(stamps)


async def serve(node: Node, fleet: Fleet, others: list[Node], t0: float, args: Any) -> None:
    """Serve ``node``'s requests at their times; probe how soon another node sees a store."""
    out = np.empty((max((len(k) for _, k in node.requests), default=1), PAYLOAD_BYTES), np.uint8)
    loop = asyncio.get_running_loop()
    probes: list[asyncio.Task[None]] = []
    for due, keys in node.requests:
        wait = t0 + due - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        fleet.lag.append(max(0.0, -wait))
        hit = await node.scheduler.lookup(keys, timeout=LOOKUP_TIMEOUT)
        loaded = await node.manager.load(keys[:hit], out[:hit]) if hit else 0
        for i in range(loaded):
            if not np.array_equal(out[i], payload_of(keys[i], PAYLOAD_BYTES)):
                raise AssertionError(f"block {i} of a request loaded wrong bytes")
        fleet.verified += loaded
        fleet.hits += loaded
        fleet.requested += len(keys)
        new = keys[loaded:]
        if new:
            await node.manager.store(new, np.stack([payload_of(k, PAYLOAD_BYTES) for k in new]))
            await node.manager.wait_idle()  # landed in S3, as an engine's prefill would allow
            if others and len(probes) < args.probes:
                other = random.choice(others)
                if other.tier.lookup(new[-1]) is not kvtier.LookupResult.HIT:
                    probes.append(asyncio.create_task(probe(other.tier, new[-1], fleet, args)))
    await asyncio.gather(*probes)


async def probe(tier: kvtier.S3Tier, key: bytes, fleet: Fleet, args: Any) -> None:
    """How long until ``tier`` answers HIT for ``key``, polling every refresh / 20."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + 20 * args.refresh
    while loop.time() < deadline:
        if tier.lookup(key) is kvtier.LookupResult.HIT:
            fleet.staleness.append(loop.time() - started)
            return
        await asyncio.sleep(args.refresh / 20)
    fleet.unseen += 1


async def replay_fleet(
    args: Any, n: int, router: str, requests: list[list[bytes]], times: list[float]
) -> dict[str, Any]:
    """Replay the trace on ``n`` nodes sharing a fresh prefix; the figures."""
    prefix = f"cluster/{os.urandom(4).hex()}-{n}-{router}"
    fleet = Fleet()
    async with AsyncExitStack() as stack:
        nodes: list[Node] = []
        for i in range(n):
            tier = s3_tier(
                args,
                prefix,
                name=f"s3-{i}",
                index_refresh=args.refresh,
                index_lookback=max(30.0, 4 * args.refresh),
                index_digests=args.digests == "on",
            )
            pool = kvtier.HostPool(args.pool_blocks, PAYLOAD_BYTES)
            admission = kvtier.AdmissionPolicy(max_write_latency=None)
            manager = await stack.enter_async_context(
                kvtier.TieringManager(pool, [tier], admission=admission)
            )
            nodes.append(Node(manager, kvtier.OffloadScheduler(manager), tier))
        for keys, at, where in zip(
            requests, times, route(requests, n, router, args.seed), strict=True
        ):
            nodes[where].requests.append((at / args.speed, keys))
        syncs = [node.tier._sync for node in nodes]
        before = [(s.refreshes, sum(s.requests.values())) for s in syncs]
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.5
        await asyncio.gather(
            *(serve(node, fleet, [o for o in nodes if o is not node], t0, args) for node in nodes)
        )
        elapsed = loop.time() - t0
        counts: dict[str, int] = {}
        for s in syncs:
            for kind, count in s.requests.items():
                counts[kind] = counts.get(kind, 0) + count
        refreshes = sum(s.refreshes - b[0] for s, b in zip(syncs, before, strict=True))
        upkeep = sum(sum(s.requests.values()) - b[1] for s, b in zip(syncs, before, strict=True))
        index_keys = [len(node.tier._index) for node in nodes]
        bytes_read = sum(s.reader.bytes_read for s in syncs)
        digests = [s.digests for s in syncs if s.digests is not None]
        digest_counts = {
            what: sum(getattr(d, what) for d in digests)
            for what in ("published", "read", "lost", "missing", "rejected", "fallbacks")
        }
    stale = sorted(fleet.staleness)
    return {
        "nodes": n,
        "router": router,
        "hit": fleet.hits / max(fleet.requested, 1),
        "verified": fleet.verified,
        "requests_per_refresh": upkeep / max(refreshes, 1),
        "requests_by_kind": counts,
        "refreshes_per_node": refreshes / n,
        "staleness_p50": _quantile(stale, 0.5),
        "staleness_p99": _quantile(stale, 0.99),
        "probes": len(stale),
        "probes_unseen": fleet.unseen,
        "index_bytes_per_node_per_s": bytes_read / n / max(elapsed, 1e-9),
        "index_keys_per_node": statistics.mean(index_keys),
        "seconds": elapsed,
        "start_lag_p99": _quantile(sorted(fleet.lag), 0.99),
        "digests": digest_counts if digests else None,
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


async def alone_hits(requests: list[list[bytes]], n: int, router: str, args: Any) -> float:
    """The same fleet and router with no shared tier: each node its own pool."""
    hits = total = 0
    out = np.empty((max(len(k) for k in requests), PAYLOAD_BYTES), np.uint8)
    async with AsyncExitStack() as stack:
        managers = [
            await stack.enter_async_context(
                kvtier.TieringManager(kvtier.HostPool(args.pool_blocks, PAYLOAD_BYTES), [])
            )
            for _ in range(n)
        ]
        for keys, where in zip(requests, route(requests, n, router, args.seed), strict=True):
            manager = managers[where]
            hit = await kvtier.OffloadScheduler(manager).lookup(keys, timeout=LOOKUP_TIMEOUT)
            loaded = await manager.load(keys[:hit], out[:hit]) if hit else 0
            if keys[loaded:]:
                new = np.stack([payload_of(k, PAYLOAD_BYTES) for k in keys[loaded:]])
                await manager.store(keys[loaded:], new)
            hits += loaded
            total += len(keys)
    return hits / total


async def fill_prefix(args: Any, prefix: str, blocks: int) -> None:
    """``blocks`` indexed blocks under ``prefix``, as packs of 64 with real tables."""
    writer = os.urandom(8).hex()

    async with raw_client(args) as client:
        queue = list(range(0, blocks, PACK_KEYS))

        async def put() -> None:
            while queue:
                start = queue.pop()
                keys = [os.urandom(16) for _ in range(min(PACK_KEYS, blocks - start))]
                table = encode_table(keys, [8] * len(keys))
                name = pack_name(prefix, keys[0], writer, start)
                body = table + bytes(8 * len(keys))
                await client.put_object(Bucket=args.s3_bucket, Key=name, Body=body)

        await asyncio.gather(*(put() for _ in range(32)))


async def open_time(args: Any, blocks: int) -> dict[str, Any]:
    """Seconds for a new node to open against ``blocks`` indexed blocks, and what it knew."""
    prefix = f"cluster/open-{os.urandom(4).hex()}-{blocks}"
    started = time.perf_counter()
    await fill_prefix(args, prefix, blocks)
    filled = time.perf_counter() - started
    tier = s3_tier(args, prefix, name="new-node", index_list_timeout=600.0, index_snapshots=False)
    started = time.perf_counter()
    async with tier:
        await tier.wait_index_loaded()  # the figure is the time to a whole index, as it was
        opened = time.perf_counter() - started
        indexed = len(tier._index)
        complete = tier._sync.listing_complete
    return {
        "blocks": blocks,
        "open_seconds": opened,
        "indexed": indexed,
        "complete": complete and indexed == blocks,
        "fill_seconds": filled,
    }


async def snapshot_open_time(args: Any, blocks: int) -> dict[str, Any]:
    """Seconds for a new node to open against ``blocks`` indexed blocks held in an index
    snapshot. The compacting node's index is filled directly (pack locations of 64 keys a
    pack, never loaded), then it compacts through the real path (claim, body, manifest) and
    the new node opens through the real one (survey, manifest, body, decode)."""
    prefix = f"cluster/snap-{os.urandom(4).hex()}-{blocks}"
    writer = os.urandom(8).hex()
    compactor = s3_tier(args, prefix, name="compactor", index_max_keys=max(blocks, 1))
    async with compactor:
        entries: list[tuple[bytes, Location | None]] = []
        for start in range(0, blocks, PACK_KEYS):
            keys = [os.urandom(16) for _ in range(min(PACK_KEYS, blocks - start))]
            pack = pack_name(prefix, keys[0], writer, start)
            entries += [(k, Location(pack, 4096 + 100 * i, 100)) for i, k in enumerate(keys)]
        compactor._index.add_many(entries)
        del entries
        sync = compactor._sync
        assert sync.snapshots is not None and sync.covered_ms is not None
        started = time.perf_counter()
        survey = await sync.snapshots.survey(int(time.time() * 1000))
        published = await sync.snapshots.compact(survey, sync.covered_ms)
        compacted = time.perf_counter() - started
    tier = s3_tier(args, prefix, name="new-node", index_max_keys=max(blocks, 1))
    started = time.perf_counter()
    async with tier:
        await tier.wait_index_loaded()  # the figure is the time to a whole index, as it was
        opened = time.perf_counter() - started
        indexed = len(tier._index)
        snapshots = tier._sync.snapshots
        assert snapshots is not None
        read = snapshots.bytes_read
    return {
        "blocks": blocks,
        "open_seconds": opened,
        "indexed": indexed,
        "complete": published and indexed == blocks,
        "compact_seconds": compacted,
        "snapshot_bytes": read,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=600, help="the trace's first N")
    parser.add_argument("--nodes", default="1,2,4,8,16", help="fleet sizes, comma-separated")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--speed", type=float, default=4.0, help="trace seconds per second")
    parser.add_argument("--refresh", type=float, default=0.5, help="index_refresh, seconds")
    parser.add_argument("--pool-blocks", type=int, default=256, help="each node's HostPool")
    parser.add_argument("--probes", type=int, default=20, help="staleness probes per node")
    parser.add_argument(
        "--open-blocks", default="10000", help="indexed blocks a new node opens against"
    )
    parser.add_argument(
        "--snapshot-blocks",
        default="10000,100000,1000000",
        help="indexed blocks a new node opens against, from an index snapshot",
    )
    parser.add_argument(
        "--digests",
        choices=("off", "on"),
        default="off",
        help="index_digests: read one digest per refresh instead of every writer's segments",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_s3_options(parser, "kvtier-bench")
    add_json_flag(parser)
    return parser.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def main_async(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    random.seed(args.seed)
    requests = load_trace(args.trace, args.requests)
    times = trace_times(args.trace, args.requests)
    total = sum(len(k) for k in requests)
    bound = infinite_hits(requests) / total
    figures["settings"] = settings(
        args,
        "requests",
        "nodes",
        "routers",
        "speed",
        "refresh",
        "pool_blocks",
        "probes",
        "digests",
    )
    figures["bound"] = bound
    print(
        f"{len(requests)} requests, {total} blocks, trace {times[-1]:.0f} s at x{args.speed:g}; "
        f"index_refresh {args.refresh:g} s; infinite-cache bound {bound:.3f}"
    )
    header = (
        f"{'nodes':>5} {'router':>6} {'hit':>6} {'/bound':>6} {'alone':>6} {'req/refr':>8} "
        f"{'L/G/P/D per refresh':>20} {'stale p50':>9} {'p99':>6} {'unseen':>6} "
        f"{'idx B/s':>8} {'keys':>7} {'lag p99':>7}"
    )
    print(header)
    rows: list[dict[str, Any]] = []
    for n in _ints(args.nodes):
        for router in args.routers.split(","):
            row = await replay_fleet(args, n, router, requests, times)
            row["alone"] = await alone_hits(requests, n, router, args)
            row["hit_over_bound"] = row["hit"] / bound
            rows.append(row)
            per = max(row["refreshes_per_node"] * n, 1)
            split = "/".join(
                f"{row['requests_by_kind'].get(k, 0) / per:.1f}"
                for k in ("list", "get", "put", "delete")
            )
            print(
                f"{n:>5} {router:>6} {row['hit']:6.3f} {row['hit_over_bound']:6.2f} "
                f"{row['alone']:6.3f} {row['requests_per_refresh']:8.1f} {split:>20} "
                f"{row['staleness_p50']:9.2f} {row['staleness_p99']:6.2f} "
                f"{row['probes_unseen']:6d} {row['index_bytes_per_node_per_s']:8.0f} "
                f"{row['index_keys_per_node']:7.0f} {row['start_lag_p99']:7.2f}",
                flush=True,
            )
            if row["digests"]:
                print(f"{'':>13}digests: {row['digests']}", flush=True)
    figures["fleets"] = rows
    opens = []
    for blocks in _ints(args.open_blocks):
        result = await open_time(args, blocks)
        opens.append(result)
        print(
            f"a new node opens against {blocks} blocks by listing them in "
            f"{result['open_seconds']:.2f} s "
            f"({result['indexed']} indexed, complete: {result['complete']}; "
            f"filling took {result['fill_seconds']:.0f} s)",
            flush=True,
        )
    figures["open"] = opens
    from_snapshot = []
    for blocks in _ints(args.snapshot_blocks):
        result = await snapshot_open_time(args, blocks)
        from_snapshot.append(result)
        print(
            f"a new node opens against {blocks} blocks from an index snapshot in "
            f"{result['open_seconds']:.2f} s ({result['indexed']} indexed, complete: "
            f"{result['complete']}; {result['snapshot_bytes'] / 2**20:.1f} MiB read; "
            f"compacting took {result['compact_seconds']:.1f} s)",
            flush=True,
        )
    figures["open_from_snapshot"] = from_snapshot


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with json_output(args.json) as figures:
        asyncio.run(main_async(args, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
