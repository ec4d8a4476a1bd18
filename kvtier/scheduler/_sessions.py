"""The session table: a synchronous state machine that says when each session's prefix should
be brought back into the pool, and when to give up on it.

An agent's turn ends (the engine calls ``turn_done`` with the keys its next prompt will start
with); the session comes back after a tool call or a person's pause. The table predicts that
return and plans a bring-back: a window ``[start_at, stale_at]`` in which the prefix is
promoted and held for the returning turn. It never waits and never does I/O: callers pass the
time in (``now``), so it is tested without an event loop, replayed against a trace with a
virtual clock, and a cancelled task cannot leave it half updated. The async driver
(``kvtier.scheduler._bringback``) acts on what it says.

How the return is predicted, without a hint: gaps between turns are heavy-tailed (a tool call
takes seconds, a person minutes), so the table models the logarithm of the gap as normal and
keeps exponentially weighted moving estimates of its mean and variance, per session and for
the whole workload. A session's estimate is shrunk towards the workload's while it has seen
few gaps (a session's first gap is the workload's). The prefix should be back before the
return with high probability, so the plan aims at a low quantile of the predicted gap
(``ready_quantile``) and gives up at a high one (``stale_quantile``); with a hint
(``expect_back_in``) it aims at the hint and gives up ``hint_slack`` times later; either way
it holds at least ``min_hold`` past the expected return.

The lead (how long before ``ready_by`` the promotion must start) comes from the tiers' cost
model through ``promotion_lead``: a bring-back costs about one idle promotion plus what each
further block adds.

Bounds: at most ``max_sessions`` sessions (the least recently active one is forgotten), a
session idle past ``forget_after`` is forgotten, and every plan ends at its ``stale_at``.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from kvtier.common._errors import InvalidArgumentError

__all__ = [
    "Plan",
    "PlanState",
    "Prediction",
    "SessionSettings",
    "SessionTable",
    "promotion_lead",
]


def _share(value: object, name: str, *, open_low: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 < value < 1 if open_low else 0 <= value <= 1)
    ):
        bounds = "strictly between 0 and 1" if open_low else "from 0 to 1"
        raise InvalidArgumentError(f"{name} must be a number {bounds}, got {value!r}")


def _positive(value: object, name: str, *, integer: bool = False) -> None:
    kinds = int if integer else int | float
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not math.isfinite(value)
        or value <= 0
    ):
        what = "int" if integer else "number"
        raise InvalidArgumentError(f"{name} must be a positive {what}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """How an ``OffloadScheduler`` brings sessions back (``OffloadScheduler(...,
    sessions=SessionSettings(...))``)."""

    share: float = 0.25
    """Share of the pool's slots all bring-backs together may hold (pins, and promotions in
    flight): a wrong guess costs at most this. Separate from ``prefetch_share``, so guesses
    never crowd out queued requests' prefetches."""
    max_running: int = 4
    """Bring-backs scanning and promoting at once; due ones wait their turn, earliest first."""
    ready_quantile: float = 0.1
    """Without a hint, aim to have the prefix back before this share of predicted returns."""
    stale_quantile: float = 0.9
    """Without a hint, stop holding the prefix once this share of returns would have come."""
    hint_slack: float = 1.0
    """With ``expect_back_in=x``, stop holding after ``x * (1 + hint_slack)``."""
    min_hold: float = 5.0
    """Seconds a plan holds at least past its expected return: a turn a little late (a
    hint of a return in a millisecond, a busy engine) still finds its prefix."""
    prior_gap: float = 30.0
    """Seconds: the gap between turns assumed before the workload has shown one."""
    prior_spread: float = 1.0
    """Standard deviation of the log of the gap assumed before the workload has shown two."""
    prior_weight: float = 2.0
    """A session's gaps count as much as the workload's once it has shown this many."""
    alpha: float = 0.3
    """Weight of a new gap in a session's moving estimates."""
    workload_alpha: float = 0.05
    """Weight of a new gap in the workload's moving estimates."""
    lead_margin: float = 1.5
    """The promotion's expected duration is multiplied by this to set its lead."""
    default_lead: float = 1.0
    """Seconds of lead before the cost model has measured a tier."""
    max_sessions: int = 10_000
    """Sessions tracked at once; past it the least recently active one is forgotten."""
    forget_after: float = 3_600.0
    """Seconds after its last turn that a session with no hint pending is forgotten."""

    def __post_init__(self) -> None:
        _share(self.share, "share")
        _positive(self.max_running, "max_running", integer=True)
        _share(self.ready_quantile, "ready_quantile", open_low=True)
        _share(self.stale_quantile, "stale_quantile", open_low=True)
        if self.stale_quantile <= self.ready_quantile:
            raise InvalidArgumentError(
                "stale_quantile must be above ready_quantile, got "
                f"{self.stale_quantile!r} <= {self.ready_quantile!r}"
            )
        for name in ("hint_slack", "min_hold", "prior_gap", "prior_spread", "prior_weight"):
            _positive(getattr(self, name), name)
        _share(self.alpha, "alpha", open_low=True)
        _share(self.workload_alpha, "workload_alpha", open_low=True)
        if isinstance(self.lead_margin, bool) or not self.lead_margin >= 1:
            raise InvalidArgumentError(f"lead_margin must be at least 1, got {self.lead_margin!r}")
        _positive(self.default_lead, "default_lead")
        _positive(self.max_sessions, "max_sessions", integer=True)
        _positive(self.forget_after, "forget_after")


