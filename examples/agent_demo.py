"""``serve_demo.py --workload agent``: agent sessions whose turns come back after tool calls,
served without kvtier, with kvtier and no session hints, with hints, and with a pool large
enough for every session (the ceiling), one run after the other in one process.

The workload: a few long agent sessions, each a lead agent or one of its sub-agents (the
sub-agents of one lead share its system prompt). Every turn's prompt is the previous prompt,
the (scripted) answer and a tool's output; between two turns the session waits for its tool
call, a gap drawn evenly on a log scale (short, so the run takes a minute or two). The host
pool holds about half of what the sessions touch, so between two turns of a session the
others evict part of its context, and its next turn finds it in the file tier (or S3).

With hints the serving loop calls what an engine adds: ``scheduler.session(id)``, then
``turn_done(keys, expect_back_in=gap)`` when a turn has answered (the keys of its prompt: the
next prompt starts with them; the agent framework knows roughly when its tool call returns),
and ``end()`` after the session's last turn. ``--predict-returns`` leaves out
``expect_back_in``: kvtier then predicts each return from the gaps it has seen.

Reported per run: TTFT over the returning turns (every turn but a session's first), p50 and
p95, and the speedup of each against the run without kvtier; the correctness check is the
default demo's (next-token logits from loaded KV against full recompute), over every run
with kvtier. With ``--repeat N`` the four runs are made N times (the kvtier setups in a
rotating order, each from empty tiers) and each figure is taken over the turns of all N: on
a small shared machine one run's p50 moves by tens of percent with what else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import demo_engine as demo
import numpy as np
import torch
from demo_engine import Engine, ModelConfig, Request, RunResult, percentile

import kvtier

WITHOUT, NO_HINTS, HINTS, CEILING = "without kvtier", "without hints", "with hints", "ceiling"
POOL_SHARE = 0.5
"""The host pool's size, as a share of the blocks the sessions touch: too small for all."""
BRING_BACK_SHARE = 0.5
"""The share of the pool bring-backs may hold here (``SessionSettings.share``): with a pool
this small, the default quarter holds less than one session's context."""
SUB_AGENTS = 3
"""Sessions per system prompt: a lead agent and its sub-agents."""


@dataclass(frozen=True, slots=True)
class AgentTurn:
    request: Request
    gap: float  # seconds the session waits for its tool call before its next turn


