"""The cost model's decision rules, with a fake clock and injected latencies."""

from __future__ import annotations

import pytest

from kvtier import CostModel, InvalidArgumentError, LookupResult
from kvtier.manager._cost import ScanBudget
from tests.support import ManualClock


def test_without_a_recompute_estimate_nothing_is_declined_or_budgeted() -> None:
    cost = CostModel()
    cost.observe_promotion("slow", 10.0, 4096, ok=True)
    assert cost.recompute_seconds(8) is None
    assert cost.promote_before("slow", None, now=0.0)
    assert cost.statistics().tiers[0].declined == 0


def test_a_tier_slower_than_recompute_is_declined_and_a_faster_one_promoted() -> None:
    clock = ManualClock(100.0)
    cost = CostModel(recompute_seconds_per_block=0.01, probe_interval=5.0, clock=clock)
    cost.observe_promotion("slow", 0.5, 4096, ok=True)
    cost.observe_promotion("fast", 0.002, 4096, ok=True)
    now = clock.now
    deadline = now + cost.recompute_seconds(8)  # type: ignore[operator]
    assert cost.promote_before("fast", deadline, now)
    assert not cost.promote_before("slow", deadline, now)
    assert not cost.promote_before("slow", deadline, now + 1)
    assert cost.promote_before("slow", deadline + 5, now + 5)  # a probe, to re-measure
    stats = {t.name: t for t in cost.statistics().tiers}
    assert stats["slow"].declined == 2 and stats["slow"].probes == 1
    assert stats["fast"].declined == 0


def test_a_declined_tier_is_probed_again_after_the_interval_and_can_recover() -> None:
    clock = ManualClock(100.0)
    cost = CostModel(recompute_seconds_per_block=0.01, probe_interval=5.0, alpha=0.5, clock=clock)
    cost.observe_promotion("t", 1.0, 4096, ok=True)  # measured at 100.0
    assert not cost.promote_before("t", 100.08, 100.0)
    assert not cost.promote_before("t", 104.08, 104.0)
    assert cost.promote_before("t", 105.08, 105.0)  # a probe is due
    assert not cost.promote_before("t", 105.09, 105.01)
    for _ in range(10):  # the probes found it fast again
        cost.observe_promotion("t", 0.001, 4096, ok=True)
    assert cost.promote_before("t", 105.5, 105.1)
    latency = cost.expected_latency("t")
    assert latency is not None and latency < 0.01


def test_an_unmeasured_tier_is_promoted_so_it_can_be_measured() -> None:
    cost = CostModel(recompute_seconds_per_block=0.001)
    assert cost.promote_before("new", 1.0, 0.999)


def test_stop_waiting_when_recompute_is_cheaper_and_keep_waiting_when_the_tier_is_faster() -> None:
    cost = CostModel(recompute_seconds_per_block=0.01)
    budget = cost.recompute_seconds(10)
    assert budget is not None and budget == pytest.approx(0.1)
    # blocks expected 50 ms after the wait began: cheaper than 100 ms of recompute
    assert cost.keep_waiting(started=0.0, now=0.01, expected_ready=0.05, budget=budget)
    # expected 0.5 s after: recompute wins, stop now
    assert not cost.keep_waiting(started=0.0, now=0.01, expected_ready=0.5, budget=budget)
    # already waited longer than recompute would have taken: stop, whatever is expected
    assert not cost.keep_waiting(started=0.0, now=0.2, expected_ready=-1.0, budget=budget)
    assert cost.statistics().waits_cut == 2


def test_failures_count_toward_latency_and_successes_toward_throughput() -> None:
    cost = CostModel(alpha=1.0)
    cost.observe_promotion("t", 0.5, 1000, ok=True)
    cost.observe_promotion("t", 2.0, 1000, ok=False)
    (tier,) = cost.statistics().tiers
    assert tier.latency_seconds == 2.0
    assert tier.throughput_bytes_per_second == pytest.approx(2000.0)
    assert (tier.promotions, tier.failures) == (1, 1)


def test_the_engine_can_measure_recompute_as_it_runs() -> None:
    cost = CostModel(alpha=0.5)
    cost.observe_recompute(10, 0.1)
    assert cost.recompute_seconds_per_block == pytest.approx(0.01)
    cost.observe_recompute(10, 0.3)
    assert cost.recompute_seconds_per_block == pytest.approx(0.02)
    cost.observe_recompute(0, 5.0)  # nothing prefilled: nothing learnt
    assert cost.recompute_seconds_per_block == pytest.approx(0.02)
    cost.set_recompute_cost(None)
    assert cost.recompute_seconds(3) is None
    assert cost.statistics().recompute_observations == 2