def promotion_lead(
    blocks: int, idle_seconds: float | None, per_block_seconds: float | None, margin: float
) -> float | None:
    """Seconds a bring-back of ``blocks`` blocks needs, with ``margin``: one promotion from an
    idle tier plus what each further one adds (the cost model's two estimates); None when
    the tier has not been measured yet."""
    if idle_seconds is None:
        return None
    return margin * (idle_seconds + max(blocks - 1, 0) * (per_block_seconds or 0.0))


class PlanState(enum.Enum):
    """A plan waits for its start time, then runs (the driver acts on it) until it ends."""

    WAITING = "waiting"
    STARTED = "started"
    ENDED = "ended"


@dataclass(eq=False, slots=True)
class Plan:
    """One session's planned bring-back: its keys, when to start promoting them, when the
    turn is expected (``ready_by``) and when to give up (``stale_at``), all clock times."""

    session: Hashable
    keys: Sequence[bytes]
    turn_done_at: float
    start_at: float
    ready_by: float
    stale_at: float
    hinted: bool
    state: PlanState = PlanState.WAITING


@dataclass(frozen=True, slots=True)
class Prediction:
    """A session's next gap: the seconds after its turn ended by which its prefix should be
    back, and after which holding it is no longer worth it."""

    ready_in: float
    stale_in: float


@dataclass(slots=True)
class _Moments:
    """Exponentially weighted mean and variance of the log of the gaps."""

    mean: float = 0.0
    var: float = 0.0
    count: int = 0

    def add(self, value: float, alpha: float) -> None:
        if self.count == 0:
            self.mean = value
        else:
            delta = value - self.mean
            self.mean += alpha * delta
            self.var = (1 - alpha) * (self.var + alpha * delta * delta)
        self.count += 1


@dataclass(slots=True)
class _Session:
    gaps: _Moments = field(default_factory=_Moments)
    last_turn_done: float = 0.0
    plan: Plan | None = None
    arrived: bool = True  # the turn after ``last_turn_done`` was seen (its gap recorded)


