"""Several serving nodes behind a KV-aware router, against round-robin, from the same run.

Each node is an engine from ``demo_engine.py`` with its own kvtier host pool and its own file
tier in its own temporary folder, so a prefix is cached on the nodes that computed it, and
where a request goes decides whether its prefix is loaded or recomputed. Each node publishes
its tiers' events (``kvtier.EventStream.from_tiers(manager.tiers)``) with
``kvtier.integrations.kv_events.KVEventPublisher``: vLLM's ``KVEventBatch`` on a ZMQ PUB
socket, the wire KV-aware routers read, with a replay socket. The engine writes every block
it computes through to its tiers, so the tiers' ``BlockStored`` events cover what it computed.

The router follows every node with ``kvtier.integrations.kv_subscriber.KVEventSubscriber``
(lost batches repaired by replay or the node's full state; it takes each node's full state
before routing) into one ``ResidencyView``: a node's own tiers per node, a shared tier's
blocks once, credited to every node that reaches the tier. Three policies serve the same
requests on fresh nodes, one after the other in this process:

- ``round-robin``;
- ``block-count``: the node that can load the longest prefix of the request's block keys
  (``kvtier.block_keys``, the engine's own keys), every block counted alike; ties to the
  least loaded node (requests sent and not answered);
- ``weighted``: the least expected cost, as Dynamo's router weighs it: the prefill left to
  compute (the request's blocks less its *expected saved prefill*: over the longest prefix
  the node can load, each block weighted by the class of the best tier holding it) plus the
  prompt blocks of the requests the node has in hand. The events say each block's tier, its
  medium, whether it is shared and what kind of store it is. Weights by default: GPU 1.0,
  host memory 0.75, disk 0.25 (Dynamo's), shared storage 0.4, object store 0.2 (llm-d's);
  ``--tier-weights disk=0.3,object_store=0.1`` changes them.

Remaining ties go round-robin. Events
arrive asynchronously, as over a network: the router routes on what it knows when the request
arrives, never waiting.

``--shared-s3`` (with ``--s3-endpoint``, an S3 store such as a local SeaweedFS, credentials
from the environment) gives every node a third tier: one S3 prefix they all share, a fresh one
per policy. Before each policy's run a node that then leaves computes the first turn of every
other session and writes it to that prefix only: at the start those blocks live in the shared
tier alone (in no node's memory or folder), and every node can load them. The JSON reports
TTFT p50 on those requests (``shared_only_ttft_p50_s``) besides all of them.

The workload is the demo's multi-turn chats, every session at once, each sending its next turn
when the previous one is answered: round-robin scatters a session's turns over nodes that never
computed its history; the KV-aware policies send them where it was computed. For each policy
the script prints TTFT p50 and p95, the prefix hit ratio (prompt blocks loaded from kvtier over
prompt blocks that could be loaded), the requests per node and the events the router received;
then each policy against round-robin, weighted against block-count, and a correctness line
(logits of requests that loaded different prefixes under two policies agree).

    python examples/kv_router.py             # a minute or two
    python examples/kv_router.py --quick     # seconds, for tests and CI
    python -m devtools.with_seaweedfs kvtier-router \\
        python examples/kv_router.py --shared-s3 --s3-endpoint {endpoint}

The nodes share this process's cores (each engine computes in a worker thread of its own), so
a node's TTFT includes waiting for CPU the others use, under every policy alike. Needs the
``torch`` and ``events`` extras (and ``s3`` for ``--shared-s3``). ``--json`` prints one JSON
object: the settings, each policy's figures, the ratios, the correctness check and what each
shutdown left.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import demo_engine as demo
import torch
from demo_engine import KVCache, ModelConfig, Request, TinyTransformer

import kvtier
from kvtier.integrations.kv_events import KVEventPublisher
from kvtier.integrations.kv_subscriber import (
    TIER_CLASSES,
    KVEventSubscriber,
    ResidencyView,
    WireEvent,
)

ROUND_ROBIN, BLOCK_COUNT, WEIGHTED = "round-robin", "block-count", "weighted"
POLICIES = (ROUND_ROBIN, BLOCK_COUNT, WEIGHTED)
# What a block saves, by the class of the best tier a node can load it from, against one in
# GPU memory: Dynamo prices host memory at 0.75 and disk at 0.25; llm-d, shared storage at
# 0.4 and object stores at 0.2.
DEFAULT_WEIGHTS = {
    "gpu": 1.0,
    "host": 0.75,
    "disk": 0.25,
    "shared_storage": 0.4,
    "object_store": 0.2,
}
S3_INDEX_REFRESH_S = 0.5  # how soon a node's S3 index learns what the others stored


# -- the router: synchronous bookkeeping, fed by the subscribers ------------------------------


@dataclass(slots=True)
class EventCounts:
    """What the router received, over every node."""

    # Batches with events: not heartbeats (empty), nor a full state's first batch (it begins
    # with AllBlocksCleared, counted in ``cleared``), which a router may also get answered.
    batches: int = 0
    stored_blocks: int = 0  # announced stored in a node's own tiers
    shared_stored_blocks: int = 0  # announced stored in a shared tier, by any node
    removed_blocks: int = 0
    cleared: int = 0


def parse_weights(text: str) -> dict[str, float]:
    """``class=weight,...`` over ``TIER_CLASSES``, on top of the defaults."""
    weights = dict(DEFAULT_WEIGHTS)
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in TIER_CLASSES:
            raise argparse.ArgumentTypeError(
                f"unknown tier class {name!r}: one of {', '.join(TIER_CLASSES)}"
            )
        try:
            weights[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the weight must be a number") from None
        if not 0 <= weights[name] <= 1:
            raise argparse.ArgumentTypeError(f"{item!r}: a weight is between 0 and 1")
    return weights


class Router:
    """Which node can load which blocks, as the nodes' events said, and where a request goes.

    No I/O and no waiting: the subscribers hand it decoded batches (``apply``) in sequence
    order, gaps repaired; the serving loop asks it for a node (``choose``) and takes the
    request off ``load`` when answered. What a node holds is a ``ResidencyView``: a node's
    own tiers per node, a shared tier once, credited to every node that reaches it."""

    def __init__(self, nodes: int, policy: str, weights: dict[str, float]) -> None:
        self.policy = policy
        self.view = ResidencyView(nodes)
        self.weights = weights if policy == WEIGHTED else dict.fromkeys(TIER_CLASSES, 1.0)
        self.load = [0] * nodes  # requests sent to each node and not answered yet
        self.load_blocks = [0] * nodes  # their prompt blocks: the work a node has in hand
        self._blocks: dict[int, int] = {}  # request id -> its prompt blocks, until answered
        self.routes: dict[int, tuple[int, int]] = {}  # request id -> node, known prefix blocks
        self.counts = EventCounts()
        self._turn = 0  # where round-robin goes next

    def apply(self, node: int, events: list[WireEvent]) -> None:
        """One batch of ``node``'s events, in order (a subscriber's ``on_batch``)."""
        if events and events[0].type != "AllBlocksCleared":
            self.counts.batches += 1
        for event in events:
            if event.type == "AllBlocksCleared":
                self.counts.cleared += 1
            elif event.type == "BlockRemoved":
                self.counts.removed_blocks += len(event.hashes)
            elif event.shared:
                self.counts.shared_stored_blocks += len(event.hashes)
            else:
                self.counts.stored_blocks += len(event.hashes)
        self.view.apply(node, events)

    def reach(self, node: int, keys: Sequence[bytes]) -> tuple[int, float]:
        """The longest prefix of ``keys`` that ``node`` can load, in blocks, and what it
        saves: each block weighted by the best tier it is in (``weights``, by tier class)."""
        blocks, saved = 0, 0.0
        view, weights = self.view, self.weights
        for key in keys:
            tiers = view.tiers_holding(node, key)
            if not tiers:
                break
            blocks += 1
            saved += max(weights.get(view.classes.get(t, "disk"), 0.0) for t in tiers)
        return blocks, saved

    def choose(self, rid: int, keys: Sequence[bytes]) -> int:
        """The node for request ``rid`` with ``keys``, counted as its load until ``done``:

        - ``round-robin``: in turn;
        - ``block-count``: the longest prefix it can load, in blocks; ties to the least
          loaded node;
        - ``weighted``: the least expected cost, as Dynamo's router weighs it: the prefill
          left to compute (the request's blocks less the weighted blocks it can load) plus
          the blocks of the requests the node has in hand.

        Remaining ties go round-robin."""
        nodes = len(self.load)
        order = [(self._turn + i) % nodes for i in range(nodes)]  # round-robin breaks ties
        reach = {n: self.reach(n, keys) for n in order}
        if self.policy == ROUND_ROBIN:
            node = order[0]
        elif self.policy == BLOCK_COUNT:
            node = min(order, key=lambda n: (-reach[n][0], self.load[n]))
        else:
            node = min(order, key=lambda n: len(keys) - reach[n][1] + self.load_blocks[n])
        self._turn = (node + 1) % nodes
        self.routes[rid] = node, reach[node][0]
        self.load[node] += 1
        self.load_blocks[node] += len(keys)
        self._blocks[rid] = len(keys)
        return node

    def done(self, rid: int) -> None:
        """Request ``rid`` was answered: off its node's load."""
        node, _ = self.routes[rid]
        self.load[node] -= 1
        self.load_blocks[node] -= self._blocks.pop(rid)


# -- the nodes ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Node:
    """One serving node: its engine, its kvtier, and its events on the wire."""

    engine: demo.Engine
    tiering: demo.KVTier
    publisher: KVEventPublisher
    stream: kvtier.EventStream
    folder: str


def s3_tier(args: argparse.Namespace, prefix: str) -> kvtier.S3Tier:
    """The prefix every node of one policy's run shares (credentials from the environment)."""
    return kvtier.S3Tier(
        args.s3_bucket,
        name="s3",
        prefix=prefix,
        endpoint_url=args.s3_endpoint,
        index_refresh=S3_INDEX_REFRESH_S,
    )


async def start_node(
    stack: AsyncExitStack,
    args: argparse.Namespace,
    model: TinyTransformer,
    max_len: int,
    prefix: str | None,
) -> Node:
    """A node whose tiers, publisher, stream and folder ``stack`` closes, in reverse order;
    with ``prefix``, its tiers end with the S3 prefix the run's nodes share."""
    c = model.config
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-router-node-"))
    pool = kvtier.HostPool(args.pool_blocks, c.block_bytes)
    tiers: list[kvtier.SecondaryTier] = [
        kvtier.FSTier(os.path.join(folder, "fs"), capacity_bytes=args.fs_capacity_mb << 20)
    ]
    if prefix is not None:
        tiers.append(s3_tier(args, prefix))
    manager = await stack.enter_async_context(kvtier.TieringManager(pool, tiers))
    for tier in tiers:  # a node joins knowing what the bucket holds (the index's load)
        if isinstance(tier, kvtier.S3Tier):
            await tier.wait_index_loaded()
    publisher = await stack.enter_async_context(
        KVEventPublisher(
            "tcp://127.0.0.1:0", block_size=c.block_size, replay_endpoint="tcp://127.0.0.1:0"
        )
    )
    stream = await stack.enter_async_context(kvtier.EventStream.from_tiers(manager.tiers))
    tiering = demo.KVTier(manager, kvtier.OffloadScheduler(manager))
    return Node(demo.Engine(model, args.concurrency, max_len), tiering, publisher, stream, folder)


async def seed_shared(
    args: argparse.Namespace,
    model: TinyTransformer,
    max_len: int,
    prefix: str,
    seeded: Sequence[Request],
) -> int:
    """Compute the prompts of ``seeded`` and write their blocks to the shared prefix only,
    as a node that has since left the fleet would have: at the start of the run they live
    in no node's memory or folder. The blocks written."""
    c = model.config
    written = 0
    async with s3_tier(args, prefix) as tier:
        for request in seeded:
            keys = kvtier.block_keys(request.tokens, c.block_size, namespace=c.namespace)
            cache = KVCache(c, max_len)
            await asyncio.to_thread(model.forward_tokens, request.tokens, cache)
            blocks = cache.gather_blocks(0, len(keys))
            for key, block in zip(keys, blocks, strict=True):
                await tier.store(key, memoryview(block.contiguous().numpy()).cast("B"))
                written += 1
    return written


@dataclass(slots=True)
class PolicyRun:
    """One policy's run: the demo's per-request results and the router."""

    run: demo.RunResult
    router: Router  # where each request went, what it learnt
    nodes: dict[str, Any]  # what the closed nodes sent and stored, and what is left of them
    subscribers: dict[str, int]  # what the router's subscribers repaired, over every node


async def serve_all(
    label: str,
    router: Router,
    nodes: Sequence[Node],
    sessions: Sequence[Sequence[Request]],
    decode_tokens: int,
) -> demo.RunResult:
    """Every session at once, each turn routed when it is sent."""
    c = nodes[0].engine.config
    run = demo.RunResult(label, 0.0)
    progress = demo.Progress(label, sum(len(s) for s in sessions), c.block_size)
    started = time.perf_counter()

    async def chat(turns: Sequence[Request]) -> None:
        for request in turns:
            keys = kvtier.block_keys(request.tokens, c.block_size, namespace=c.namespace)
            node = router.choose(request.rid, keys)
            try:
                result = await demo.serve(
                    nodes[node].engine, request, nodes[node].tiering, decode_tokens
                )
            finally:
                router.done(request.rid)
            run.results[request.rid] = result
            progress.update(run)

    try:
        async with asyncio.TaskGroup() as tg:
            for turns in sessions:
                tg.create_task(chat(turns))
    finally:
        progress.close()
    run.wall = time.perf_counter() - started
    return run


async def run_policy(
    policy: str,
    args: argparse.Namespace,
    model: TinyTransformer,
    sessions: Sequence[Sequence[Request]],
    max_len: int,
) -> PolicyRun:
    """Fresh nodes (and, with ``--shared-s3``, a fresh shared prefix seeded the same way) and
    a router with ``policy`` serve ``sessions``; everything closed after."""
    router = Router(args.nodes, policy, args.tier_weights)
    prefix = None
    if args.shared_s3:
        prefix = f"{args.s3_prefix}/{args.run_id}/{policy}"
        await seed_shared(args, model, max_len, prefix, [s[0] for s in seeded_sessions(sessions)])
    async with AsyncExitStack() as stack:
        nodes = [await start_node(stack, args, model, max_len, prefix) for _ in range(args.nodes)]
        subscribers = [
            await stack.enter_async_context(
                KVEventSubscriber(
                    n.publisher.endpoint,
                    replay_endpoint=n.publisher.replay_endpoint,
                    on_batch=functools.partial(router.apply, i),
                )
            )
            for i, n in enumerate(nodes)
        ]
        async with asyncio.TaskGroup() as tg:
            for node in nodes:
                tg.create_task(node.publisher.publish_stream(node.stream))
            following = [tg.create_task(s.run()) for s in subscribers]
            # Route once every node's full state is in: what a router does at start.
            for subscriber in subscribers:
                await subscriber.wait_in_sync()
            try:
                run = await serve_all(policy, router, nodes, sessions, args.decode_tokens)
            finally:  # the publishers' loops end with their streams; the subscribers stop
                for node in nodes:
                    node.stream.close()
                for task in following:
                    task.cancel()
        repaired = {
            name: sum(getattr(s.statistics, name) for s in subscribers)
            for name in ("missed", "replayed", "resets", "full_states_asked")
        }
        repaired["bad_messages"] = sum(s.bad_messages for s in subscribers)
    return PolicyRun(run, router, closed(nodes), repaired)


def seeded_sessions(sessions: Sequence[Sequence[Request]]) -> list[Sequence[Request]]:
    """The sessions whose first prompt is in the shared tier alone when the run starts: every
    other one."""
    return [s for i, s in enumerate(sessions) if i % 2 == 1]


def closed(nodes: Sequence[Node]) -> dict[str, Any]:
    """The batches each closed node published, the blocks its tiers stored, and what is
    left of them all: tasks besides the caller's, publisher threads, folders."""
    left = {
        "tasks": len(asyncio.all_tasks()) - 1,
        "event_threads": sum(t.name == "kvtier-kv-events" for t in threading.enumerate()),
        "folders": sum(os.path.exists(n.folder) for n in nodes),
    }
    tiers = [n.tiering.manager.statistics().tiers for n in nodes]
    return {
        "published_batches": [n.publisher.statistics().published for n in nodes],
        "fs_blocks_stored": [t[0].stores for t in tiers],
        "s3_blocks_stored": [t[1].stores if len(t) > 1 else 0 for t in tiers],
        "s3_blocks_loaded": [t[1].loads if len(t) > 1 else 0 for t in tiers],
        "left_after_shutdown": left,
    }


def summary(
    result: PolicyRun, nodes: int, block_size: int, shared_only: set[int]
) -> dict[str, Any]:
    """One policy's figures, as the JSON gives them; ``shared_only``: the requests whose
    prefix was in the shared tier alone when the run started."""
    results = list(result.run.results.values())
    ttfts = [r.ttft for r in results]
    alone = [r.ttft for r in results if r.rid in shared_only]
    loadable = sum((r.prompt_tokens - 1) // block_size for r in results)
    loaded = sum(r.loaded_blocks for r in results)
    routes = result.router.routes.values()
    per_node = [sum(1 for node, _ in routes if node == n) for n in range(nodes)]
    view = result.router.view
    return {
        "requests": len(results),
        "ttft_p50_s": demo.percentile(ttfts, 50),
        "ttft_p95_s": demo.percentile(ttfts, 95),
        "shared_only_requests": len(alone),
        "shared_only_ttft_p50_s": demo.percentile(alone, 50) if alone else None,
        "wall_s": result.run.wall,
        "prompt_blocks": loadable,
        "blocks_from_cache": loaded,
        "prefix_hit_ratio": loaded / loadable if loadable else math.nan,
        "prefill_tokens": sum(r.prompt_tokens - r.loaded_blocks * block_size for r in results),
        "requests_per_node": per_node,
        "routed_to_a_known_prefix": sum(1 for _, known in routes if known),
        "known_prefix_blocks": sum(known for _, known in routes),
        "events": {
            **dataclasses.asdict(result.router.counts),
            **result.subscribers,
            "fs_blocks_known_at_end": [len(view.believed(n, "fs")) for n in range(nodes)],
            "shared_blocks_known_at_end": len(view.shared("s3")),
            "tier_classes": dict(view.classes),
        },
        **result.nodes,
    }


def logits_diffs(runs: dict[str, PolicyRun]) -> list[float]:
    """Largest |logit difference| of each request that loaded a different number of blocks
    under two policies: loaded KV must give the logits a recompute gives."""
    diffs = []
    for a, b in itertools.combinations(POLICIES, 2):
        x_runs, y_runs = runs[a].run.results, runs[b].run.results
        diffs += [
            float((x.logits - y.logits).abs().max())
            for rid, x in x_runs.items()
            if (y := y_runs.get(rid)) is not None
            and x.loaded_blocks != y.loaded_blocks
            and x.logits is not None
            and y.logits is not None
        ]
    return diffs


def report(runs: dict[str, PolicyRun], args: argparse.Namespace, out: dict[str, Any]) -> bool:
    """Print the table and fill ``out``; True when the correctness check passed."""
    bs = ModelConfig(seed=args.seed).block_size
    shared_only = set(args.shared_only_rids)
    figures = {p: summary(runs[p], args.nodes, bs, shared_only) for p in POLICIES}
    out["policies"] = figures
    print()
    alone_head = "  shared-only p50" if shared_only else ""
    print(
        f"{'':14}{'TTFT p50':>10}{'TTFT p95':>10}{'prefix hits':>13}{alone_head}  requests per node"
    )
    for policy, f in figures.items():
        per_node = "/".join(map(str, f["requests_per_node"]))
        alone = f["shared_only_ttft_p50_s"]
        alone_cell = f"{alone:>15.3f} s" if shared_only and alone is not None else ""
        print(
            f"{policy:<14}{f['ttft_p50_s']:>8.3f} s{f['ttft_p95_s']:>8.3f} s"
            f"{f['prefix_hit_ratio']:>12.1%}{alone_cell}   {per_node}"
        )
    base = figures[ROUND_ROBIN]
    for policy in (BLOCK_COUNT, WEIGHTED):
        f = figures[policy]
        ratios = {
            "baseline": ROUND_ROBIN,
            "ttft_p50_speedup": base["ttft_p50_s"] / f["ttft_p50_s"],
            "ttft_p95_speedup": base["ttft_p95_s"] / f["ttft_p95_s"],
            "prefix_hit_ratio_gain": f["prefix_hit_ratio"] / (base["prefix_hit_ratio"] or math.nan),
        }
        out[f"{policy.replace('-', '_')}_vs_round_robin"] = ratios
        print(
            f"{policy} vs {ROUND_ROBIN}: TTFT {ratios['ttft_p50_speedup']:.2f} x faster at p50, "
            f"{ratios['ttft_p95_speedup']:.2f} x at p95; prefix hit ratio "
            f"{ratios['prefix_hit_ratio_gain']:.2f} x"
        )
    w, b = figures[WEIGHTED], figures[BLOCK_COUNT]
    versus: dict[str, Any] = {
        "baseline": BLOCK_COUNT,
        "ttft_p50_speedup": b["ttft_p50_s"] / w["ttft_p50_s"],
        "ttft_p95_speedup": b["ttft_p95_s"] / w["ttft_p95_s"],
    }
    if shared_only and w["shared_only_ttft_p50_s"] and b["shared_only_ttft_p50_s"]:
        versus["shared_only_ttft_p50_speedup"] = (
            b["shared_only_ttft_p50_s"] / w["shared_only_ttft_p50_s"]
        )
    out["weighted_vs_block_count"] = versus
    print(
        f"{WEIGHTED} vs {BLOCK_COUNT}: TTFT {versus['ttft_p50_speedup']:.2f} x faster at p50, "
        f"{versus['ttft_p95_speedup']:.2f} x at p95"
        + (
            f"; {versus['shared_only_ttft_p50_speedup']:.2f} x at p50 on the requests whose "
            "prefix was in the shared tier alone"
            if "shared_only_ttft_p50_speedup" in versus
            else ""
        )
    )
    events = w["events"]
    print(
        f"the {WEIGHTED} router learnt {events['stored_blocks']:,} stored blocks of the nodes' "
        f"own tiers and {events['shared_stored_blocks']:,} of the shared one from "
        f"{events['batches']:,} event batches ({events['removed_blocks']:,} removed, "
        f"{events['missed']} batches missed and {events['replayed']} replayed); "
        f"{w['routed_to_a_known_prefix']} of {w['requests']} requests went to a node known to "
        "reach part of their prefix"
    )
    out["correctness"] = check = demo.logits_check(logits_diffs(runs))
    print(
        f"correctness {'OK' if check['ok'] else 'FAIL'}: next-token logits of requests that "
        f"loaded different prefixes under two policies, max abs diff "
        f"{check['max_abs_diff']:.2e} over {check['compared']} requests"
    )
    return bool(check["ok"])


async def amain(args: argparse.Namespace, out: dict[str, Any]) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = ModelConfig(seed=args.seed)
    model = TinyTransformer(config)
    sessions, longest, max_len = demo.chat_workload(args, config, args.sessions * args.turns)
    args.shared_only_rids = [s[0].rid for s in seeded_sessions(sessions)] if args.shared_s3 else []
    warm = sessions[0][0].tokens[:256]
    await asyncio.to_thread(model.forward_tokens, warm, KVCache(config, 256))
    shared = (
        f"; one S3 prefix shared by every node ({args.s3_endpoint}), the first turns of "
        f"{len(args.shared_only_rids)} sessions in it alone at the start"
        if args.shared_s3
        else ""
    )
    print(
        f"{args.nodes} nodes, {args.concurrency} requests at once each; {args.sessions} chat "
        f"sessions of {args.turns} turns, prompts up to {longest} tokens{shared}",
        flush=True,
    )
    runs = {p: await run_policy(p, args, model, sessions, max_len) for p in POLICIES}
    return 0 if report(runs, args, out) else 1


SETTINGS = (  # the options the JSON output states the run was asked for
    *("quick", "nodes", "sessions", "turns", "system_tokens", "concurrency", "pool_blocks"),
    *("fs_capacity_mb", "decode_tokens", "threads", "seed", "shared_s3", "s3_endpoint"),
    *("s3_bucket", "tier_weights"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a small workload, for tests and CI")
    p.add_argument("--nodes", type=int, default=3, help="serving nodes behind the router")
    p.add_argument("--sessions", type=int, help="chat sessions (default 12, quick 6)")
    p.add_argument("--turns", type=int, help="turns per session (default 6, quick 3)")
    p.add_argument("--system-tokens", type=int, help="tokens per system prompt (768, quick 384)")
    p.add_argument("--concurrency", type=int, default=2, help="requests each node runs at once")
    p.add_argument("--pool-blocks", type=int, default=192, help="host pool of each node")
    p.add_argument("--fs-capacity-mb", type=int, default=1024, help="file tier of each node")
    p.add_argument("--decode-tokens", type=int, default=4, help="tokens decoded per request")
    p.add_argument("--threads", type=int, default=1, help="torch threads per forward pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tier-weights",
        type=parse_weights,
        default=dict(DEFAULT_WEIGHTS),
        metavar="CLASS=W,...",
        help="what a block saves by the class of the best tier holding it, for the weighted "
        f"policy (classes: {', '.join(TIER_CLASSES)}; default "
        + ",".join(f"{k}={v:g}" for k, v in DEFAULT_WEIGHTS.items())
        + ")",
    )
    p.add_argument(
        "--shared-s3",
        action="store_true",
        help="every node also has one S3 prefix they share (--s3-endpoint)",
    )
    p.add_argument("--s3-endpoint", help="the S3 endpoint of --shared-s3 (e.g. a SeaweedFS)")
    p.add_argument("--s3-bucket", default="kvtier-router", help="an existing bucket there")
    p.add_argument("--s3-prefix", default="kv-router", help="where each run's prefixes go")
    p.add_argument("--json", action="store_true", help=demo.JSON_HELP)
    args = p.parse_args(argv)
    quick = args.quick
    for name, value in (
        ("sessions", 6 if quick else 12),
        ("turns", 3 if quick else 6),
        ("system_tokens", 384 if quick else 768),
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.turn_tokens = (32, 128) if quick else (64, 256)
    for name in SETTINGS[1:11]:
        if name != "seed" and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.shared_s3 and not args.s3_endpoint:
        p.error("--shared-s3 needs --s3-endpoint (an S3 endpoint whose --s3-bucket exists)")
    args.run_id = f"{os.getpid()}-{int(time.time())}"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with demo.json_report(args.json) as out:
        out["settings"] = demo.settings(args, SETTINGS)
        return asyncio.run(amain(args, out))


if __name__ == "__main__":
    sys.exit(main())
