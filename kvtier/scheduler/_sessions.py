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

Retention: the table counts, per key, the tracked sessions whose latest prefix holds it, so
it knows a session's private blocks (a system prompt shared with another live session is not
private). When a session ends, is forgotten, or goes quiet (still away past the
``quiet_quantile`` of its predicted gap: the hazard of a heavy-tailed gap falls the longer a
session is away), its private keys are retired (``take_retired``): the caller makes them the
next to leave the pool, so the blocks of sessions expected back outrank them.

Bounds: at most ``max_sessions`` sessions (the least recently active one is forgotten), a
session idle past ``forget_after`` is forgotten, and every plan ends at its ``stale_at``.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from statistics import NormalDist

from kvtier.scheduler._session_settings import SessionSettings

__all__ = [
    "Plan",
    "PlanState",
    "Prediction",
    "SessionSettings",
    "SessionTable",
    "promotion_lead",
]


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
    quiet_in: float = math.inf
    """Seconds after which the session counts as gone quiet: its private blocks go first."""


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
    quiet_at: float | None = None  # when it counts as gone quiet (None: not due, or done)
    arrived: bool = True  # the turn after ``last_turn_done`` was seen (its gap recorded)
    keys: Sequence[bytes] = ()  # its latest prefix, counted in the table's ``_refs``


class SessionTable:
    """Sessions, their learnt gaps and their planned bring-backs. Every method takes the
    time as ``now`` and returns what the caller must act on."""

    def __init__(self, settings: SessionSettings | None = None) -> None:
        self.settings = settings or SessionSettings()
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        self._workload = _Moments()
        self._by_last: dict[bytes, Plan] = {}  # each live plan, by its last key
        # key -> how many tracked sessions' latest prefixes hold it: a key held by one only
        # is that session's private block; a shared prefix (a system prompt) is not
        self._refs: dict[bytes, int] = {}
        self._retired: list[bytes] = []  # private keys of sessions let go, for the caller
        self._z_ready = NormalDist().inv_cdf(self.settings.ready_quantile)
        self._z_stale = NormalDist().inv_cdf(self.settings.stale_quantile)
        self._z_quiet = NormalDist().inv_cdf(self.settings.quiet_quantile)
        self.turns = self.gaps_seen = self.hinted = self.ended = self.forgotten = 0
        self.plans_started = self.plans_claimed = self.plans_stale = self.quiet = 0

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
        self._retired += self._hold(state, keys)
        if keys:
            if expect_back_in is not None:
                self.hinted += 1
                prediction = Prediction(
                    expect_back_in, expect_back_in * (1 + self.settings.hint_slack)
                )
            else:
                prediction = self.predict(session)
            stale_in = max(prediction.stale_in, prediction.ready_in + self.settings.min_hold)
            state.quiet_at = now + max(self.predict(session).quiet_in, stale_in)
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
            self._let_go(oldest)
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
            state.quiet_at = None  # back: not quiet; its next turn_done re-arms it
            self._drop(state)
            self.plans_claimed += 1
        return found

    def end(self, session: Hashable) -> Plan | None:
        """``session`` is over: forget it; its live plan, if any, for the caller to end."""
        state = self._sessions.pop(session, None)
        if state is None:
            return None
        self.ended += 1
        self._let_go(state)
        return None if state.plan is None else self._drop(state)

    def take_retired(self) -> list[bytes]:
        """The private keys (no other tracked session's prefix holds them) of the sessions
        ended, forgotten or gone quiet since the last call: the caller makes them the next
        to leave the pool. A shared prefix stays by use."""
        retired, self._retired = self._retired, []
        return retired

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
            state = self._sessions[plan.session]
            stale.append(self._drop(state))
            self.plans_stale += 1
        for state in self._sessions.values():
            if state.quiet_at is not None and state.quiet_at <= now:
                state.quiet_at = None  # once per gap: a turn that comes after all re-arms it
                self.quiet += 1
                self._retired += self._private(state)
        horizon = now - self.settings.forget_after
        idle = [
            s for s, st in self._sessions.items() if st.plan is None and st.last_turn_done < horizon
        ]
        for session in idle:
            self._let_go(self._sessions.pop(session))
            self.forgotten += 1
        return stale

    def next_wake(self) -> float | None:
        """When a plan next needs the caller (a start, or a plan going stale) or a session
        goes quiet, or None when nothing is due. Idle sessions are forgotten by the next
        ``expire``, whenever it runs."""
        plans = (
            min(p.start_at, p.stale_at) if p.state is PlanState.WAITING else p.stale_at
            for p in self._by_last.values()
        )
        quiet = (s.quiet_at for s in self._sessions.values() if s.quiet_at is not None)
        return min(chain(plans, quiet), default=None)

    # -- prediction ----------------------------------------------------------------------------

    def predict(self, session: Hashable) -> Prediction:
        """``session``'s next gap, from its own gaps shrunk towards the workload's. Quiet
        is the later of the session's and the workload's quantile: a session's few gaps make
        a narrow estimate, and letting a live session's blocks go on it costs more than
        keeping a quiet one's a little longer."""
        settings = self.settings
        work = self._workload
        mean = work.mean if work.count else math.log(settings.prior_gap)
        var = work.var if work.count >= 2 else settings.prior_spread**2
        quiet = mean + self._z_quiet * math.sqrt(max(var, 0.0))
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
            math.exp(mean + self._z_ready * spread),
            math.exp(mean + self._z_stale * spread),
            math.exp(max(mean + self._z_quiet * spread, quiet)),
        )

    def _observe(self, state: _Session, gap: float) -> None:
        if gap <= 0:
            return
        value = math.log(gap)
        state.gaps.add(value, self.settings.alpha)
        self._workload.add(value, self.settings.workload_alpha)
        self.gaps_seen += 1

    # -- who holds which key -------------------------------------------------------------------

    def _hold(self, state: _Session, keys: Sequence[bytes]) -> list[bytes]:
        """``state``'s latest prefix is ``keys`` now: count them, uncount the old one, and
        return the old keys no tracked session holds any more (a session let go, or one
        whose context was cut). A prompt grows, so only what follows the common head
        changes."""
        old, refs = state.keys, self._refs
        same = 0
        for a, b in zip(old, keys, strict=False):
            if a != b:
                break
            same += 1
        for key in keys[same:]:
            refs[key] = refs.get(key, 0) + 1
        dropped: list[bytes] = []
        for key in old[same:]:
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
                dropped.append(key)
        state.keys = keys
        return dropped

    def _private(self, state: _Session) -> list[bytes]:
        refs = self._refs
        return [key for key in state.keys if refs.get(key) == 1]

    def _let_go(self, state: _Session) -> None:
        """``state`` is no longer tracked: its private keys are retired, its keys uncounted."""
        self._retired += self._hold(state, ())

    def _drop(self, state: _Session) -> Plan:
        plan = state.plan
        assert plan is not None
        state.plan = None
        plan.state = PlanState.ENDED
        if self._by_last.get(plan.keys[-1]) is plan:
            del self._by_last[plan.keys[-1]]
        return plan
