"""A seeded synthetic trace of long agent sessions, in the Mooncake trace's format.

Beside the Mooncake conversation trace (many short, shared prefixes), an agent workload is
a few long chains: each session runs 20-100 turns, each turn's prompt is the previous prompt
plus the previous answer plus 1-4K new tokens (tool results, files read), so contexts grow
past 100K tokens; between turns the agent works for seconds to minutes. Sessions start
spread over the trace and overlap, so a pool a few percent of what they touch cannot keep
every session, and what it evicts decides how much of the next turn's chain is served.

Every row is one request: ``timestamp`` (ms), ``session`` (the replay ignores it),
``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token block,
prefix-chained (a session's prompt keeps its earlier blocks' ids; a partial last block gets a
new id each turn, as its content changes). Sessions share one of a few system prompts (the
agent's instructions and tool definitions).

    python -m benchmarks.agent_trace --out agent.jsonl              # the default workload
    python -m benchmarks.agent_trace --sessions 8 --seed 3 --json   # a summary only
    python -m benchmarks.replay_trace --agent                       # replay it directly
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import add_json_flag, json_output

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """The shape of the generated sessions; every range is inclusive."""

    sessions: int = 48
    seed: int = 0
    turns: tuple[int, int] = (20, 100)
    new_tokens: tuple[int, int] = (1_000, 4_000)
    output_tokens: tuple[int, int] = (100, 1_000)
    gap_seconds: tuple[float, float] = (2.0, 300.0)
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (2_000, 8_000)
    # Sessions start over this span; with the defaults about a dozen run at once.
    arrival_seconds: float = 3_600.0


def generate(workload: AgentWorkload) -> list[dict[str, Any]]:
    """The trace's rows, in timestamp order (deterministic for a given ``workload``)."""
    rng = random.Random(workload.seed)
    next_id = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    systems: list[tuple[int, list[int]]] = []
    for _ in range(workload.system_prompts):
        length = rng.randint(*workload.system_tokens)
        systems.append((length, fresh(length // BLOCK_TOKENS)))
    rows: list[dict[str, Any]] = []
    low, high = (math.log(g) for g in workload.gap_seconds)
    for session in range(workload.sessions):
        now = rng.uniform(0.0, workload.arrival_seconds)
        length, shared = rng.choice(systems)
        full = list(shared)  # the ids of the prompt's full blocks so far
        for _turn in range(rng.randint(*workload.turns)):
            length += rng.randint(*workload.new_tokens)
            blocks = length // BLOCK_TOKENS
            full += fresh(blocks - len(full))
            partial = fresh(1) if length % BLOCK_TOKENS else []
            output = rng.randint(*workload.output_tokens)
            rows.append(
                {
                    "timestamp": round(now * 1000),
                    "session": session,
                    "input_length": length,
                    "output_length": output,
                    "hash_ids": full + partial,
                }
            )
            length += output  # the answer is part of the next turn's prompt
            now += math.exp(rng.uniform(low, high))
    rows.sort(key=lambda row: row["timestamp"])
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sizes of a generated trace: requests, blocks requested and distinct, longest prompt."""
    requested = sum(len(r["hash_ids"]) for r in rows)
    distinct = len({h for r in rows for h in r["hash_ids"]})
    return {
        "requests": len(rows),
        "blocks_requested": requested,
        "blocks_distinct": distinct,
        "longest_prompt_tokens": max((r["input_length"] for r in rows), default=0),
        "span_seconds": (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sessions", type=int, default=AgentWorkload().sessions)
    p.add_argument("--seed", type=int, default=AgentWorkload().seed)
    p.add_argument("--out", type=Path, help="write the trace here (JSONL)")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.sessions <= 0:
        p.error("--sessions must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = generate(AgentWorkload(sessions=args.sessions, seed=args.seed))
    with json_output(args.json) as out:
        if args.out is not None:
            with args.out.open("w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            out["out"] = str(args.out)
        out.update(summary(rows))
        print(
            f"{out['requests']:,} requests, {out['blocks_requested']:,} blocks requested, "
            f"{out['blocks_distinct']:,} distinct, longest prompt "
            f"{out['longest_prompt_tokens']:,} tokens, over {out['span_seconds']:,.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
