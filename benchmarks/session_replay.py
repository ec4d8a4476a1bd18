"""Replay the agent workload's sessions against a time model of each lower tier, without
session hints and with them, and measure what the hints hide.

``python -m benchmarks.replay_trace --agent --session-hints [--tier-model fs:0.5:3000 ...]``

Each turn of the trace arrives at its timestamp and looks up its prompt in a pool of the
replay's size: the leading blocks in the pool are hits; the blocks after them that a lower
tier holds are loaded on the request path, which takes that tier's latency plus their bytes
at its bandwidth; the rest is recomputed; then every block of the prompt is in the pool (and
in the lower tier). A turn runs in no time, so the next turn's gap is the trace's.

With hints, the engine's calls are replayed: ``turn_done`` with the prompt's full blocks
when a turn arrives (its next prompt starts with them; the return time is not given, the
table predicts it), ``end`` after a session's last turn. The very ``SessionTable`` the
scheduler uses decides when each bring-back starts and when it goes stale, on the trace's
clock; the bring-back itself is modelled (``benchmarks.session_model``) as ``kvtier``'s
prefetch does it. A returning turn waits for its blocks still in flight, then loads what is
still missing. The pool is the real ``SlotTable`` with the default LRU policy.

Reported per lower tier, over the returning turns (every turn but a session's first):

- the load time they wait on the request path without hints and with them, and the
  **hidden fraction** (1 - with / without);
- the **waste**: bytes bring-backs promoted that their turn did not claim in time (the plan
  went stale or the session ended first, or the blocks were evicted before the turn came),
  over all bytes bring-backs promoted;
- the pool **hit ratio at each turn's arrival** (blocks in the pool, landed, at the prefix
  of the prompt, over the blocks requested), without hints, with them, and the ceiling: a
  pool large enough for every block of every session; and with predicted returns but
  without retention by session (the private blocks of ended or quiet sessions left to age
  like any other), which shows what retention adds.

Each tier is replayed twice with hints: ``predicted`` (the engine does not say when a session
comes back: the table predicts it from the gaps it has seen) and ``return_hinted`` (the
engine passes ``expect_back_in``, here the trace's own next gap: an engine that knows when a
tool call returns).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.session_model import BLOCK_TOKENS, TierModel, Turn, replay, turns_of
from kvtier import SessionSettings

__all__ = ["DEFAULT_TIERS", "TierModel", "report", "run_sessions"]

DEFAULT_TIERS = ("fs:0.5:3000", "s3:40:600")
"""``name:latency_ms:MB_per_s``: a local NVMe file tier, and an object store."""


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


MODES = (
    ("predicted", False, True),
    ("predicted_no_retention", False, False),
    ("return_hinted", True, True),
)
"""Each hinted replay: its name, whether the engine says when the session returns, and
whether the private blocks of ended and quiet sessions are demoted."""


def _checks(
    hidden: float, waste: float, ratio: float, without: float, ceiling: float
) -> dict[str, bool]:
    """The issue's bars: never worse than no hints; with return times, most of the wait
    hidden, little waste and a hit ratio close to the ceiling."""
    return {
        "hidden_at_least_0": hidden >= 0.0,
        "hit_ratio_at_least_without_hints": ratio >= without,
        "hidden_at_least_90pct": hidden >= 0.9,
        "waste_at_most_10pct": waste <= 0.1,
        "hit_ratio_within_2_points_of_ceiling": ratio >= ceiling - 0.02,
    }


def report(
    turns: Sequence[Turn],
    capacity: int,
    block_bytes: int,
    tiers: Sequence[TierModel],
    settings: SessionSettings,
    out: dict[str, Any],
) -> None:
    """Run the replays, print the report and put its figures in ``out``."""
    distinct = len({k for t in turns for k in t.keys})
    without = replay(turns, capacity, block_bytes)
    ceiling = replay(turns, max(distinct, 1), block_bytes)
    ratio_without = without.hits / max(without.requested, 1)
    ratio_ceiling = ceiling.hits / max(ceiling.requested, 1)
    out["sessions"] = {
        "pool_blocks": capacity,
        "block_bytes": block_bytes,
        "returning_turns": len(without.loads),
        "hit_ratio_ceiling": ratio_ceiling,
        "hit_ratio_without_hints": ratio_without,
        "settings": {"share": settings.share, "max_running": settings.max_running},
        "tiers": {},
    }
    print(
        f"\nsession hints: pool {capacity:,} blocks of {block_bytes / 2**20:g} MiB, "
        f"{len(without.loads):,} returning turns; hit ratio at arrival: ceiling "
        f"{ratio_ceiling:.2%}, without hints {ratio_without:.2%}"
    )
    print(
        f"  {'tier, return time':<30}{'without (s)':>12}{'with (s)':>11}{'hidden':>9}{'waste':>8}"
        f"{'hit ratio with':>16}{'p95 wait w/o':>14}{'with':>8}"
    )
    for tier in tiers:
        figures: dict[str, Any] = {
            "latency_s": tier.latency,
            "bytes_per_second": tier.bytes_per_second,
        }
        out["sessions"]["tiers"][tier.name] = figures
        wait_without = without.wait(tier, block_bytes)
        total_without = sum(wait_without)
        for mode, exact, retention in MODES:
            hinted = replay(turns, capacity, block_bytes, tier, settings, exact, retention)
            wait_with = hinted.wait(tier, block_bytes)
            total_with = sum(wait_with)
            hidden = 1 - total_with / total_without if total_without else 1.0
            waste = hinted.wasted / hinted.promoted if hinted.promoted else 0.0
            ratio_with = hinted.hits / max(hinted.requested, 1)
            figures[mode] = {
                "wait_without_hints_s": total_without,
                "wait_with_hints_s": total_with,
                "hidden_fraction": hidden,
                "returning_wait_p50_s": {
                    "without": _p(wait_without, 50),
                    "with": _p(wait_with, 50),
                },
                "returning_wait_p95_s": {
                    "without": _p(wait_without, 95),
                    "with": _p(wait_with, 95),
                },
                "bytes_promoted": hinted.promoted * block_bytes,
                "bytes_wasted": hinted.wasted * block_bytes,
                "waste": waste,
                "bring_backs": hinted.bring_backs,
                "stale": hinted.stale,
                "hit_ratio_with_hints": ratio_with,
                "checks": _checks(hidden, waste, ratio_with, ratio_without, ratio_ceiling),
            }
            print(
                f"  {tier.name + ', ' + mode:<30}{total_without:>12,.1f}{total_with:>11,.1f}"
                f"{hidden:>9.1%}{waste:>8.1%}{ratio_with:>16.2%}{_p(wait_without, 95):>14.3f}"
                f"{_p(wait_with, 95):>8.3f}"
            )


def run_sessions(
    args: argparse.Namespace,
    name: str,
    rows: list[dict[str, Any]],
    requests: list[list[bytes]],
    out: dict[str, Any],
) -> int:
    """``replay_trace --agent --session-hints``: replay the agent ``rows`` (their keys in
    ``requests``) as ``args`` say, print the report and put its figures in ``out``."""
    turns = turns_of(rows, requests)
    capacity = max(args.primary_tokens // BLOCK_TOKENS, 1)
    print(f"trace {name}: {len(turns):,} turns")
    out["settings"] = {
        "trace": name,
        "requests": len(turns),
        "primary_blocks": capacity,
        "block_tokens": BLOCK_TOKENS,
        "tier_models": [
            f"{t.name}:{t.latency * 1e3:g}:{t.bytes_per_second / 1e6:g}" for t in args.tier_model
        ],
    }
    block_bytes = int(args.block_mib * 2**20)
    report(turns, capacity, block_bytes, args.tier_model, SessionSettings(), out)
    return 0
