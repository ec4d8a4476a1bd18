"""Several serving nodes behind a KV-aware router, against round-robin, from the same run.

Each node is an engine from ``demo_engine.py`` with its own kvtier host pool and its own file
tier in its own temporary folder: nothing is shared, so a prefix is cached only on the nodes
that computed it, and where a request goes decides whether its prefix is loaded or recomputed.
Each node publishes its tiers' events (``kvtier.EventStream.from_tiers(manager.tiers)``) with
``kvtier.integrations.kv_events.KVEventPublisher``: vLLM's ``KVEventBatch`` on a ZMQ PUB
socket, the wire KV-aware routers read. The engine writes every block it computes through to
its file tier, so the tier's ``BlockStored`` events cover what the node computed.

The router subscribes to every node and keeps, per node, the block hashes its events announced
(stored adds, removed removes, cleared empties). A request goes to the node holding the longest
prefix of its block keys (``kvtier.block_keys``, the engine's own keys), ties to the least
loaded node (requests sent and not answered), then round-robin. Events arrive asynchronously,
as over a network: the router routes on what it knows when the request arrives, never waiting.

The workload is the demo's multi-turn chats, every session at once, each sending its next turn
when the previous one is answered: round-robin scatters a session's turns over nodes that never
computed its history; the KV-aware router sends them where it was computed. Both policies serve
the same requests on fresh nodes, one after the other in this process. For each, the script
prints TTFT p50 and p95, the prefix hit ratio (prompt blocks loaded from kvtier over prompt
blocks that could be loaded), the requests per node and the events the router received; then
KV-aware against round-robin, and a correctness line (logits of requests that loaded different
prefixes under the two policies agree).

    python examples/kv_router.py             # under a minute
    python examples/kv_router.py --quick     # a few seconds, for tests and CI

The nodes share this process's cores (each engine computes in a worker thread of its own), so
a node's TTFT includes waiting for CPU the others use, under both policies alike. Needs the
``torch`` and ``events`` extras. ``--json`` prints one JSON object: the settings, each policy's
figures, the ratios against round-robin, the correctness check and what each shutdown left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import demo_engine as demo
import msgspec
import torch
import zmq
import zmq.asyncio
from demo_engine import KVCache, ModelConfig, Request, TinyTransformer

import kvtier
from kvtier.integrations.kv_events import KVEventPublisher

ROUND_ROBIN, KV_AWARE = "round-robin", "kv-aware"
POLICIES = (ROUND_ROBIN, KV_AWARE)


# -- the router: synchronous bookkeeping, fed by the subscribers ------------------------------


@dataclass(slots=True)
class EventCounts:
    """What the router received, over every node."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    sequence_gaps: int = 0  # batches a subscriber never saw (its sequence jumped)
    bad_messages: int = 0  # messages that were not a KVEventBatch, ignored


