"""Per-tier admission of write-through: back-pressure engages, drops are counted, it recovers.
A fake clock and injected write latencies; no event loop."""

from __future__ import annotations

import pytest

from kvtier import AdmissionPolicy, InvalidArgumentError
from kvtier.writes._deferred import DeferredWrites
from kvtier.writes._writeback import WriteBackQueue
from tests.support import ManualClock


def test_in_flight_bytes_engage_back_pressure_and_release_it() -> None:
    policy = AdmissionPolicy(max_in_flight_bytes=3 * 100, max_write_latency=None)
    assert [policy.admit("s3", 100) for _ in range(4)] == [True, True, True, False]
    policy.finished("s3", 100, 0.01)
    assert policy.admit("s3", 100)
    assert policy.admit("fs", 100)  # the limit is per tier: another tier is not held back
    (s3, fs) = policy.statistics(["s3", "fs"])
    assert s3.dropped_by_cause == {"in_flight": 1} and s3.admitted == 4
    assert s3.in_flight_bytes == 300 and fs.in_flight_bytes == 100


def test_a_slow_tier_closes_then_probes_and_reopens_when_it_recovers(clock: ManualClock) -> None:
    policy = AdmissionPolicy(max_write_latency=0.5, probe_interval=1.0, alpha=0.5, clock=clock)
    assert policy.admit("slow", 10)
    policy.finished("slow", 10, 2.0)  # one write took 2 s: the tier is slow
    assert policy.is_closed("slow")
    assert policy.admit("slow", 10)  # the first probe goes through at once
    assert not policy.admit("slow", 10)  # and nothing else while it runs
    policy.finished("slow", 10, 0.1)  # the probe was fast: average 1.05 s, still closed
    assert policy.is_closed("slow")
    assert not policy.admit("slow", 10)  # the next probe waits for the interval
    clock.now = 1.0
    assert policy.admit("slow", 10)
    policy.finished("slow", 10, 0.1)  # average 0.575 s: still closed
    clock.now = 2.0
    assert policy.admit("slow", 10)
    policy.finished("slow", 10, 0.1)  # average 0.3375 s: open again
    assert not policy.is_closed("slow")
    assert all(policy.admit("slow", 10) for _ in range(5))
    (stats,) = policy.statistics()
    assert stats.dropped_by_cause == {"latency": 2} and stats.probes == 3
    assert policy.dropped() == 2


def test_a_hung_write_closes_the_tier_before_it_reports_any_latency(clock: ManualClock) -> None:
    policy = AdmissionPolicy(max_write_latency=0.5, clock=clock)
    assert policy.admit("nfs", 10)
    clock.now = 1.9
    assert policy.admit("nfs", 10)  # the first write is slow, but not hung yet
    clock.now = 2.1
    assert policy.is_closed("nfs")  # 4 times the limit: hung, though it has not finished
    assert not policy.admit("nfs", 10)
    policy.finished("nfs", 10, 0.3)
    policy.finished("nfs", 10, 0.2)  # both done: average 0.27 s, nothing in flight
    assert not policy.is_closed("nfs")
    assert policy.admit("nfs", 10)
    assert policy.statistics()[0].dropped_by_cause == {"latency": 1}


def test_a_fast_tier_is_never_closed() -> None:
    policy = AdmissionPolicy(max_write_latency=0.5)
    for _ in range(100):
        assert policy.admit("fs", 10)
        policy.finished("fs", 10, 0.01)
    assert policy.dropped() == 0


def test_write_back_is_per_tier() -> None:
    policy = AdmissionPolicy(write_back=["s3"])
    assert policy.is_write_back("s3") and not policy.is_write_back("fs")
    assert [s.write_back for s in policy.statistics(["fs", "s3"])] == [False, True]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_in_flight_bytes": 0}, "max_in_flight_bytes"),
        ({"max_in_flight_bytes": {"s3": -1}}, "max_in_flight_bytes"),
        ({"max_write_latency": -1}, "max_write_latency"),
        ({"probe_interval": 0}, "probe_interval"),
        ({"write_back": "s3"}, "write_back"),
        ({"alpha": 2}, "alpha"),
    ],
)
def test_bad_arguments_say_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        AdmissionPolicy(**kwargs)  # type: ignore[arg-type]