def agent_sessions(
    args: argparse.Namespace, config: ModelConfig
) -> tuple[list[list[AgentTurn]], int]:
    """The sessions (``args.requests`` turns in all) and the longest prompt in tokens."""
    rng = np.random.default_rng(args.seed)
    vocab = config.vocab_size
    groups = math.ceil(args.sessions / SUB_AGENTS)
    systems = [rng.integers(0, vocab, args.system_tokens) for _ in range(groups)]
    low, high = (math.log(g) for g in args.gap_seconds)
    sessions: list[list[AgentTurn]] = []
    rid = 0
    for s in range(args.sessions):
        turns = args.requests // args.sessions + (1 if s < args.requests % args.sessions else 0)
        history = systems[s // SUB_AGENTS]
        chat: list[AgentTurn] = []
        for t in range(turns):
            if t:  # the answer to the previous turn, then the tool's output
                answer = rng.integers(0, vocab, rng.integers(*args.answer_tokens))
                history = np.concatenate([history, answer])
            tool = rng.integers(0, vocab, rng.integers(*args.turn_tokens))
            history = np.concatenate([history, tool])
            request = Request(rid, s, t, torch.from_numpy(history.astype(np.int64)))
            chat.append(AgentTurn(request, math.exp(rng.uniform(low, high))))
            rid += 1
        sessions.append(chat)
    longest = max(turn.request.tokens.shape[0] for chat in sessions for turn in chat)
    return sessions, longest


def touched_blocks(sessions: Sequence[Sequence[AgentTurn]], config: ModelConfig) -> int:
    """Distinct blocks of all sessions' last prompts (shared system prompts once)."""
    keys: set[bytes] = set()
    for chat in sessions:
        if chat:
            tokens = chat[-1].request.tokens
            keys.update(kvtier.block_keys(tokens, config.block_size, namespace=config.namespace))
    return len(keys)


async def run_agents(
    label: str,
    engine: Engine,
    sessions: Sequence[Sequence[AgentTurn]],
    tiering: demo.KVTier | None,
    args: argparse.Namespace,
    hints: bool,
) -> RunResult:
    """Every session's turns, each after its tool call's gap; with ``hints``, the session's
    ``turn_done`` and ``end`` calls."""
    run = RunResult(label, 0.0)
    progress = demo.Progress(label, sum(len(s) for s in sessions), engine.config.block_size)
    config = engine.config
    started = time.perf_counter()

    async def agent(turns: Sequence[AgentTurn]) -> None:
        hinted = None
        if hints and tiering is not None and turns:
            hinted = tiering.scheduler.session(("agent", turns[0].request.session))
        try:
            for i, turn in enumerate(turns):
                request = turn.request
                run.results[request.rid] = await demo.serve(
                    engine, request, tiering, args.decode_tokens
                )
                progress.update(run)
                if i + 1 == len(turns):
                    break
                if hinted is not None:  # the next prompt starts with this one
                    keys = kvtier.block_keys(
                        request.tokens, config.block_size, namespace=config.namespace
                    )
                    back_in = None if args.predict_returns else turn.gap
                    hinted.turn_done(keys, expect_back_in=back_in)
                await asyncio.sleep(turn.gap)  # the tool call
        finally:
            if hinted is not None:
                hinted.end()

    try:
        async with asyncio.TaskGroup() as tg:
            for turns in sessions:
                tg.create_task(agent(turns))
    finally:
        progress.close()
    run.wall = time.perf_counter() - started
    return run


async def kvtier_run(
    label: str,
    engine: Engine,
    sessions: Sequence[Sequence[AgentTurn]],
    args: argparse.Namespace,
    pool_blocks: int,
    hints: bool,
    repeat: int,
) -> tuple[RunResult, kvtier.SchedulerStatistics, dict[str, int]]:
    """One run with kvtier, from empty tiers of its own (its own S3 prefix and folder for
    each label and repeat); with the scheduler's statistics and the manager's misses by
    reason."""
    config = engine.config
    own = argparse.Namespace(**vars(args))
    place = f"{label.replace(' ', '-')}-{repeat}"
    own.s3_prefix = f"{args.s3_prefix}{place}/"
    own.fs_root = None if args.fs_root is None else f"{args.fs_root}/{place}"
    async with AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-agents-"))
        tiers = demo.make_tiers(own, tmp)
        pool = kvtier.HostPool(pool_blocks, config.block_bytes, policy=args.policy)
        latency = kvtier.LatencyHistograms()
        manager = await stack.enter_async_context(demo.make_manager(own, pool, tiers, latency))
        scheduler = kvtier.OffloadScheduler(
            manager, latency=latency, sessions=kvtier.SessionSettings(share=BRING_BACK_SHARE)
        )
        tiering = demo.KVTier(
            manager,
            scheduler,
            report_recompute=not args.no_recompute_cost,
            prefetch=not args.no_prefetch,
        )
        run = await run_agents(label, engine, sessions, tiering, args, hints)
        misses = dict(manager.statistics().lookups.misses_by_reason)
        return run, scheduler.statistics(), misses


def figures(
    run: RunResult, base: RunResult | None, config: ModelConfig, firsts: set[int]
) -> dict[str, Any]:
    """One run's figures for the report: TTFTs (all turns, and the returning turns: not in
    ``firsts``), prefill, and the correctness check against ``base``."""
    returning = [r.ttft for rid, r in run.results.items() if rid not in firsts]
    ttfts = run.ttfts()
    prefilled = sum(
        r.prompt_tokens - r.loaded_blocks * config.block_size for r in run.results.values()
    )
    out: dict[str, Any] = {
        "requests": len(ttfts),
        "returning_turns": len(returning),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "returning_ttft_p50_s": percentile(returning, 50),
        "returning_ttft_p95_s": percentile(returning, 95),
        "prefill_tokens": prefilled,
        "blocks_loaded": sum(r.loaded_blocks for r in run.results.values()),
        "lookup_wait_mean_s": (
            sum(r.lookup_seconds for r in run.results.values()) / max(len(ttfts), 1)
        ),
        "wall_s": run.wall,
    }
    if base is not None:
        diffs = [
            float((r.logits - base.results[rid].logits).abs().max())
            for rid, r in run.results.items()
            if r.loaded_blocks and r.logits is not None and base.results[rid].logits is not None
        ]
        out["correctness"] = demo.logits_check(diffs)
    return out


async def start_engine(
    args: argparse.Namespace,
) -> tuple[Engine, list[list[AgentTurn]], int]:
    """The model, the agent sessions, a warmed-up engine sized for their longest prompt."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    config = ModelConfig(seed=args.seed)
    model = demo.TinyTransformer(config)
    sessions, longest = agent_sessions(args, config)
    bs = config.block_size
    max_len = math.ceil((longest + args.decode_tokens) / bs) * bs
    if max_len > config.max_len:
        raise SystemExit(f"prompts reach {longest} tokens; the model takes {config.max_len}")
    engine = Engine(model, args.concurrency, max_len)
    warm = sessions[0][0].request.tokens[:512]
    await engine.run(model.forward_tokens, warm, demo.KVCache(config, 512))
    return engine, sessions, longest


async def amain(args: argparse.Namespace, out: dict[str, Any]) -> int:
    """The four runs, the report; 1 when the correctness check failed."""
    engine, sessions, longest = await start_engine(args)
    config = engine.config
    first_turns = {chat[0].request.rid for chat in sessions if chat}
    touched = touched_blocks(sessions, config)
    pool_blocks = args.pool_blocks or max(int(touched * POOL_SHARE), 1)
    ceiling_blocks = touched + args.concurrency * 8  # every session, and room to spare
    print(
        f"agents: {args.sessions} sessions ({SUB_AGENTS} per system prompt), {args.requests} "
        f"turns, prompts up to {longest} tokens, tool calls {args.gap_seconds[0]:g}-"
        f"{args.gap_seconds[1]:g} s; {touched} blocks touched, pool {pool_blocks} blocks "
        f"(ceiling {ceiling_blocks}); returns "
        + ("predicted" if args.predict_returns else "hinted (expect_back_in)"),
        flush=True,
    )
    setups = [
        (NO_HINTS, pool_blocks, False),
        (HINTS, pool_blocks, True),
        (CEILING, ceiling_blocks, False),
    ]
    merged = {label: RunResult(label, 0.0) for label in (WITHOUT, *(s[0] for s in setups))}
    per_repeat: dict[str, list[float]] = {label: [] for label in merged}
    session_stats: list[kvtier.SessionStatistics] = []
    misses_by_run: dict[str, Counter[str]] = {label: Counter() for label, _, _ in setups}
    firsts: set[int] = set()
    for repeat in range(args.repeat):
        # Each repeat runs the kvtier setups in another order, so that a machine that gets
        # busier or quieter through the runs does not favour one setup.
        turn = setups[repeat % len(setups) :] + setups[: repeat % len(setups)]
        runs = [await run_agents(WITHOUT, engine, sessions, None, args, False)]
        for label, blocks, hints in turn:
            run, stats, misses = await kvtier_run(
                label, engine, sessions, args, blocks, hints, repeat
            )
            runs.append(run)
            misses_by_run[label].update(misses)
            if hints and stats.sessions is not None:
                session_stats.append(stats.sessions)
        offset = repeat * args.requests  # request ids of every repeat kept apart
        firsts |= {rid + offset for rid in first_turns}
        for run in runs:
            into = merged[run.label]
            into.results |= {rid + offset: r for rid, r in run.results.items()}
            into.wall += run.wall / args.repeat
            returning = [r.ttft for rid, r in run.results.items() if rid not in first_turns]
            per_repeat[run.label].append(percentile(returning, 50))
    runs = list(merged.values())
    base = runs[0]
    out["workload"] = {
        "kind": "agent",
        "sessions": args.sessions,
        "turns": args.requests,
        "sessions_per_system_prompt": SUB_AGENTS,
        "gap_seconds": list(args.gap_seconds),
        "blocks_touched": touched,
        "pool_blocks": pool_blocks,
        "ceiling_pool_blocks": ceiling_blocks,
        "returns": "predicted" if args.predict_returns else "expect_back_in",
        "tiers": [t for t, on in (("fs", args.fs_capacity_mb > 0), ("s3", args.s3_bucket)) if on],
    }
    out["runs"] = {
        run.label: figures(run, None if run is base else base, config, firsts) for run in runs
    }
    for label, misses in misses_by_run.items():
        out["runs"][label]["misses_by_reason"] = dict(misses)
    if args.repeat > 1:
        for label, p50s in per_repeat.items():
            out["runs"][label]["returning_ttft_p50_s_per_repeat"] = p50s
    base_p50 = out["runs"][WITHOUT]["returning_ttft_p50_s"]
    base_p95 = out["runs"][WITHOUT]["returning_ttft_p95_s"]
    for figure in out["runs"].values():
        figure["returning_speedup_p50"] = base_p50 / figure["returning_ttft_p50_s"]
        figure["returning_speedup_p95"] = base_p95 / figure["returning_ttft_p95_s"]
    if session_stats:
        out["sessions"] = {
            name: sum(getattr(stats, name) for stats in session_stats)
            for name in (
                *("turns", "hinted", "bring_backs", "claimed", "stale", "blocks_promoted"),
                "blocks_claimed",
            )
        }
    diffs = [
        figure["correctness"]["max_abs_diff"]
        for figure in out["runs"].values()
        if "correctness" in figure and figure["correctness"]["compared"]
    ]
    out["correctness"] = check = demo.logits_check(diffs)
    check["compared"] = sum(
        f["correctness"]["compared"] for f in out["runs"].values() if "correctness" in f
    )
    print_report(out)
    return 0 if check["ok"] else 1


def print_report(out: dict[str, Any]) -> None:
    print()
    print(
        f"{'':16}{'returning TTFT p50':>19}{'p95':>10}{'speedup p50':>13}{'p95':>8}"
        f"{'prefill tokens':>16}{'wall':>9}"
    )
    for label, f in out["runs"].items():
        print(
            f"{label:16}{f['returning_ttft_p50_s']:>17.3f} s{f['returning_ttft_p95_s']:>8.3f} s"
            f"{f['returning_speedup_p50']:>11.2f} x{f['returning_speedup_p95']:>6.2f} x"
            f"{f['prefill_tokens']:>16,}{f['wall_s']:>7.1f} s"
        )
    sessions = out.get("sessions")
    if sessions:
        print(
            f"session hints    {sessions['turns']:,} turns done, {sessions['bring_backs']:,} "
            f"bring-backs, {sessions['claimed']:,} claimed by their turn, {sessions['stale']:,} "
            f"stale; {sessions['blocks_promoted']:,} blocks promoted, "
            f"{sessions['blocks_claimed']:,} found by their turn"
        )
    check = out["correctness"]
    print(
        f"correctness      {'OK' if check['ok'] else 'FAIL'}: next-token logits from loaded KV "
        f"vs full recompute, max abs diff {check['max_abs_diff']:.2e} over {check['compared']} "
        f"requests (tolerance {check['tolerance']:.0e})"
    )
