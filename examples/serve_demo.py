"""An asyncio serving loop that embeds kvtier the way a real engine does.

The engine (``demo_engine.py``) is a small causal transformer on the CPU with a real KV cache.
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
per operation (``demo_engine.DelayedTier``) to show that guarantee; ``--no-recompute-cost``
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

``--workload agent`` runs agent sessions with tool-call gaps instead, without kvtier, without
and with session hints, and at the ceiling (``agent_demo.py``).

``--s3-endpoint URL`` adds an S3 tier (bucket ``--s3-bucket``, credentials from the environment);
``nox -s demo -- --s3`` starts a SeaweedFS on 127.0.0.1 and passes it. ``--json`` prints one
JSON object instead of the table: the settings, each run's figures, the speedup against the run
without kvtier, what each tier did, and the correctness check.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import agent_demo
import demo_engine as demo
from demo_engine import ModelConfig, RunResult, percentile

import kvtier

# -- report ------------------------------------------------------------------------------------


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
    out: dict[str, Any],
    waits_cut: int = 0,
) -> bool:
    """Print the table and put its figures in ``out``; return False when the correctness
    check failed."""
    print()
    print(
        f"{'':16}{'requests':>9}{'TTFT p50':>11}{'TTFT p95':>11}{'prefill tokens':>16}{'wall':>9}"
    )
    out["runs"] = {}
    for run in runs:
        tt = run.ttfts()
        prefilled = sum(
            r.prompt_tokens - r.loaded_blocks * config.block_size for r in run.results.values()
        )
        lag = run.loop_lag
        lookups = [r.lookup_seconds for r in run.results.values()]
        out["runs"][run.label] = {
            "requests": len(tt),
            "ttft_p50_s": percentile(tt, 50),
            "ttft_p95_s": percentile(tt, 95),
            "lookup_wait_p50_s": percentile(lookups, 50),
            "lookup_wait_mean_s": sum(lookups) / len(lookups) if lookups else 0.0,
            "prefill_tokens": prefilled,
            "wall_s": run.wall,
            "loop_lag_ms": {
                "p50": percentile(lag, 50) * 1e3,
                "p99": percentile(lag, 99) * 1e3,
                "max": max(lag, default=0.0) * 1e3,
            },
        }
        if run.stalls is not None:
            out["runs"][run.label]["stalls"] = run.stalls
        print(
            f"{run.label:16}{len(tt):>9}{percentile(tt, 50):>9.3f} s{percentile(tt, 95):>9.3f} s"
            f"{prefilled:>16,}{run.wall:>7.1f} s"
        )
    by_label = {r.label: r for r in runs}
    base, tiered = by_label.get("without kvtier"), by_label.get("with kvtier")
    if base and tiered:
        b, t = base.ttfts(), tiered.ttfts()
        p50 = percentile(b, 50) / percentile(t, 50)
        p95 = percentile(b, 95) / percentile(t, 95)
        out["speedup"] = {"baseline": "without kvtier", "ttft_p50": p50, "ttft_p95": p95}
        print(f"{'speedup':16}{'':9}{p50:>9.2f} x{p95:>9.2f} x")
    for label, figures in out["runs"].items():
        lag_ms = figures["loop_lag_ms"]
        print(
            f"loop lag         {label}: p50 {lag_ms['p50']:.1f} ms, p99 {lag_ms['p99']:.1f} ms, "
            f"max {lag_ms['max']:.1f} ms (how late a 5 ms timer fired)"
        )
        for culprit in figures.get("stalls", {}).get("culprits", []):
            print(
                f"  stalled {culprit['count']:>4} x, longest {culprit['longest_ms']:6.1f} ms, "
                f"in {culprit['where']}"
            )
    if tiered is None or stats is None:
        return True
    results = tiered.results.values()
    bb = config.block_bytes
    requested = sum((r.prompt_tokens - 1) // config.block_size for r in results)
    loaded = sum(r.loaded_blocks for r in results)
    resident = sum(r.resident_blocks for r in results)
    # Promotions can outnumber the blocks they served (a prefetch that expired, a block evicted
    # before its lookup): the blocks served beyond the resident ones are put down to the tiers
    # up to what they promoted, and the rest to blocks other requests stored meanwhile, so the
    # parts add up to the blocks served.
    from_tiers = min(loaded - resident, sum(tier.loads for tier in stats.tiers))
    other = loaded - resident - from_tiers
    load_s = sum(r.load_seconds for r in results)
    store_s = sum(r.store_seconds for r in results)
    stored = sum(r.stored_blocks for r in results)
    out["tiers"] = ["host pool", *tier_names]
    out["blocks"] = {
        "block_bytes": bb,
        "loadable": requested,
        "served": loaded,
        "resident": resident,
        "promoted": {tier.name: tier.loads for tier in stats.tiers},
        "from_tiers": from_tiers,
        "meanwhile": other,
        "stored": stored,
        "load_s": load_s,
        "store_s": store_s,
    }
    print()
    print(
        f"blocks served    {loaded:,} of {requested:,} loadable prefix blocks "
        f"({loaded / max(requested, 1):.0%}), {bb // 1024} KiB each"
    )
    print(f"  primary        {resident:,} already resident in the host pool")
    names = "/".join(tier.name for tier in stats.tiers)
    promotions = ", ".join(f"{tier.name} {tier.loads:,}" for tier in stats.tiers)
    print(
        f"  {names:<14} {from_tiers:,} promoted into the pool from the tiers, by a prefetch "
        f"or the lookup ({promotions} promotions in all, unserved ones included)"
    )
    for tier in stats.tiers:
        if isinstance(tier, kvtier.S3TierStatistics):
            print(
                f"  {tier.name:<14} {tier.request_path_requests:,} requests on the request path "
                f"for keys its index did not hold ({tier.lookup_mode} mode, "
                f"{tier.index_keys:,} keys indexed; {tier.index_load_requests:,} while it "
                "loaded)"
            )
    if other > 0:
        print(f"  {'meanwhile':<14} {other:,} stored by concurrent requests during the lookup")
    print(
        f"bytes moved      into the engine {_mb(loaded * bb)} ({_rate(loaded * bb, load_s)} "
        f"within load calls), out of it {_mb(stored * bb)} ({_rate(stored * bb, store_s)} "
        "within store calls)"
    )
    out["tier_io"] = {}
    for tier in stats.tiers:
        moved = tier.bytes_read + tier.bytes_written
        out["tier_io"][tier.name] = {
            "loads": tier.loads,
            "stores": tier.stores,
            "bytes_read": tier.bytes_read,
            "bytes_written": tier.bytes_written,
            "read_s": tier.read_seconds,
            "write_s": tier.write_seconds,
            "evictions": tier.evictions,
        }
        if isinstance(tier, kvtier.S3TierStatistics):
            out["tier_io"][tier.name].update(
                request_path_requests=tier.request_path_requests,
                index_load_requests=tier.index_load_requests,
                lookup_mode=tier.lookup_mode,
                index_keys=tier.index_keys,
            )
        print(
            f"  {tier.name:<14} read {_mb(tier.bytes_read)} "
            f"({_per_op(tier.read_seconds, tier.loads)}), written {_mb(tier.bytes_written)} "
            f"({_per_op(tier.write_seconds, tier.stores)}): {_rate(moved, tiered.wall)} "
            f"over the run; {tier.evictions:,} evictions"
        )
    failed = sum(stats.promotions.failed_by_reason.values())
    out["pool"] = {
        "blocks": stats.pool.num_blocks,
        "policy": stats.pool.policy,
        "evictions": stats.pool.evictions,
        "promotions_ok": stats.promotions.succeeded,
        "promotions_failed": failed,
    }
    print(
        f"  pool           {stats.pool.num_blocks:,} blocks ({stats.pool.policy}), "
        f"evictions {stats.pool.evictions:,}, promotions {stats.promotions.succeeded:,} ok / "
        f"{failed:,} failed"
    )
    print(f"tiers            {', '.join(out['tiers'])}")
    dropped = {a.name: a.dropped for a in stats.admission if a.dropped}
    out["write_through"] = {
        "started": stats.writes.started,
        "skipped": stats.writes.skipped,
        "dropped": stats.writes.dropped,
        "dropped_by_tier": dropped,
        "written_back": stats.writes.written_back,
        "promoted_written_up": stats.promotions.written_up,
    }
    print(
        f"write-through    {stats.writes.started:,} started, {stats.writes.skipped:,} "
        f"skipped (in-flight limit), {stats.writes.dropped:,} dropped by tier admission"
        + (f" {dropped}" if dropped else "")
        + (f", {stats.writes.written_back:,} written back" if stats.writes.written_back else "")
        + (
            f", {stats.promotions.written_up:,} promoted blocks copied to faster tiers"
            if stats.promotions.written_up
            else ""
        )
    )
    c = stats.cost
    per_block = c.recompute_seconds_per_block
    latencies = {t.name: t.latency_seconds for t in c.tiers if t.latency_seconds}
    out["cost_model"] = {
        "recompute_s_per_block": per_block,
        "promotion_latency_s": latencies,
        "promotions_declined": stats.promotions.declined,
        "promotions_deferred": stats.promotions.deferred,
        "waits_cut": waits_cut,
    }
    estimates = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in latencies.items())
    print(
        "cost model       recompute "
        + ("not given" if per_block is None else f"{per_block * 1e3:.2f} ms/block")
        + f"; promotion {estimates or 'not measured'}; {stats.promotions.declined:,} "
        f"promotions declined (slower than recompute), {stats.promotions.deferred:,} deferred "
        f"(lazy), {waits_cut:,} lookups stopped waiting (recompute was cheaper)"
    )
    if base is None:
        return True
    diffs = []
    for r in results:
        reference = base.results[r.rid].logits
        if r.loaded_blocks and r.logits is not None and reference is not None:
            diffs.append(float((r.logits - reference).abs().max()))
    out["correctness"] = check = demo.logits_check(diffs)
    if not diffs:
        print("correctness      no request loaded any block: nothing to compare")
        return True
    worst, ok = check["max_abs_diff"], check["ok"]
    print(
        f"correctness      {'OK' if ok else 'FAIL'}: next-token logits from loaded KV vs full "
        f"recompute, max abs diff {worst:.2e} over {len(diffs)} requests "
        f"(tolerance {demo.TOLERANCE:.0e})"
    )
    return ok


# -- main --------------------------------------------------------------------------------------


SETTINGS = (
    *("quick", "requests", "sessions", "concurrency", "pool_blocks", "policy", "no_prefetch"),
    *("fs_capacity_mb", "fsync", "s3_endpoint", "s3_bucket", "s3_prefix"),
    *("system_tokens", "decode_tokens", "seed", "slow_tier", "no_recompute_cost"),
    *("write_back", "defer", "s3_write_rate", "s3_write_through", "no_promote_write_up"),
    *("workload", "predict_returns", "repeat"),
)
"""The options the JSON output states the run was asked for."""


async def amain(args: argparse.Namespace, out: dict[str, Any]) -> int:
    out["settings"] = demo.settings(args, SETTINGS)
    if args.workload == "agent":
        return await agent_demo.amain(args, out)
    engine, sessions = await demo.start_engine(args)
    config = engine.config
    gc.freeze()  # what docs/operating.md advises an engine once it has started
    runs = [
        await demo.run_workload(
            "without kvtier", engine, sessions, None, args.decode_tokens, stalls=args.stalls
        )
    ]
    if args.no_kvtier:
        report(runs, None, config, [], out)
        return 0
    async with AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-"))
        tiers = demo.make_tiers(args, tmp)
        pool = kvtier.HostPool(args.pool_blocks, config.block_bytes, policy=args.policy)
        latency = kvtier.LatencyHistograms()
        manager = await stack.enter_async_context(demo.make_manager(args, pool, tiers, latency))
        scheduler = kvtier.OffloadScheduler(manager, latency=latency)
        if args.metrics_port is not None:
            server = await stack.enter_async_context(
                kvtier.serve_metrics(
                    manager, args.metrics_port, scheduler=scheduler, latency=latency
                )
            )
            out["metrics_url"] = server.url
            print(f"metrics: {server.url}", flush=True)
        tiering = demo.KVTier(
            manager,
            scheduler,
            report_recompute=not args.no_recompute_cost,
            prefetch=not args.no_prefetch,
        )
        runs.append(
            await demo.run_workload(
                "with kvtier", engine, sessions, tiering, args.decode_tokens, stalls=args.stalls
            )
        )
        stats = manager.statistics()
    names = [t.name for t in tiers]
    ok = report(runs, stats, config, names, out, scheduler.statistics().waits_cut)
    prefetch = scheduler.statistics().prefetch
    if prefetch is not None and prefetch.started:
        out["prefetch"] = {
            "started": prefetch.started,
            "blocks_prefetched": prefetch.blocks_prefetched,
            "blocks_claimed": prefetch.blocks_claimed,
            "blocks_expired": prefetch.blocks_expired,
            "cancelled": prefetch.cancelled,
            "bytes_prefetched": prefetch.bytes_prefetched,
            "capped": prefetch.capped,
        }
        print(
            f"prefetch         {prefetch.started:,} queued requests prefetched: "
            f"{prefetch.blocks_prefetched:,} blocks promoted while they waited, "
            f"{prefetch.blocks_claimed:,} claimed by their lookup, "
            f"{prefetch.blocks_expired:,} expired unclaimed"
        )
    closed = manager.statistics()  # deferred writes get kvtier's close_timeout at close
    out["deferred"] = {
        "kept": closed.writes.deferred,
        "written": closed.writes.deferred_written,
        "given_up": closed.writes.deferred_lost,
    }
    if closed.writes.deferred:
        print(
            f"deferred         {closed.writes.deferred:,} writes dropped by back-pressure were "
            f"kept: {closed.writes.deferred_written:,} written from a faster tier by the time "
            f"kvtier closed, {closed.writes.deferred_lost:,} given up"
        )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = demo.parse_args(argv, description=__doc__.split("\n\n")[0] if __doc__ else None)
    with demo.json_report(args.json) as out:
        return asyncio.run(amain(args, out))


if __name__ == "__main__":
    sys.exit(main())
