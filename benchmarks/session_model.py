"""The session replay's model: a pool (the real ``SlotTable``, default LRU), a lower tier's
time model and, with hints, the very ``SessionTable`` the scheduler uses, all on the trace's
clock. ``benchmarks.session_replay`` runs it and reports.

A bring-back is modelled as ``kvtier``'s prefetch does it (``kvtier.scheduler._prefetch``):
head first, through the tier's one pipeline of transfers (latency plus bytes at its
bandwidth), at most ``max_running`` promoting at once, within the bring-backs' share of the
pool. With ``expect_back_in`` it pins the prefix's hits and evicts for its promotions; as a
guess (a predicted return) it leaves blocks in the pool alone and promotes only into spare
slots (free, or demoted), scanning again when spare slots appear. What a bring-back promoted
and nobody claimed is demoted when it is let go, and the private blocks of sessions the table
retires (ended, quiet) are demoted too (``retention``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier import LRUPolicy, SessionSettings
from kvtier.pools._slots import SlotTable
from kvtier.scheduler._sessions import Plan, SessionTable, promotion_lead

BLOCK_TOKENS = 512


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
        retention: bool = True,
    ) -> None:
        self.exact = exact  # the engine says when each session comes back
        self.retention = retention  # retired sessions' private blocks are demoted
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
        room, up to the first block no tier holds. A guess (no ``expect_back_in``) scans
        from the head each time, leaves the blocks in the pool alone (no pin, no touch) and
        promotes only into spare slots."""
        assert self.tier is not None
        table, keys = self.table, bring.plan.keys
        per_block = self.block_bytes / self.tier.bytes_per_second
        bring.capped = False
        guess = not bring.plan.hinted
        if guess:
            bring.next = 0
        spare = table.spare() if guess else len(keys)
        while bring.next < len(keys):
            key = keys[bring.next]
            room = self.held() < self.limit
            if key in table.ready:
                if guess:
                    pass
                elif room:
                    slot = table.pin(key)
                    assert slot is not None
                    bring.slots.append(slot)
                else:
                    table.policy.touch(key)
            elif key in self.stored and key not in table.held:
                if not room or spare <= 0:
                    bring.capped = True
                    return
                slot = table.try_reserve(key)
                if slot is None:
                    return
                spare -= 1
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

    def _room_made(self, now: float) -> None:
        """Share or spare slots were given back: the bring-backs they stopped scan again,
        and so do the guesses while the pool has spare slots."""
        spare = self.table.spare() > 0
        for bring in [b for b in self.live.values() if b.capped or (spare and not b.plan.hinted)]:
            if bring.plan in self.live:
                self._scan(bring, now)

    def _retire(self, now: float) -> None:
        """Demote the private blocks of sessions ended or gone quiet (retention by session)."""
        assert self.sessions is not None
        retired = self.sessions.take_retired()
        if retired and self.retention and self.table.demote(retired):
            self._room_made(now)

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
        self._room_made(now)

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
        self._retire(now)
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
                self._retire(now)
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
    retention: bool = True,
) -> RunFigures:
    """Replay ``turns`` through a pool of ``capacity`` blocks; with ``settings`` (and a
    ``tier``), with session hints (``retention``: and retention by session)."""
    run = Replay(capacity, block_bytes, tier, settings, exact, retention)
    seen: set[int] = set()
    for turn in turns:
        run.turn(turn, turn.session in seen)
        seen.add(turn.session)
    return run.figures
