"""Retention by session in the session table, without an event loop: which keys are a
session's own (a prefix shared with another tracked session is not), and when they are
retired: the session ended, was forgotten, went quiet, or its context was cut."""

from __future__ import annotations

from kvtier import SessionSettings
from kvtier.scheduler._sessions import SessionTable


def keys_of(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


SYSTEM = keys_of(0, 3)  # a system prompt two agents share


def test_ending_a_session_retires_its_own_blocks_not_a_shared_prefix() -> None:
    table = SessionTable()
    a, b = [*SYSTEM, *keys_of(1, 4)], [*SYSTEM, *keys_of(2, 2)]
    table.turn_done("a", a, 0.0, lead=0.0)
    table.turn_done("b", b, 0.0, lead=0.0)
    assert table.take_retired() == []
    table.end("a")
    assert table.take_retired() == keys_of(1, 4)
    assert table.take_retired() == []  # handed over once
    table.end("b")  # the last one holding the system prompt
    assert sorted(table.take_retired()) == sorted(b)


def test_a_growing_prompt_retires_nothing_and_a_cut_one_retires_what_it_dropped() -> None:
    table = SessionTable()
    history = keys_of(1, 6)
    table.turn_done("a", [*SYSTEM, *history[:3]], 0.0, lead=0.0)
    table.turn_done("a", [*SYSTEM, *history], 1.0, lead=0.0)  # the context grew
    assert table.take_retired() == []
    summary = keys_of(2, 1)
    table.turn_done("a", [*SYSTEM, *summary], 2.0, lead=0.0)  # compacted: history is gone
    assert table.take_retired() == history


def test_a_session_far_past_the_workloads_gaps_goes_quiet_once() -> None:
    settings = SessionSettings(
        prior_gap=10.0, prior_spread=0.5, stale_quantile=0.9, quiet_quantile=0.99
    )
    table = SessionTable(settings)
    keys = keys_of(1, 4)
    table.turn_done("a", keys, 0.0, lead=0.0)
    (plan,) = table.plans
    table.expire(plan.stale_at)  # stale: no longer held for, but not quiet yet
    assert table.take_retired() == [] and table.quiet == 0
    wake = table.next_wake()  # its going quiet: the prior's 99th percentile, about 32 s
    assert wake is not None and plan.stale_at < wake < 40.0
    table.expire(wake)
    assert table.take_retired() == keys and table.quiet == 1
    table.expire(wake + 100.0)
    assert table.take_retired() == [] and table.quiet == 1  # once per gap
    assert len(table) == 1  # still tracked: it may come back


def test_a_returning_session_is_not_quiet() -> None:
    settings = SessionSettings(prior_gap=10.0, prior_spread=0.5)
    table = SessionTable(settings)
    keys = keys_of(1, 4)
    table.turn_done("a", keys, 0.0, lead=0.0)
    assert table.arrived(keys, 5.0)
    table.expire(1_000.0)
    assert table.take_retired() == [] and table.quiet == 0


def test_a_forgotten_session_retires_its_blocks() -> None:
    table = SessionTable(SessionSettings(max_sessions=1))
    table.turn_done("a", keys_of(1, 2), 0.0, lead=0.0)
    table.turn_done("b", keys_of(2, 2), 1.0, lead=0.0)  # past the bound: "a" is forgotten
    assert table.forgotten == 1 and table.take_retired() == keys_of(1, 2)