class SessionTable:
    """Sessions, their learnt gaps and their planned bring-backs. Every method takes the
    time as ``now`` and returns what the caller must act on."""

    def __init__(self, settings: SessionSettings | None = None) -> None:
        self.settings = settings or SessionSettings()
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        self._workload = _Moments()
        self._by_last: dict[bytes, Plan] = {}  # each live plan, by its last key
        self._z_ready = NormalDist().inv_cdf(self.settings.ready_quantile)
        self._z_stale = NormalDist().inv_cdf(self.settings.stale_quantile)
        self.turns = self.gaps_seen = self.hinted = self.ended = self.forgotten = 0
        self.plans_started = self.plans_claimed = self.plans_stale = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def plans(self) -> list[Plan]:
        """The live plans (waiting or started)."""
        return list(self._by_last.values())

    def plan_of(self, session: Hashable) -> Plan | None:
        """``session``'s live plan, if any."""
        state = self._sessions.get(session)
        return None if state is None else state.plan

    # -- what the engine says ------------------------------------------------------------------

    def turn_done(
        self,
        session: Hashable,
        keys: Sequence[bytes],
        now: float,
        *,
        lead: float,
        expect_back_in: float | None = None,
    ) -> list[Plan]:
        """``session``'s turn ended at ``now``; its next prompt starts with ``keys``. Plans the
        bring-back and returns the plans that ended because of it (the session's previous one,
        sessions forgotten to stay within bounds): the caller stops their work."""
        ended: list[Plan] = []
        state = self._sessions.get(session)
        if state is None:
            state = self._sessions[session] = _Session()
        else:
            self._sessions.move_to_end(session)
            if not state.arrived:  # no lookup claimed the return: this gap is an upper bound
                self._observe(state, now - state.last_turn_done)
            if state.plan is not None:
                ended.append(self._drop(state))
        self.turns += 1
        state.last_turn_done = now
        state.arrived = False
        if keys:
            if expect_back_in is not None:
                self.hinted += 1
                prediction = Prediction(
                    expect_back_in, expect_back_in * (1 + self.settings.hint_slack)
                )
            else:
                prediction = self.predict(session)
            stale_in = max(prediction.stale_in, prediction.ready_in + self.settings.min_hold)
            plan = Plan(
                session,
                keys,
                turn_done_at=now,
                start_at=now + prediction.ready_in - lead,
                ready_by=now + prediction.ready_in,
                stale_at=now + stale_in,
                hinted=expect_back_in is not None,
            )
            replaced = self._by_last.get(keys[-1])
            if replaced is not None:  # another session's plan for the same prefix: one is enough
                ended.append(self._drop(self._sessions[replaced.session]))
            state.plan = plan
            self._by_last[keys[-1]] = plan
        while len(self._sessions) > self.settings.max_sessions:
            _, oldest = self._sessions.popitem(last=False)
            self.forgotten += 1
            if oldest.plan is not None:
                ended.append(self._drop(oldest))
        return ended

    def arrived(self, keys: Sequence[bytes], now: float) -> list[Plan]:
        """A request for ``keys`` arrived: the sessions whose planned prefix it starts with
        have returned. Records their gaps and returns their plans, now ended (the caller
        claims their work)."""
        by_last = self._by_last
        if not by_last:
            return []
        found = list(dict.fromkeys(plan for plan in map(by_last.get, keys) if plan is not None))
        for plan in found:
            state = self._sessions[plan.session]
            self._observe(state, now - state.last_turn_done)
            state.arrived = True
            self._drop(state)
            self.plans_claimed += 1
        return found

    def end(self, session: Hashable) -> Plan | None:
        """``session`` is over: forget it; its live plan, if any, for the caller to end."""
        state = self._sessions.pop(session, None)
        if state is None:
            return None
        self.ended += 1
        return None if state.plan is None else self._drop(state)

    # -- what the clock says -------------------------------------------------------------------

    def due(self, now: float, room: int) -> list[Plan]:
        """Up to ``room`` waiting plans whose start time has come, the soonest expected
        return first; they are marked started."""
        if room <= 0:
            return []
        waiting = [p for p in self._by_last.values() if p.state is PlanState.WAITING]
        ready = sorted((p for p in waiting if p.start_at <= now), key=lambda p: p.ready_by)
        for plan in ready[:room]:
            plan.state = PlanState.STARTED
            self.plans_started += 1
        return ready[:room]

    def expire(self, now: float) -> list[Plan]:
        """Plans past their ``stale_at`` (ended now) and sessions idle past ``forget_after``
        (forgotten); the plans, for the caller to end."""
        stale: list[Plan] = []
        for plan in [p for p in self._by_last.values() if p.stale_at <= now]:
            stale.append(self._drop(self._sessions[plan.session]))
            self.plans_stale += 1
        horizon = now - self.settings.forget_after
        idle = [
            s for s, st in self._sessions.items() if st.plan is None and st.last_turn_done < horizon
        ]
        for session in idle:
            del self._sessions[session]
            self.forgotten += 1
        return stale

    def next_wake(self) -> float | None:
        """When a plan next needs the caller (a start, or a plan going stale), or None when
        none is live. Idle sessions are forgotten by the next ``expire``, whenever it runs."""
        return min(
            (
                min(p.start_at, p.stale_at) if p.state is PlanState.WAITING else p.stale_at
                for p in self._by_last.values()
            ),
            default=None,
        )

    # -- prediction ----------------------------------------------------------------------------

    def predict(self, session: Hashable) -> Prediction:
        """``session``'s next gap, from its own gaps shrunk towards the workload's."""
        settings = self.settings
        work = self._workload
        mean = work.mean if work.count else math.log(settings.prior_gap)
        var = work.var if work.count >= 2 else settings.prior_spread**2
        state = self._sessions.get(session)
        if state is not None and state.gaps.count:
            weight = state.gaps.count / (state.gaps.count + settings.prior_weight)
            own = state.gaps
            own_var = own.var if own.count >= 2 else var
            # the mixture's variance: a session unlike the workload widens the window
            blended = weight * own.mean + (1 - weight) * mean
            var = weight * (own_var + (own.mean - blended) ** 2) + (1 - weight) * (
                var + (mean - blended) ** 2
            )
            mean = blended
        spread = math.sqrt(max(var, 0.0))
        return Prediction(
            math.exp(mean + self._z_ready * spread), math.exp(mean + self._z_stale * spread)
        )

    def _observe(self, state: _Session, gap: float) -> None:
        if gap <= 0:
            return
        value = math.log(gap)
        state.gaps.add(value, self.settings.alpha)
        self._workload.add(value, self.settings.workload_alpha)
        self.gaps_seen += 1

    def _drop(self, state: _Session) -> Plan:
        plan = state.plan
        assert plan is not None
        state.plan = None
        plan.state = PlanState.ENDED
        if self._by_last.get(plan.keys[-1]) is plan:
            del self._by_last[plan.keys[-1]]
        return plan