def test_write_back_queue_writes_the_oldest_beyond_its_limit() -> None:
    policy = AdmissionPolicy(max_in_flight_bytes=2 * 10, write_back=["s3"])
    queue = WriteBackQueue(limit=1)
    for slot, key in enumerate([b"a", b"b", b"c", b"d"]):
        queue.add(key, slot)
    writes, unpin = queue.due(policy, ["s3"], 10, everything=False)
    assert writes == [(b"a", 0, ["s3"]), (b"b", 1, ["s3"])]  # then the tier is full
    assert unpin == [] and len(queue) == 2  # c waits for room
    policy.finished("s3", 10, 0.01)
    writes, _ = queue.due(policy, ["s3"], 10, everything=False)
    assert writes == [(b"c", 2, ["s3"])] and len(queue) == 1
    assert queue.due(policy, ["s3"], 10, everything=False) == ([], [])  # at the limit


def test_write_back_queue_drops_for_a_closed_tier_and_flushes_everything_at_close(
    clock: ManualClock,
) -> None:
    policy = AdmissionPolicy(max_write_latency=0.5, write_back=["s3"], clock=clock)
    policy.observe_write_latency("s3", 5.0)  # closed
    queue = WriteBackQueue(limit=1)
    for slot, key in enumerate([b"a", b"b", b"c"]):
        queue.add(key, slot)
    writes, unpin = queue.due(policy, ["s3"], 10, everything=False)
    assert writes == [(b"a", 0, ["s3"])]  # the probe
    assert unpin == [1]  # b: dropped, counted
    assert policy.dropped() == 1
    writes, unpin = queue.due(policy, ["s3"], 10, everything=True)
    assert writes == [(b"c", 2, ["s3"])] and unpin == [] and len(queue) == 0
    assert queue.written_back == 2


def test_the_last_refusal_says_its_cause(clock: ManualClock) -> None:
    policy = AdmissionPolicy(
        max_in_flight_bytes=200, max_write_latency=None, max_write_rate=100.0, clock=clock
    )
    assert policy.last_refusal("s3") == ""
    assert policy.admit("s3", 100)  # the first second's worth of rate
    assert not policy.admit("s3", 100)
    assert policy.last_refusal("s3") == "rate"
    clock.now += 1.0
    assert policy.admit("s3", 100)  # both in flight now: the next is refused for room
    clock.now += 1.0
    assert not policy.admit("s3", 100)
    assert policy.last_refusal("s3") == "in_flight"


def test_a_group_is_admitted_whole_or_not_at_all(clock: ManualClock) -> None:
    """A group of deferred writes to a packing tier: all its writes reserved together, or
    none. The rate bucket holds a whole group even when that is more than a second's worth,
    or a group would never fit."""
    policy = AdmissionPolicy(
        max_in_flight_bytes=8 * 100, max_write_latency=None, max_write_rate=200.0, clock=clock
    )
    assert policy.capacity("s3", 100) == 8 and policy.capacity("fs", 1000) == 0
    assert policy.has_room("s3", 100, count=4)  # four blocks: twice the second's worth
    assert policy.admit("s3", 100, count=4)
    clock.now = 1.0  # two blocks' worth: not a group, and the bucket gives no part of one
    assert not policy.admit("s3", 100, count=4)
    (s3,) = policy.statistics()
    assert s3.admitted == 4 and s3.in_flight_bytes == 400 and s3.dropped_by_cause == {"rate": 4}
    clock.now = 2.0
    assert policy.admit("s3", 100, count=4)
    clock.now = 4.0
    assert not policy.has_room("s3", 100, count=4)  # the group fits the rate, not the room
    for _ in range(3):
        policy.finished("s3", 100, 0.01)  # each write of a group ends on its own
    policy.cancel("s3", 100)  # one never started: its bytes and tokens come back
    (s3,) = policy.statistics()
    assert s3.in_flight_bytes == 400 and s3.admitted == 7
    assert policy.admit("s3", 100, count=4)  # the bucket held a group, not a token more
    policy.finished("s3", 100, 0.01)
    assert not policy.admit("s3", 100)
    assert policy.last_refusal("s3") == "rate"


