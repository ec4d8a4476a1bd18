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
clock; the bring-back itself is modelled here as ``kvtier``'s prefetch does it: head first,
hits pinned and tier blocks promoted while the bring-backs' share of the pool has room,
through the tier's one pipeline of transfers (latency plus bytes at its bandwidth), at most
``max_running`` promoting at once, and what was not claimed is demoted when it is let go.
A returning turn waits for its blocks still in flight, then loads what is still missing.
The pool is the real ``SlotTable`` with the default LRU policy.

Reported per lower tier, over the returning turns (every turn but a session's first):

- the load time they wait on the request path without hints and with them, and the
  **hidden fraction** (1 - with / without);
- the **waste**: bytes bring-backs promoted that their turn did not claim in time (the plan
  went stale or the session ended first, or the blocks were evicted before the turn came),
  over all bytes bring-backs promoted;
- the pool **hit ratio at each turn's arrival** (blocks in the pool, landed, at the prefix
  of the prompt, over the blocks requested), without hints, with them, and the ceiling: a
  pool large enough for every block of every session.

Each tier is replayed twice with hints: ``predicted`` (the engine does not say when a session
comes back: the table predicts it from the gaps it has seen) and ``return_hinted`` (the
engine passes ``expect_back_in``, here the trace's own next gap: an engine that knows when a
tool call returns).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier import SessionSettings
from kvtier.pools._policy import LRUPolicy
from kvtier.pools._slots import SlotTable
from kvtier.scheduler._sessions import Plan, SessionTable, promotion_lead

BLOCK_TOKENS = 512
DEFAULT_TIERS = ("fs:0.5:3000", "s3:40:600")
"""``name:latency_ms:MB_per_s``: a local NVMe file tier, and an object store."""


@dataclass(frozen=True, slots=True)
class TierModel:
    """A lower tier's time model: a fixed latency, then bytes at a bandwidth."""

    name: str
    latency: float
    bytes_per_second: float

    @classmethod
    def parse(cls, text: str) -> TierModel:
        try:
            name, latency_ms, mb_s = text.split(":")
            model = cls(name, float(latency_ms) / 1e3, float(mb_s) * 1e6)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a tier model is name:latency_ms:MB_per_s"
            ) from None
        if model.latency < 0 or model.bytes_per_second <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: latency >= 0, bandwidth > 0")
        return model

    def load_seconds(self, blocks: int, block_bytes: int) -> float:
        return 0.0 if blocks <= 0 else self.latency + blocks * block_bytes / self.bytes_per_second


@dataclass(frozen=True, slots=True)
class Turn:
    at: float
    session: int
    keys: list[bytes]
    full: int  # the prompt's full blocks: what its next turn starts with
    last: bool  # the session's last turn
    back_in: float | None  # seconds until the session's next turn (None after its last)


def turns_of(rows: Sequence[dict[str, Any]], requests: Sequence[list[bytes]]) -> list[Turn]:
    """The trace's rows as turns (rows in timestamp order, each with its keys)."""
    last_row = {row["session"]: i for i, row in enumerate(rows)}
    next_at: dict[int, float] = {}
    back_in: list[float | None] = [None] * len(rows)
    for i in range(len(rows) - 1, -1, -1):
        at = rows[i]["timestamp"] / 1e3
        later = next_at.get(rows[i]["session"])
        back_in[i] = None if later is None else later - at
        next_at[rows[i]["session"]] = at
    return [
        Turn(
            row["timestamp"] / 1e3,
            row["session"],
            keys,
            row["input_length"] // BLOCK_TOKENS,
            last_row[row["session"]] == i,
            back_in[i],
        )
        for i, (row, keys) in enumerate(zip(rows, requests, strict=True))
    ]


@dataclass(slots=True)
class _BringBack:
    plan: Plan
    next: int = 0  # the next key its scan looks at
    slots: list[int] = field(default_factory=list)  # pinned
    promoted: list[bytes] = field(default_factory=list)
    done_at: float = 0.0  # its last promotion lands
    capped: bool = False