class FakeManager:
    """A lookup that says which keys are still being checked, and records each blocker."""

    def __init__(self, unknown: set[bytes]) -> None:
        self.unknown = unknown
        self.blockers: list[bytes | None] = []

    def lookup(self, key: bytes, ctx: object = None) -> LookupResult:
        assert isinstance(ctx, ScanBudget)
        self.blockers.append(ctx.blocker)
        if key in self.unknown:
            ctx.unknown = True
            ctx.expect(float(len(self.blockers)))
            return LookupResult.RETRY
        return LookupResult.HIT


def test_scan_budget_names_the_first_unknown_key_before_each_key() -> None:
    keys = [bytes([i]) * 16 for i in range(5)]
    manager = FakeManager({keys[1], keys[3]})
    budget = ScanBudget(manager.lookup, keys, 10.0, 0.5)
    for key in keys[1:]:  # key 0 was resident: the scan starts at key 1
        budget.ask(key)
    assert manager.blockers == [None, keys[1], keys[1], keys[1]]
    assert budget.deadline == 10.0 + 0.5 * 4  # recomputing the 4 keys past the resident one
    assert budget.expected_ready == 3.0
    manager.unknown.discard(keys[1])  # key 1 resolved: key 3 is the first unknown now
    budget.ask(keys[1])
    budget.ask(keys[2])
    budget.ask(keys[4])
    assert manager.blockers[-3:] == [None, None, keys[3]]
    budget.promote = False  # the request stopped waiting: nothing is promoted for it
    budget.ask(keys[2])
    assert manager.blockers[-1] == keys[2]


def test_scan_budget_without_laziness_or_an_estimate() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    manager = FakeManager({keys[0]})
    budget = ScanBudget(manager.lookup, keys, 10.0, None, lazy=False)
    for key in reversed(keys):
        budget.ask(key)
    assert manager.blockers == [None, None, None]
    assert budget.deadline is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: CostModel(recompute_seconds_per_block=-1), "seconds_per_block"),
        (lambda: CostModel(alpha=0), "alpha"),
        (lambda: CostModel(probe_interval=0), "probe_interval"),
        (lambda: CostModel().observe_recompute(-1, 1.0), "blocks"),
        (lambda: CostModel().observe_recompute(1, float("nan")), "seconds"),
        (lambda: CostModel().set_recompute_cost("1"), "seconds_per_block"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_say_what_to_fix(call: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call()  # type: ignore[operator]


def test_a_burst_of_queued_promotions_does_not_make_an_idle_tier_look_slow() -> None:
    """60 promotions started together: the k-th lands after 20 ms plus 5 ms for each one
    ahead of it. Once they have drained, a promotion started now is expected in about 20 ms,
    as the tier delivers it, not in the burst's average (about 170 ms), which would decline
    it against a 50 ms recompute."""
    clock = ManualClock(100.0)
    cost = CostModel(recompute_seconds_per_block=0.05, alpha=0.2, clock=clock)
    queued = [cost.promotion_started("s3") for _ in range(60)]
    assert queued == list(range(60))
    for q in queued:
        cost.observe_promotion("s3", 0.020 + 0.005 * q, 4096, ok=True, queued=q)
        cost.promotion_finished("s3")
    (tier,) = cost.statistics().tiers
    assert tier.latency_seconds is not None and tier.latency_seconds > 0.1  # the plain average
    assert tier.idle_latency_seconds == pytest.approx(0.020)
    assert tier.queued_seconds == pytest.approx(0.005)
    assert tier.in_flight == 0
    assert cost.expected_latency("s3") == pytest.approx(0.020)
    assert cost.promote_before("s3", clock.now + 0.05, clock.now)
    # With 20 of its promotions in flight, a new one is expected behind them: 20 + 20 x 5 ms.
    for _ in range(20):
        cost.promotion_started("s3")
    assert cost.expected_latency("s3") == pytest.approx(0.120)
    assert not cost.promote_before("s3", clock.now + 0.05, clock.now)


def test_a_first_measurement_made_in_a_queue_is_split_over_it() -> None:
    cost = CostModel(alpha=1.0)
    cost.observe_promotion("t", 0.4, 4096, ok=True, queued=3)  # no idle sample yet
    (tier,) = cost.statistics().tiers
    assert tier.idle_latency_seconds == pytest.approx(0.1)
    assert tier.queued_seconds == pytest.approx(0.1)
    cost.observe_promotion("t", 0.03, 4096, ok=True)  # then one finds the tier idle
    assert cost.expected_latency("t") == pytest.approx(0.03)