class Router:
    """Which node holds which blocks, as the nodes' events said, and where a request goes.

    No I/O and no waiting: the subscribers hand it decoded batches (``apply``); the serving
    loop asks it for a node (``choose``) and takes the request off ``load`` when answered."""

    def __init__(self, nodes: int, policy: str) -> None:
        self.policy = policy
        self.held: list[set[bytes | int]] = [set() for _ in range(nodes)]
        self.load = [0] * nodes  # requests sent to each node and not answered yet
        self.routes: dict[int, tuple[int, int]] = {}  # request id -> node, known prefix blocks
        self.counts = EventCounts()
        self._next_sequence = [0] * nodes
        self._turn = 0  # where round-robin goes next

    def apply(self, node: int, sequence: int, body: Any) -> None:
        """One batch from ``node``: ``[ts, events, ...]`` as vLLM's ``KVEventBatch``, each event
        a map tagged ``type``. What comes off the wire is untrusted: a malformed batch is counted
        and ignored."""
        if sequence > self._next_sequence[node]:
            self.counts.sequence_gaps += sequence - self._next_sequence[node]
        self._next_sequence[node] = sequence + 1
        try:
            events = body[1]
            changes = [_change(event) for event in events]
        except (KeyError, IndexError, TypeError, ValueError):
            self.counts.bad_messages += 1
            return
        self.counts.batches += 1
        held = self.held[node]
        for kind, hashes in changes:
            if kind == "BlockStored":
                held.update(hashes)
                self.counts.stored_blocks += len(hashes)
            elif kind == "BlockRemoved":
                held.difference_update(hashes)
                self.counts.removed_blocks += len(hashes)
            elif kind == "AllBlocksCleared":
                held.clear()
                self.counts.cleared += 1

    def prefix(self, node: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the router knows ``node`` holds."""
        return sum(1 for _ in itertools.takewhile(self.held[node].__contains__, keys))

    def choose(self, rid: int, keys: Sequence[bytes]) -> int:
        """The node for request ``rid`` with ``keys``, counted as its load until finished."""
        nodes = len(self.load)
        order = [(self._turn + i) % nodes for i in range(nodes)]  # round-robin breaks ties
        if self.policy == KV_AWARE:
            node = min(order, key=lambda n: (-self.prefix(n, keys), self.load[n]))
        else:
            node = order[0]
        self._turn = (node + 1) % nodes
        self.routes[rid] = node, self.prefix(node, keys)
        self.load[node] += 1
        return node


def _change(event: Any) -> tuple[str, list[bytes | int]]:
    """``(type, block hashes)`` of one event map; KeyError or TypeError when it is not one."""
    hashes = [] if event["type"] == "AllBlocksCleared" else event["block_hashes"]
    if not isinstance(hashes, list) or not all(isinstance(h, bytes | int) for h in hashes):
        raise TypeError("block_hashes is not a list of block hashes")
    return event["type"], hashes


async def follow(router: Router, node: int, socket: zmq.asyncio.Socket) -> None:
    """Feed the router every batch ``node`` publishes, until cancelled."""
    decoder = msgspec.msgpack.Decoder()
    while True:
        frames = await socket.recv_multipart()  # (topic, sequence, payload)
        if len(frames) == 3 and len(frames[1]) == 8:
            with contextlib.suppress(msgspec.DecodeError):
                router.apply(node, int.from_bytes(frames[1], "big"), decoder.decode(frames[2]))
                continue
        router.counts.bad_messages += 1  # not a (topic, sequence, msgpack payload) message


@contextlib.contextmanager
def subscribed(endpoints: Sequence[str]) -> Iterator[list[zmq.asyncio.Socket]]:
    """One SUB socket per publisher endpoint, every topic; closed (with the context) after."""
    context = zmq.asyncio.Context()
    sockets = [context.socket(zmq.SUB) for _ in endpoints]
    try:
        for socket, endpoint in zip(sockets, endpoints, strict=True):
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
        yield sockets
    finally:
        for socket in sockets:
            socket.close(linger=0)
        context.term()


# -- the nodes ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Node:
    """One serving node: its engine, its kvtier, and its events on the wire."""

    engine: demo.Engine
    tiering: demo.KVTier
    publisher: KVEventPublisher
    stream: kvtier.EventStream
    folder: str


async def start_node(
    stack: AsyncExitStack, args: argparse.Namespace, model: TinyTransformer, max_len: int
) -> Node:
    """A node whose tiers, publisher, stream and folder ``stack`` closes, in reverse order."""
    c = model.config
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-router-node-"))
    pool = kvtier.HostPool(args.pool_blocks, c.block_bytes)
    fs = kvtier.FSTier(os.path.join(folder, "fs"), capacity_bytes=args.fs_capacity_mb << 20)
    manager = await stack.enter_async_context(kvtier.TieringManager(pool, [fs]))
    publisher = await stack.enter_async_context(
        KVEventPublisher("tcp://127.0.0.1:0", block_size=c.block_size)
    )
    stream = await stack.enter_async_context(kvtier.EventStream.from_tiers(manager.tiers))
    tiering = demo.KVTier(manager, kvtier.OffloadScheduler(manager))
    return Node(demo.Engine(model, args.concurrency, max_len), tiering, publisher, stream, folder)


@dataclass(slots=True)
class PolicyRun:
    """One policy's run: the demo's per-request results and the router."""

    run: demo.RunResult
    router: Router  # where each request went, what it learnt
    nodes: dict[str, Any]  # what the closed nodes sent and stored, and what is left of them


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
                router.load[node] -= 1
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
    """Fresh nodes and a router with ``policy`` serve ``sessions``; everything closed after."""
    router = Router(args.nodes, policy)
    async with AsyncExitStack() as stack:
        nodes = [await start_node(stack, args, model, max_len) for _ in range(args.nodes)]
        sockets = stack.enter_context(subscribed([n.publisher.endpoint for n in nodes]))
        async with asyncio.TaskGroup() as tg:
            for node in nodes:
                tg.create_task(node.publisher.publish_stream(node.stream))
            followers = [tg.create_task(follow(router, i, s)) for i, s in enumerate(sockets)]
            try:
                run = await serve_all(policy, router, nodes, sessions, args.decode_tokens)
            finally:  # the publishers' loops end with their streams; the subscribers stop
                for node in nodes:
                    node.stream.close()
                for task in followers:
                    task.cancel()
    return PolicyRun(run, router, closed(nodes))


def closed(nodes: Sequence[Node]) -> dict[str, Any]:
    """The batches each closed node published, the blocks its file tier stored, and what is
    left of them all: tasks besides the caller's, publisher threads, folders."""
    left = {
        "tasks": len(asyncio.all_tasks()) - 1,
        "event_threads": sum(t.name == "kvtier-kv-events" for t in threading.enumerate()),
        "folders": sum(os.path.exists(n.folder) for n in nodes),
    }
    return {
        "published_batches": [n.publisher.statistics().published for n in nodes],
        "fs_blocks_stored": [n.tiering.manager.statistics().tiers[0].stores for n in nodes],
        "left_after_shutdown": left,
    }


def summary(result: PolicyRun, nodes: int, block_size: int) -> dict[str, Any]:
    """One policy's figures, as the JSON gives them."""
    results = list(result.run.results.values())
    ttfts = [r.ttft for r in results]
    loadable = sum((r.prompt_tokens - 1) // block_size for r in results)
    loaded = sum(r.loaded_blocks for r in results)
    routes = result.router.routes.values()
    per_node = [sum(1 for node, _ in routes if node == n) for n in range(nodes)]
    return {
        "requests": len(results),
        "ttft_p50_s": demo.percentile(ttfts, 50),
        "ttft_p95_s": demo.percentile(ttfts, 95),
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
            "blocks_known_at_end": [len(held) for held in result.router.held],
        },
        **result.nodes,
    }


def logits_diffs(runs: dict[str, PolicyRun]) -> list[float]:
    """Largest |logit difference| of each request that loaded a different number of blocks
    under the two policies: loaded KV must give the logits a recompute gives."""
    a, b = (runs[p].run.results for p in POLICIES)
    pairs = [(x, b[rid]) for rid, x in a.items() if rid in b]
    return [
        float((x.logits - y.logits).abs().max())
        for x, y in pairs
        if x.loaded_blocks != y.loaded_blocks and x.logits is not None and y.logits is not None
    ]


def report(runs: dict[str, PolicyRun], args: argparse.Namespace, out: dict[str, Any]) -> bool:
    """Print the table and fill ``out``; True when the correctness check passed."""
    bs = ModelConfig(seed=args.seed).block_size
    figures = {p: summary(runs[p], args.nodes, bs) for p in POLICIES}
    out["policies"] = figures
    print()
    print(f"{'':14}{'TTFT p50':>10}{'TTFT p95':>10}{'prefix hits':>13}  requests per node")
    for policy, f in figures.items():
        per_node = "/".join(map(str, f["requests_per_node"]))
        print(
            f"{policy:<14}{f['ttft_p50_s']:>8.3f} s{f['ttft_p95_s']:>8.3f} s"
            f"{f['prefix_hit_ratio']:>12.1%}   {per_node}"
        )
    base, kv = figures[ROUND_ROBIN], figures[KV_AWARE]
    ratios = {
        "baseline": ROUND_ROBIN,
        "ttft_p50_speedup": base["ttft_p50_s"] / kv["ttft_p50_s"],
        "ttft_p95_speedup": base["ttft_p95_s"] / kv["ttft_p95_s"],
        "prefix_hit_ratio_gain": kv["prefix_hit_ratio"] / (base["prefix_hit_ratio"] or math.nan),
    }
    out["kv_aware_vs_round_robin"] = ratios
    print(
        f"{KV_AWARE} vs {ROUND_ROBIN}: TTFT {ratios['ttft_p50_speedup']:.2f} x faster at p50, "
        f"{ratios['ttft_p95_speedup']:.2f} x at p95; prefix hit ratio "
        f"{ratios['prefix_hit_ratio_gain']:.2f} x"
    )
    events = kv["events"]
    print(
        f"the {KV_AWARE} router learnt {events['stored_blocks']:,} stored blocks from "
        f"{events['batches']:,} event batches ({events['removed_blocks']:,} removed, "
        f"{events['sequence_gaps']} batches missed); {kv['routed_to_a_known_prefix']} of "
        f"{kv['requests']} requests went to a node known to hold part of their prefix"
    )
    out["correctness"] = check = demo.logits_check(logits_diffs(runs))
    print(
        f"correctness {'OK' if check['ok'] else 'FAIL'}: next-token logits of requests that "
        f"loaded different prefixes under the two policies, max abs diff "
        f"{check['max_abs_diff']:.2e} over {check['compared']} requests"
    )
    return bool(check["ok"])


async def amain(args: argparse.Namespace, out: dict[str, Any]) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = ModelConfig(seed=args.seed)
    model = TinyTransformer(config)
    sessions, longest, max_len = demo.chat_workload(args, config, args.sessions * args.turns)
    warm = sessions[0][0].tokens[:256]
    await asyncio.to_thread(model.forward_tokens, warm, KVCache(config, 256))
    print(
        f"{args.nodes} nodes, {args.concurrency} requests at once each; {args.sessions} chat "
        f"sessions of {args.turns} turns, prompts up to {longest} tokens",
        flush=True,
    )
    runs = {p: await run_policy(p, args, model, sessions, max_len) for p in POLICIES}
    return 0 if report(runs, args, out) else 1


SETTINGS = (  # the options the JSON output states the run was asked for
    *("quick", "nodes", "sessions", "turns", "system_tokens", "concurrency", "pool_blocks"),
    *("fs_capacity_mb", "decode_tokens", "threads", "seed"),
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
    for name in SETTINGS[1:]:
        if name != "seed" and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with demo.json_report(args.json) as out:
        out["settings"] = demo.settings(args, SETTINGS)
        return asyncio.run(amain(args, out))


if __name__ == "__main__":
    sys.exit(main())
