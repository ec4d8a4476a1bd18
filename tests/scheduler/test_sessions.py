"""The session table without an event loop: predictions learnt from gaps, what is due and
when, the bounds, ``end`` and stale plans."""

from __future__ import annotations

import math

import pytest

from kvtier import InvalidArgumentError, SessionSettings
from kvtier.scheduler._sessions import PlanState, SessionTable, promotion_lead


def keys_of(session: int, n: int) -> list[bytes]:
    return [bytes([session, i]) * 8 for i in range(n)]


def test_the_first_gap_is_the_priors_and_later_ones_are_learnt() -> None:
    settings = SessionSettings(prior_gap=30.0, prior_spread=1.0)
    table = SessionTable(settings)
    first = table.predict("a")
    assert first.ready_in < 30.0 < first.stale_in  # a window around the prior's median
    now = 0.0
    for _ in range(30):  # a session that always comes back after 5 s
        table.turn_done("a", keys_of(1, 4), now, lead=0.5)
        now += 5.0
        assert table.arrived(keys_of(1, 4), now)
        now += 1.0  # the turn runs
    learnt = table.predict("a")
    assert learnt.ready_in == pytest.approx(5.0, rel=0.05)
    assert learnt.stale_in == pytest.approx(5.0, rel=0.05)  # before min_hold is added
    # a new session starts from the workload's gaps, here all five seconds
    fresh = table.predict("b")
    assert fresh.ready_in == pytest.approx(5.0, rel=0.2)
    assert table.gaps_seen == 30


def test_a_session_unlike_the_workload_widens_its_window() -> None:
    table = SessionTable()
    now = 0.0
    for i in range(40):  # the workload: gaps of 2 s and 200 s alternating
        table.turn_done("w", keys_of(1, 2), now, lead=0.0)
        now += 2.0 if i % 2 else 200.0
        table.arrived(keys_of(1, 2), now)
    table.turn_done("new", keys_of(2, 2), now, lead=0.0)
    window = table.predict("new")
    assert window.ready_in < 5.0 and window.stale_in > 100.0


def test_a_plan_is_due_its_lead_before_the_predicted_return() -> None:
    table = SessionTable(SessionSettings(max_running=2, min_hold=1.0))
    keys = keys_of(1, 8)
    (plan_list) = table.turn_done("a", keys, 100.0, lead=2.0, expect_back_in=10.0)
    assert plan_list == []
    (plan,) = table.plans
    assert (plan.start_at, plan.ready_by, plan.stale_at) == (108.0, 110.0, 120.0)
    assert plan.hinted and plan.state is PlanState.WAITING
    assert table.next_wake() == 108.0
    assert table.due(107.9, room=2) == []
    assert table.due(108.0, room=0) == []  # no room: it waits
    assert table.due(108.0, room=2) == [plan]
    assert plan.state is PlanState.STARTED  # type: ignore[comparison-overlap]  # due() moved it
    assert table.due(109.0, room=2) == []  # started once
    assert table.next_wake() == 120.0  # now only its stale time


def test_due_plans_start_soonest_return_first_within_the_room() -> None:
    table = SessionTable()
    for session, back in ((1, 30.0), (2, 10.0), (3, 20.0)):
        table.turn_done(session, keys_of(session, 2), 0.0, lead=0.0, expect_back_in=back)
    started = table.due(100.0, room=2)
    assert [p.session for p in started] == [2, 3]
    assert [p.session for p in table.due(100.0, room=2)] == [1]


def test_the_returning_turn_claims_the_plan_and_a_new_turn_replaces_it() -> None:
    table = SessionTable()
    table.turn_done("a", keys_of(1, 4), 0.0, lead=1.0, expect_back_in=5.0)
    (first,) = table.plans
    # the next prompt starts with the planned keys and goes on
    assert table.arrived([*keys_of(1, 4), b"x" * 16], 4.0) == [first]
    assert first.state is PlanState.ENDED and table.plans == []
    assert table.arrived(keys_of(1, 4), 5.0) == []  # claimed once
    assert table.turn_done("a", keys_of(1, 6), 6.0, lead=1.0) == []
    (second,) = table.plans
    # a turn done with no lookup seen in between replaces the plan (and counts the gap)
    replaced = table.turn_done("a", keys_of(1, 7), 20.0, lead=1.0)
    assert replaced == [second] and second.state is PlanState.ENDED
    assert table.gaps_seen == 2 and table.plans_claimed == 1


