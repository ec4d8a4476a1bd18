"""Replay a Mooncake-format request trace through kvtier and measure the prefix hit ratio.

Each trace line is a request whose prompt is a chain of block ids (``hash_ids``, one per 512
tokens, prefix-chained like kvtier keys). For every request, in trace order, the replay does
what an engine does: ``await scheduler.lookup(keys)`` (real async existence checks and
promotions from the file tier, or S3), ``load`` the hit prefix out of the primary pool (and
checks every loaded byte), and ``store`` the blocks that missed (written through to the tiers
in the background). Payloads are small (``--payload-bytes``), so the run measures kvtier's
policies and overhead rather than the disk.

Beside kvtier's numbers it prints two references computed in the same run from the same
requests: the infinite-cache bound (every block ever seen is still cached) and a plain LRU
cache with the primary pool's capacity. It also replays the pool alone (no tiers) under each
eviction policy, which isolates the policy from the tiers.

    python -m benchmarks.replay_trace                      # the shipped first 1,000 requests
    python -m benchmarks.replay_trace ../shared/traces/mooncake_synthetic_trace.jsonl  # all
    python -m benchmarks.replay_trace --limit 500          # the first 500 requests
    python -m benchmarks.replay_trace --plot hit_ratio.png # also sweep the primary's size

The ratio reported is hit blocks / requested blocks, where a hit is a block of the request's
prefix that kvtier served (a prefix ends at the first block it could not serve).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import statistics
import struct
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from tqdm import tqdm

import kvtier
from benchmarks.agent_trace import AgentWorkload, generate
from benchmarks.common import add_json_flag, json_output
from benchmarks.session_replay import DEFAULT_TIERS, TierModel, run_sessions
from kvtier.common._format import header_size  # an FS file's header, for a capacity in blocks

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "benchmarks" / "data" / "mooncake_trace_first1000.jsonl"
BLOCK_TOKENS = 512  # the Mooncake trace's block size
LOOKUP_TIMEOUT = 5.0
KEY_PERSON = b"kvtier.trace"
POLICIES = ("lru", "arc")
DEFAULT_POLICY = "lru"  # the pools' default
# The sweep's primary sizes, as shares of the blocks the trace touches.
SWEEP = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
SWEEP_QUICK = (0.02, 0.05, 0.1, 0.3, 1.0)


# -- trace -------------------------------------------------------------------------------------


def key_of(block_id: int) -> bytes:
    """A deterministic 16-byte kvtier key for a trace block id (ids are already prefix-chained,
    so the key needs no chaining of its own)."""
    return hashlib.blake2b(struct.pack("<Q", block_id), digest_size=16, person=KEY_PERSON).digest()


def load_trace(path: Path, limit: int | None = None) -> list[list[bytes]]:
    """The requests of a trace as lists of keys, in trace (timestamp) order."""
    requests: list[tuple[float, int, list[int]]] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            if line.strip():
                row = json.loads(line)
                requests.append((float(row.get("timestamp", 0)), i, list(row["hash_ids"])))
    requests.sort()
    return requests_of({"hash_ids": ids} for _, _, ids in requests)


def requests_of(rows: Iterable[dict[str, Any]]) -> list[list[bytes]]:
    """The keys of each row's ``hash_ids``, in the rows' order."""
    keys: dict[int, bytes] = {}
    return [[keys.setdefault(h, key_of(h)) for h in row["hash_ids"]] for row in rows]


def payload_of(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes stored for ``key``: the key repeated, so every load can be verified."""
    reps = -(-nbytes // len(key))
    return np.frombuffer(key * reps, np.uint8)[:nbytes]


# -- references --------------------------------------------------------------------------------


def infinite_hits(requests: Iterable[Sequence[bytes]]) -> int:
    """Prefix hits of a cache that never forgets."""
    seen: set[bytes] = set()
    hits = 0
    for keys in requests:
        for key in keys:
            if key not in seen:
                break
            hits += 1
        seen.update(keys)
    return hits


def lru_hits(
    requests: Iterable[Sequence[bytes]], capacity: int, *, tail_first: bool = False
) -> int:
    """Prefix hits of a plain LRU cache of ``capacity`` blocks; every block a request names is
    used (moved to the front, or inserted and the oldest dropped). With ``tail_first``, once a
    request has used its blocks they are touched again from its tail to its head, so within a
    request the tail is older and leaves first (the order vLLM frees a request's blocks in)."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    touch = cache.move_to_end
    hits = 0
    for keys in requests:
        prefix = True
        for key in keys:
            if key in cache:
                touch(key)
                hits += prefix
            else:
                prefix = False
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
        if tail_first:
            for key in reversed(keys):
                if key in cache:
                    touch(key)
    return hits


def min_hits(requests: Sequence[Sequence[bytes]], capacity: int) -> int:
    """Prefix hits of Belady's MIN on blocks: every block a request names is used, as in
    ``lru_hits``, and a block that does not fit evicts the cached block needed again last
    (or is not kept, when it is itself needed last). MIN is optimal for block hits, not for
    prefix hits, so this is a near-optimal reference, not a strict bound."""
    flat = [key for keys in requests for key in keys]
    never = len(flat)
    next_use = [never] * len(flat)
    seen: dict[bytes, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], never)
        seen[flat[i]] = i
    cached: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    hits = i = 0
    for keys in requests:
        prefix = True
        for key in keys:
            nxt = next_use[i]
            i += 1
            if key in cached:
                hits += prefix
            else:
                prefix = False
                if len(cached) >= capacity:
                    while -heap[0][0] != cached.get(heap[0][1]):
                        heapq.heappop(heap)
                    if -heap[0][0] <= nxt:
                        continue  # needed later than every cached block: not kept
                    del cached[heapq.heappop(heap)[1]]
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, key))
    return hits


# -- kvtier replay -----------------------------------------------------------------------------


@dataclass(slots=True)
class ReplayResult:
    label: str
    requested: int = 0
    hits: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    verified: int = 0
    lookup_us: list[float] = field(default_factory=list)
    request_us: list[float] = field(default_factory=list)
    wall: float = 0.0
    stats: kvtier.ManagerStatistics | None = None

    @property
    def ratio(self) -> float:
        return self.hits / self.requested if self.requested else 0.0


def progress_bar(label: str, total: int, enabled: bool = True) -> tqdm[NoReturn]:
    """A progress bar on stderr (tqdm; a line every few seconds when stderr is not a terminal),
    with the hit ratio so far as its postfix."""
    return tqdm(
        total=total,
        desc=f"{label:<28}",
        bar_format="{desc} |{bar:30}| {n_fmt:>6}/{total_fmt} [{elapsed}{postfix}]",
        file=sys.stderr,
        disable=not enabled or not total,
        mininterval=0.1 if sys.stderr.isatty() else 5.0,
        ascii=not sys.stderr.isatty(),
    )


def fs_capacity_bytes(blocks: int, payload_bytes: int) -> int:
    return blocks * (header_size(16) + payload_bytes)


async def replay(
    requests: Sequence[Sequence[bytes]],
    *,
    primary_blocks: int,
    policy: str,
    tiers: Sequence[kvtier.SecondaryTier] = (),
    payload_bytes: int = 64,
    label: str = "kvtier",
    progress: bool = True,
    settle: bool = True,
) -> ReplayResult:
    """Replay ``requests`` through a TieringManager over a HostPool and ``tiers`` (which the
    manager opens and closes), verifying every loaded block.

    Requests arrive back to back, with no prefill time between them, so writes queue up far
    faster than in an engine. Whether a block written through for one request has landed in
    a tier when the next request asks for it would then depend on how fast the machine is
    (hits varied from 72 to 250 over runs of the same 200 requests), and the default
    admission would close a tier for latency at moments that depend on how busy it is. The
    replay measures hit rates, so with ``settle`` (the default) each request's write-through
    and promotions land before the next request arrives, as an engine's prefill time would
    let them, and latency never closes a tier: the figures do not change with the machine's
    load. ``settle=False`` replays back to back."""
    result = ReplayResult(label)
    result.hits_by_tier = {"primary": 0, **{t.name: 0 for t in tiers}}
    longest = max((len(r) for r in requests), default=1)
    out = np.empty((longest, payload_bytes), np.uint8)
    payloads: dict[bytes, np.ndarray] = {}
    bar = progress_bar(label, len(requests), progress)
    pool = kvtier.HostPool(primary_blocks, payload_bytes, policy=policy)
    started = time.perf_counter()
    admission = kvtier.AdmissionPolicy(max_write_latency=None)
    async with kvtier.TieringManager(pool, tiers, admission=admission) as manager:
        scheduler = kvtier.OffloadScheduler(manager)
        for done, keys in enumerate(requests, 1):
            resident = 0
            for key in keys:
                if pool.state_of(key) is not kvtier.SlotState.READY:
                    break
                resident += 1
            loads_before = [t.statistics().loads for t in tiers]

            t0 = time.perf_counter()
            hit = await scheduler.lookup(keys, timeout=LOOKUP_TIMEOUT)
            t1 = time.perf_counter()
            loaded = await manager.load(keys[:hit], out[:hit]) if hit else 0
            if len(keys) > loaded:
                new = np.stack(
                    [payloads.setdefault(k, payload_of(k, payload_bytes)) for k in keys[loaded:]]
                )
                await manager.store(keys[loaded:], new)
            t2 = time.perf_counter()

            for i in range(loaded):
                expected = payloads.get(keys[i])
                if expected is None:
                    expected = payloads.setdefault(keys[i], payload_of(keys[i], payload_bytes))
                if not np.array_equal(out[i], expected):
                    raise AssertionError(f"request {done}: block {i} loaded wrong bytes")
            result.verified += loaded
            result.requested += len(keys)
            result.hits += loaded
            promoted = [t.statistics().loads - b for t, b in zip(tiers, loads_before, strict=True)]
            # Blocks not resident before the lookup came from the tiers that promoted them.
            from_tiers = loaded - min(resident, loaded)
            for tier, count in zip(tiers, promoted, strict=True):
                take = min(count, from_tiers)
                result.hits_by_tier[tier.name] += take
                from_tiers -= take
            result.hits_by_tier["primary"] += min(resident, loaded) + from_tiers
            result.lookup_us.append((t1 - t0) * 1e6)
            result.request_us.append((t2 - t0) * 1e6)
            if settle:
                await manager.wait_idle()
            bar.set_postfix_str(f"hit {result.ratio:6.2%}", refresh=False)
            bar.update()
    bar.close()
    result.wall = time.perf_counter() - started  # includes finishing the write-through
    result.stats = manager.statistics()
    return result


# -- command line ------------------------------------------------------------------------------


def tokens(text: str) -> int:
    """A size in tokens: ``3000000``, ``3M``, ``512k``."""
    text = text.strip().lower()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:], 1)
    value = float(text[:-1] if scale != 1 else text) * scale
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return int(value)


def blocks_of(n_tokens: int) -> int:
    return max(1, n_tokens // BLOCK_TOKENS) if n_tokens else 0


def _summary(values: Sequence[float]) -> dict[str, float] | None:
    """Mean, p50 and p99 of ``values`` (None when empty)."""
    if not values:
        return None
    p50, p99 = np.percentile(values, [50, 99])
    return {"mean": statistics.fmean(values), "p50": float(p50), "p99": float(p99)}


def _pcts(values: Sequence[float]) -> str:
    if not values:
        return "-"
    p50, p99 = np.percentile(values, [50, 99])
    return f"{statistics.fmean(values):>9.0f}{p50:>9.0f}{p99:>9.0f}"


def make_tiers(args: argparse.Namespace, scratch: str) -> list[kvtier.SecondaryTier]:
    tiers: list[kvtier.SecondaryTier] = []
    if args.fs_tokens:
        root = args.fs_root or str(Path(scratch) / "fs")
        capacity = fs_capacity_bytes(blocks_of(args.fs_tokens), args.payload_bytes)
        tiers.append(kvtier.FSTier(root, capacity_bytes=capacity, fsync="never"))
    if args.s3_bucket:
        tiers.append(
            kvtier.S3Tier(args.s3_bucket, prefix=args.s3_prefix, endpoint_url=args.s3_endpoint)
        )
    return tiers


@dataclass(slots=True)
class SweepPoint:
    """One primary size of the sweep: each policy's pool alone and the references."""

    tokens: int
    blocks: int
    pool: dict[str, int]
    plain_lru: int
    tail_first_lru: int
    min: int


def sweep(
    requests: Sequence[Sequence[bytes]],
    capacities: Sequence[int],
    policies: Sequence[str],
    payload_bytes: int,
    progress: bool,
) -> list[SweepPoint]:
    """The pool alone under each policy (each a full replay) and the references, at each
    primary size (in tokens)."""
    points = []
    for cap in capacities:
        blocks = blocks_of(cap)
        pool = {
            p: asyncio.run(
                replay(
                    requests,
                    primary_blocks=blocks,
                    policy=p,
                    payload_bytes=payload_bytes,
                    label=f"sweep {p} {cap / 1e6:g}M",
                    progress=progress,
                )
            ).hits
            for p in policies
        }
        points.append(
            SweepPoint(
                tokens=cap,
                blocks=blocks,
                pool=pool,
                plain_lru=lru_hits(requests, blocks),
                tail_first_lru=lru_hits(requests, blocks, tail_first=True),
                min=min_hits(requests, blocks),
            )
        )
    return points


def plot(
    path: str, title: str, points: Sequence[SweepPoint], requested: int, infinite: float
) -> None:
    """Hit ratio against primary capacity: kvtier's pool alone under each policy, and the
    references (plain LRU, tail-first LRU, Belady's MIN)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[float]] = {}
    for point in points:
        for p, hits in point.pool.items():
            curves.setdefault(f"kvtier pool ({p})", []).append(hits / requested)
        curves.setdefault("plain LRU", []).append(point.plain_lru / requested)
        curves.setdefault("tail-first LRU", []).append(point.tail_first_lru / requested)
        curves.setdefault("Belady MIN (offline)", []).append(point.min / requested)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [point.tokens / 1e6 for point in points]
    for name, ys in curves.items():
        style = "-" if name.startswith("kvtier") else "--"
        ax.plot(xs, ys, marker="o", linestyle=style, label=name)
    ax.axhline(infinite, color="gray", linestyle=":", label="infinite cache")
    ax.set_xlabel("primary capacity (million tokens)")
    ax.set_ylabel("prefix hit ratio (hit blocks / requested)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--quick", action="store_true", help="the first 500 requests, a short sweep")
    p.add_argument("--primary-tokens", type=tokens, default=3_000_000, help="host pool size")
    p.add_argument("--fs-tokens", type=tokens, default=50_000_000, help="file tier size; 0: none")
    p.add_argument("--fs-root", help="file tier folder (default: a temporary folder)")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    p.add_argument("--payload-bytes", type=int, default=64, help="bytes stored per block")
    p.add_argument("--s3-endpoint", help="S3-compatible endpoint URL")
    p.add_argument("--s3-bucket", help="add an S3 tier on this bucket")
    p.add_argument("--s3-prefix", default="kvtier-replay/")
    p.add_argument(
        "--agent",
        action="store_true",
        help="replay the synthetic agent workload (benchmarks.agent_trace) instead of a trace",
    )
    p.add_argument("--agent-sessions", type=int, default=AgentWorkload().sessions)
    p.add_argument("--agent-seed", type=int, default=AgentWorkload().seed)
    p.add_argument(
        "--session-hints",
        action="store_true",
        help="with --agent: replay the sessions on the trace's clock against a time model of "
        "each lower tier, without and with session hints (benchmarks.session_replay)",
    )
    p.add_argument(
        "--tier-model",
        action="append",
        type=TierModel.parse,
        metavar="NAME:LATENCY_MS:MB_PER_S",
        help=f"a lower tier's time model for --session-hints, repeatable (default: "
        f"{' '.join(DEFAULT_TIERS)})",
    )
    p.add_argument(
        "--block-mib", type=float, default=4.0, help="bytes of KV per block, --session-hints"
    )
    p.add_argument("--sweep", action="store_true", help="sweep the primary's size (JSON)")
    p.add_argument("--plot", metavar="FILE.png", help="sweep the primary's size and plot")
    p.add_argument("--no-progress", action="store_true")
    add_json_flag(p)
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="do not let each request's writes land before the next one (hits then depend "
        "on the machine's speed)",
    )
    args = p.parse_args(argv)
    if args.limit is None and args.quick:
        args.limit = 500
    if args.limit is not None and args.limit <= 0:
        p.error("--limit must be positive")
    if args.primary_tokens < BLOCK_TOKENS:
        p.error(f"--primary-tokens must be at least one block ({BLOCK_TOKENS} tokens)")
    if args.payload_bytes <= 0:
        p.error("--payload-bytes must be positive")
    if args.agent and args.agent_sessions <= 0:
        p.error("--agent-sessions must be positive")
    if args.session_hints and not args.agent:
        p.error("--session-hints replays the agent workload: add --agent")
    if args.block_mib <= 0:
        p.error("--block-mib must be positive")
    args.tier_model = args.tier_model or [TierModel.parse(t) for t in DEFAULT_TIERS]
    args.sweep = args.sweep or bool(args.plot)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.agent:
        workload = AgentWorkload(sessions=args.agent_sessions, seed=args.agent_seed)
        name = f"agent(sessions={workload.sessions}, seed={workload.seed})"
        rows = generate(workload)[: args.limit]
        with json_output(args.json) as out:
            if args.session_hints:
                return run_sessions(args, name, rows, requests_of(rows), out)
            return run(args, name, requests_of(rows), out)
    trace = Path(args.trace)
    if not trace.is_file():
        print(f"trace not found: {trace}", file=sys.stderr)
        return 2
    with json_output(args.json) as out:
        return run(args, trace.name, load_trace(trace, args.limit), out)


def run(
    args: argparse.Namespace, name: str, requests: list[list[bytes]], out: dict[str, Any]
) -> int:
    """Replay ``requests`` (the trace ``name``) as ``args`` say, print the report and put its
    figures in ``out``; 0 when every check passed or the run covers only a prefix of it."""
    requested = sum(len(r) for r in requests)
    distinct = len({k for r in requests for k in r})
    primary = blocks_of(args.primary_tokens)
    show = not args.no_progress
    print(
        f"trace {name}: {len(requests):,} requests, {requested:,} blocks requested "
        f"({BLOCK_TOKENS} tokens each), {distinct:,} distinct"
    )
    infinite = infinite_hits(requests)
    lru = lru_hits(requests, primary)
    tail_first = lru_hits(requests, primary, tail_first=True)
    offline = min_hits(requests, primary)

    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as scratch:
        tiers = make_tiers(args, scratch)
        names = " + ".join([f"pool({args.policy})", *(t.name for t in tiers)])
        main_run = asyncio.run(
            replay(
                requests,
                primary_blocks=primary,
                policy=args.policy,
                tiers=tiers,
                payload_bytes=args.payload_bytes,
                label=f"kvtier {names}",
                progress=show,
                settle=not args.back_to_back,
            )
        )
    alone = {
        policy: asyncio.run(
            replay(
                requests,
                primary_blocks=primary,
                policy=policy,
                payload_bytes=args.payload_bytes,
                label=f"kvtier pool({policy}) alone",
                progress=show,
            )
        )
        for policy in POLICIES
    }

    out["settings"] = {
        "trace": name,
        "requests": len(requests),
        "limit": args.limit,
        "primary_blocks": primary,
        "fs_blocks": blocks_of(args.fs_tokens) if args.fs_tokens else 0,
        "s3_bucket": args.s3_bucket,
        "policy": args.policy,
        "payload_bytes": args.payload_bytes,
        "block_tokens": BLOCK_TOKENS,
    }
    out["blocks"] = {"requested": requested, "distinct": distinct}
    hit_ratio: dict[str, Any] = {"baseline": "infinite", "served_by": {}, "pool_alone": {}}
    out["hit_ratio"] = hit_ratio

    def row(name: str, hits: int, *where: str) -> None:
        ratio = hits / requested if requested else 0.0
        of_bound = hits / infinite if infinite else float("nan")
        into = hit_ratio
        for step in where[:-1]:
            into = into[step]
        into[where[-1]] = {"hits": hits, "ratio": ratio, "of_bound": of_bound}
        print(f"  {name:<44}{hits:>12,}{ratio:>10.2%}{of_bound:>12.2%}")

    print()
    print(
        f"sizes: primary {args.primary_tokens:,} tokens = {primary:,} blocks; "
        + (
            f"fs {args.fs_tokens:,} tokens = {blocks_of(args.fs_tokens):,} blocks"
            if args.fs_tokens
            else "no fs tier"
        )
        + (f"; s3 bucket {args.s3_bucket}" if args.s3_bucket else "")
        + f"; {args.payload_bytes} payload bytes per block"
    )
    print(f"  {'prefix hit ratio':<44}{'hit blocks':>12}{'ratio':>10}{'of bound':>12}")
    row("infinite cache (bound)", infinite, "infinite")
    row(f"plain LRU, {primary:,} blocks", lru, "plain_lru")
    row(f"tail-first LRU, {primary:,} blocks", tail_first, "tail_first_lru")
    row(f"Belady MIN (offline), {primary:,} blocks", offline, "min")
    row(f"kvtier {names}", main_run.hits, "kvtier")
    for tier, hits in main_run.hits_by_tier.items():
        row(f"  served by {tier}", hits, "served_by", tier)
    for policy, r in alone.items():
        row(f"kvtier pool({policy}) alone, {primary:,} blocks", r.hits, "pool_alone", policy)
    print()
    print(f"  {'overhead per request (us)':<44}{'mean':>9}{'p50':>9}{'p99':>9}")
    out["overhead_us"] = {
        r.label: {"lookup": _summary(r.lookup_us), "request": _summary(r.request_us)}
        for r in (main_run, *alone.values())
    }
    for r in (main_run, *alone.values()):
        print(f"  {r.label + ': lookup':<44}{_pcts(r.lookup_us)}")
        print(f"  {r.label + ': lookup + load + store':<44}{_pcts(r.request_us)}")
    s = main_run.stats
    out["verified"] = main_run.verified
    out["hits_by_tier"] = main_run.hits_by_tier
    if s is not None:
        out["manager"] = {
            "promotions_ok": s.promotions.succeeded,
            "promotions_failed": sum(s.promotions.failed_by_reason.values()),
            "stored": s.stores.stored,
            "cascades_ok": s.writes.succeeded,
            "cascades_skipped": s.writes.skipped,
            "cascades_failed": sum(s.writes.failures_by_reason.values()),
            "cascades_dropped": s.writes.dropped,
            "pool_evictions": s.pool.evictions,
        }
        print()
        print(
            f"kvtier {names}: {main_run.wall:.1f} s, {main_run.verified:,} loaded blocks verified "
            f"byte for byte; promotions {s.promotions.succeeded:,} ok / "
            f"{sum(s.promotions.failed_by_reason.values()):,} failed; stored {s.stores.stored:,}; "
            f"write-through {s.writes.succeeded:,} ok / {s.writes.skipped:,} skipped / "
            f"{sum(s.writes.failures_by_reason.values()):,} failed; "
            f"pool evictions {s.pool.evictions:,}"
        )
        for t in s.tiers:
            print(
                f"  {t.name}: {t.blocks:,} blocks, {t.stores:,} stores, {t.loads:,} loads, "
                f"{t.evictions:,} evictions, lookups {t.lookups.hits:,} hit / "
                f"{t.lookups.misses:,} miss / {t.lookups.retries:,} retry"
            )
    default = alone[DEFAULT_POLICY].hits
    print(
        f"\nkvtier pool({DEFAULT_POLICY}) alone reaches {default / offline if offline else 1:.1%}"
        " of Belady's MIN at this size"
    )
    checks = {
        "near_bound": (
            f"kvtier {names} >= 99% of the infinite bound",
            main_run.hits >= 0.99 * infinite,
        ),
        "default_vs_tail_first": (
            f"kvtier pool({DEFAULT_POLICY}) alone >= tail-first LRU",
            default >= tail_first,
        ),
        "default_vs_lru": (f"kvtier pool({DEFAULT_POLICY}) alone >= plain LRU", default >= lru),
        "within_bound": (
            "no run beats the infinite bound",
            all(r.hits <= infinite for r in (main_run, *alone.values())),
        ),
    }
    if args.sweep:
        checks.update(run_sweep(args, name, requests, distinct, infinite, out))
    out["checks"] = {key: {"check": name, "ok": ok} for key, (name, ok) in checks.items()}
    out["whole_trace"] = args.limit is None
    print()
    for check, ok in checks.values():
        print(f"check {'PASS' if ok else 'FAIL'}: {check}")
    if args.limit is not None:
        print("(the first is an aim for the whole trace; a prefix of it is mostly cold)")
    return 0


def run_sweep(
    args: argparse.Namespace,
    name: str,
    requests: Sequence[Sequence[bytes]],
    distinct: int,
    infinite: int,
    out: dict[str, Any],
) -> dict[str, tuple[str, bool]]:
    """Sweep the primary's size (and plot it with ``--plot``); the checks it adds."""
    requested = sum(len(r) for r in requests)
    shares = SWEEP_QUICK if args.quick else SWEEP
    capacities = sorted({max(int(distinct * share), 1) * BLOCK_TOKENS for share in shares})
    points = sweep(requests, capacities, POLICIES, args.payload_bytes, not args.no_progress)
    out["sweep"] = [
        {
            "tokens": p.tokens,
            "blocks": p.blocks,
            "pool": p.pool,
            "plain_lru": p.plain_lru,
            "tail_first_lru": p.tail_first_lru,
            "min": p.min,
        }
        for p in points
    ]
    print()
    print(
        f"  {'sweep: prefix hit ratio':<24}" + "".join(f"{p.tokens / 1e6:>9.2f}M" for p in points)
    )
    rows = [*(f"pool({policy})" for policy in POLICIES), "plain LRU", "tail-first LRU", "MIN"]
    for label in rows:
        values = [
            {"plain LRU": p.plain_lru, "tail-first LRU": p.tail_first_lru, "MIN": p.min}.get(
                label, p.pool.get(label[5:-1], 0)
            )
            for p in points
        ]
        print(f"  {label:<24}" + "".join(f"{v / requested:>10.2%}" for v in values))
    if args.plot:
        title = f"Prefix hit ratio, {name}, {len(requests):,} requests"
        plot(args.plot, title, points, requested, infinite / requested)
        out["plot"] = args.plot
    mine = [p.pool[DEFAULT_POLICY] for p in points]
    return {
        "sweep_vs_tail_first": (
            f"at every swept size, pool({DEFAULT_POLICY}) alone >= tail-first LRU",
            all(m >= p.tail_first_lru for m, p in zip(mine, points, strict=True)),
        ),
        "sweep_vs_lru": (
            f"at every swept size, pool({DEFAULT_POLICY}) alone >= plain LRU",
            all(m >= p.plain_lru for m, p in zip(mine, points, strict=True)),
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