def test_a_closed_tier_takes_a_group_as_its_probe(clock: ManualClock) -> None:
    policy = AdmissionPolicy(max_write_latency=0.5, probe_interval=1.0, clock=clock)
    policy.observe_write_latency("s3", 2.0)
    assert policy.admit("s3", 100, count=4)  # one probe: one packed request
    assert not policy.admit("s3", 100, count=4)  # nothing else while it runs
    (s3,) = policy.statistics()
    assert s3.probes == 1 and s3.in_flight_bytes == 400
    assert s3.dropped_by_cause == {"latency": 4}


def test_deferred_writes_come_in_groups_within_room() -> None:
    queue = DeferredWrites(["s3", "fs"], limit=100)
    for key in (b"a", b"b", b"c", b"d", b"e", b"f"):
        queue.add("s3", key)
    queue.add("fs", b"z")
    policy = AdmissionPolicy(max_in_flight_bytes=5 * 10, max_write_latency=None)
    groups = queue.due_groups(policy, 10, room=9, sizes={"s3": 4})
    # a whole group, then the two left would pass the tier's room (4 + 2 > 5): they wait
    assert groups == [("s3", [b"a", b"b", b"c", b"d"]), ("fs", [b"z"])]
    assert queue.pending("s3") == 2 and queue.pending("fs") == 0
    for _ in range(4):
        policy.finished("s3", 10, 0.01)
    assert queue.due_groups(policy, 10, room=1, sizes={"s3": 4}) == []  # room for one only
    assert queue.due_groups(policy, 10, room=2, sizes={"s3": 4}) == [("s3", [b"e", b"f"])]


def test_ready_in_says_when_time_alone_gives_room(clock: ManualClock) -> None:
    """What the manager sleeps until before draining deferred writes again: the rate budget
    refilled, a latency probe due; None where only a write ending makes room."""
    policy = AdmissionPolicy(
        max_in_flight_bytes={"capped": 200},
        max_write_rate={"paced": 100.0},
        max_write_latency=0.5,
        probe_interval=2.0,
        clock=clock,
    )
    assert policy.ready_in("unseen", 100) == 0.0
    assert policy.admit("paced", 100)  # the whole budget: a second's worth
    assert policy.ready_in("paced", 100) == pytest.approx(1.0)
    assert policy.ready_in("paced", 50, count=2) == pytest.approx(1.0)
    clock.now += 0.25
    assert policy.ready_in("paced", 100) == pytest.approx(0.75)
    clock.now += 0.75
    assert policy.ready_in("paced", 100) == 0.0 and policy.admit("paced", 100)
    assert policy.admit("capped", 200)
    assert policy.ready_in("capped", 100) is None  # the write in flight must end
    policy.finished("capped", 200, 1.0)  # slow: closed by latency, its probe due in 2 s
    assert policy.is_closed("capped") and policy.admit("capped", 100)
    assert policy.ready_in("capped", 100) is None  # the probe is in flight
    clock.now += 0.5
    policy.finished("capped", 100, 1.0)  # still slow: the next probe 2 s after this one
    assert policy.ready_in("capped", 100) == pytest.approx(1.5)
    clock.now += 1.5
    assert policy.ready_in("capped", 100) == 0.0 and policy.has_room("capped", 100)