def test_end_forgets_the_session_and_hands_back_its_plan() -> None:
    table = SessionTable()
    table.turn_done("a", keys_of(1, 3), 0.0, lead=0.0)
    (plan,) = table.plans
    assert table.end("a") is plan and plan.state is PlanState.ENDED
    assert table.end("a") is None  # idempotent
    assert len(table) == 0 and table.plans == [] and table.next_wake() is None
    assert table.arrived(keys_of(1, 3), 1.0) == []


def test_a_plan_goes_stale_and_idle_sessions_are_forgotten() -> None:
    settings = SessionSettings(forget_after=100.0, min_hold=1.0)
    table = SessionTable(settings)
    table.turn_done("a", keys_of(1, 3), 0.0, lead=0.0, expect_back_in=10.0)
    (plan,) = table.plans
    assert table.expire(19.9) == []
    assert table.expire(20.0) == [plan] and plan.state is PlanState.ENDED
    assert table.plans_stale == 1 and len(table) == 1  # its gaps are kept a while
    wake = table.next_wake()  # only its going quiet is pending
    assert wake is not None and wake > 20.0
    assert table.take_retired() == []
    assert table.expire(100.1) == [] and len(table) == 0
    assert table.forgotten == 1
    assert table.take_retired() == keys_of(1, 3)  # forgotten: its blocks go first
    assert table.next_wake() is None  # nothing pending lives on


def test_the_table_is_bounded() -> None:
    table = SessionTable(SessionSettings(max_sessions=3))
    for session in range(5):
        table.turn_done(session, keys_of(session, 2), float(session), lead=0.0)
    assert len(table) == 3 and len(table.plans) == 3
    assert table.forgotten == 2
    assert {p.session for p in table.plans} == {2, 3, 4}  # the least recently active went


def test_two_sessions_planning_the_same_prefix_keep_one_plan() -> None:
    table = SessionTable()
    table.turn_done("a", keys_of(1, 3), 0.0, lead=0.0)
    (first,) = table.plans
    assert table.turn_done("b", keys_of(1, 3), 1.0, lead=0.0) == [first]
    assert [p.session for p in table.plans] == ["b"]


def test_an_empty_turn_plans_nothing() -> None:
    table = SessionTable()
    assert table.turn_done("a", [], 0.0, lead=0.0) == []
    assert table.plans == [] and len(table) == 1


def test_the_lead_follows_the_cost_model() -> None:
    assert promotion_lead(10, None, 0.01, 1.5) is None
    assert promotion_lead(1, 0.02, 0.01, 1.0) == pytest.approx(0.02)
    assert promotion_lead(11, 0.02, 0.01, 2.0) == pytest.approx(0.24)
    assert promotion_lead(0, 0.02, None, 1.0) == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("share", 1.5),
        ("max_running", 0),
        ("ready_quantile", 0.0),
        ("stale_quantile", 1.0),
        ("prior_gap", -1.0),
        ("alpha", 0.0),
        ("lead_margin", 0.5),
        ("lead_slack", -0.01),
        ("lead_slack", math.inf),
        ("max_sessions", 0),
        ("forget_after", math.inf),
        ("quiet_quantile", 1.0),
    ],
)
def test_settings_are_checked(field: str, value: float) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        SessionSettings(**{field: value})  # type: ignore[arg-type]


def test_the_stale_quantile_must_be_above_the_ready_one() -> None:
    with pytest.raises(InvalidArgumentError, match="stale_quantile must be above"):
        SessionSettings(ready_quantile=0.5, stale_quantile=0.4)


def test_the_quiet_quantile_must_not_be_below_the_stale_one() -> None:
    with pytest.raises(InvalidArgumentError, match="quiet_quantile must be at least"):
        SessionSettings(stale_quantile=0.9, quiet_quantile=0.8)