@dataclass(slots=True)
class RunFigures:
    """One replay: per returning turn, what it found and what it waited for."""

    requested: int = 0
    hits: int = 0  # landed pool hits at arrival, returning turns
    loads: list[int] = field(default_factory=list)  # blocks loaded on the request path
    in_flight_wait: list[float] = field(default_factory=list)
    promoted: int = 0  # blocks bring-backs promoted
    wasted: int = 0
    bring_backs: int = 0
    stale: int = 0

    def wait(self, tier: TierModel, block_bytes: int) -> list[float]:
        """Seconds each returning turn waited on the request path."""
        return [
            max(w, 0.0) + tier.load_seconds(n, block_bytes)
            for n, w in zip(self.loads, self.in_flight_wait, strict=True)
        ]


class Replay:
    """The pool, the lower tier's contents and (with hints) the session table, on the trace's
    clock."""

    def __init__(
        self,
        capacity: int,
        block_bytes: int,
        tier: TierModel | None,
        settings: SessionSettings | None,
        exact: bool = False,
    ) -> None:
        self.exact = exact  # the engine says when each session comes back
        self.table = SlotTable(capacity, LRUPolicy(capacity))
        self.block_bytes = block_bytes
        self.tier = tier
        self.settings = settings
        self.sessions = None if settings is None else SessionTable(settings)
        self.limit = 0 if settings is None else int(capacity * settings.share)
        self.stored: set[bytes] = set()
        self.lands: dict[bytes, float] = {}
        self.live: dict[Plan, _BringBack] = {}
        self.tier_free_at = 0.0
        self.now = 0.0
        self.figures = RunFigures()

    # -- bring-backs (as a prefetch does them) -------------------------------------------------

    def held(self) -> int:
        return sum(len(b.slots) for b in self.live.values())

    def _scan(self, bring: _BringBack, now: float) -> None:
        """Go on with ``bring``'s scan: pin hits and promote tier blocks while the share has
        room, up to the first block no tier holds."""
        assert self.tier is not None
        table, keys = self.table, bring.plan.keys
        per_block = self.block_bytes / self.tier.bytes_per_second
        bring.capped = False
        while bring.next < len(keys):
            key = keys[bring.next]
            room = self.held() < self.limit
            if key in table.ready:
                if room:
                    slot = table.pin(key)
                    assert slot is not None
                    bring.slots.append(slot)
                else:
                    table.policy.touch(key)
            elif key in self.stored and key not in table.held:
                if not room:
                    bring.capped = True
                    return
                slot = table.try_reserve(key)
                if slot is None:
                    return
                table.commit(slot)
                table.pin(key)
                bring.slots.append(slot)
                self.tier_free_at = max(self.tier_free_at, now) + per_block
                self.lands[key] = bring.done_at = self.tier_free_at + self.tier.latency
                bring.promoted.append(key)
                self.figures.promoted += 1
            else:
                return
            bring.next += 1

    def _start(self, plan: Plan, now: float) -> None:
        bring = self.live[plan] = _BringBack(plan, done_at=now)
        self.figures.bring_backs += 1
        self._scan(bring, now)

    def _let_go(self, plan: Plan, now: float, *, claimed: bool) -> None:
        bring = self.live.pop(plan, None)
        if bring is None:
            return
        for slot in bring.slots:
            self.table.unpin(slot)
        if not claimed:
            self.figures.wasted += len(bring.promoted)
            self.table.demote(bring.promoted)
        else:  # claimed, but what was evicted meanwhile came too late
            ready = self.table.ready
            self.figures.wasted += sum(1 for k in bring.promoted if k not in ready)
        for other in [b for b in self.live.values() if b.capped]:
            self._scan(other, now)  # the share has room again

    def advance(self, until: float) -> None:
        """Act on everything the session table says up to ``until``."""
        sessions = self.sessions
        if sessions is None:
            return
        assert self.settings is not None
        while True:
            wake = sessions.next_wake()
            if wake is None or wake > until:
                break
            wake = max(wake, self.now)
            running = [b.done_at for b in self.live.values() if b.done_at > wake]
            if len(running) >= self.settings.max_running:  # a due start waits for room
                wake = min([min(running), *(p.stale_at for p in sessions.plans)])
                if wake > until:
                    break
            self._act(wake)
        self._act(until)

    def _act(self, now: float) -> None:
        self.now = now = max(now, self.now)
        sessions = self.sessions
        assert sessions is not None and self.settings is not None
        for plan in sessions.expire(now):
            self.figures.stale += 1
            self._let_go(plan, now, claimed=False)
        running = sum(1 for b in self.live.values() if b.done_at > now)
        for plan in sessions.due(now, self.settings.max_running - running):
            self._start(plan, now)

    # -- the engine's side ---------------------------------------------------------------------

    def turn(self, turn: Turn, returning: bool) -> None:
        now, keys = turn.at, turn.keys
        self.advance(now)
        claimed: list[Plan] = []
        if self.sessions is not None:
            claimed = self.sessions.arrived(keys, now)
        table, lands = self.table, self.lands
        prefix = landed = 0
        wait = 0.0
        for key in keys:
            if key not in table.ready:
                break
            prefix += 1
            ready_at = lands.get(key, 0.0)
            if ready_at > now:
                wait = max(wait, ready_at - now)
            elif landed == prefix - 1:
                landed += 1
        loads = 0
        for key in keys[prefix:]:
            if key not in self.stored:
                break
            loads += 1
        if returning:
            figures = self.figures
            figures.requested += len(keys)
            figures.hits += landed
            figures.loads.append(loads)
            figures.in_flight_wait.append(wait)
        for plan in claimed:
            self._let_go(plan, now, claimed=True)
        table.ready_prefix(keys)
        positions, slots, _ = table.reserve_new(keys)
        for slot in slots:
            table.commit(slot)
        table.place_chain([keys[i] for i in positions])
        self.stored.update(keys)
        if self.sessions is not None:
            if turn.last:
                ended = self.sessions.end(turn.session)
                if ended is not None:
                    self._let_go(ended, now, claimed=False)
            else:
                blocks = turn.full
                assert self.tier is not None and self.settings is not None
                per_block = self.block_bytes / self.tier.bytes_per_second
                lead = promotion_lead(
                    blocks, self.tier.latency + per_block, per_block, self.settings.lead_margin
                )
                assert lead is not None
                back_in = turn.back_in if self.exact else None
                for plan in self.sessions.turn_done(
                    turn.session, keys[:blocks], now, lead=lead, expect_back_in=back_in
                ):
                    self._let_go(plan, now, claimed=False)


def replay(
    turns: Sequence[Turn],
    capacity: int,
    block_bytes: int,
    tier: TierModel | None = None,
    settings: SessionSettings | None = None,
    exact: bool = False,
) -> RunFigures:
    """Replay ``turns`` through a pool of ``capacity`` blocks; with ``settings`` (and a
    ``tier``), with session hints."""
    run = Replay(capacity, block_bytes, tier, settings, exact)
    seen: set[int] = set()
    for turn in turns:
        run.turn(turn, turn.session in seen)
        seen.add(turn.session)
    return run.figures


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


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
        f"  {'tier, return time':<22}{'without (s)':>12}{'with (s)':>11}{'hidden':>9}{'waste':>8}"
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
        for mode, exact in (("predicted", False), ("return_hinted", True)):
            hinted = replay(turns, capacity, block_bytes, tier, settings, exact)
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
                "checks": {
                    "hidden_at_least_90pct": hidden >= 0.9,
                    "waste_at_most_10pct": waste <= 0.1,
                    "hit_ratio_within_2_points_of_ceiling": ratio_with >= ratio_ceiling - 0.02,
                },
            }
            print(
                f"  {tier.name + ', ' + mode:<22}{total_without:>12,.1f}{total_with:>11,.1f}"
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
