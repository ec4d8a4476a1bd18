"""The cost model's decision rules, with a fake clock and injected latencies."""

from __future__ import annotations

import pytest

from kvtier import CostModel, InvalidArgumentError
from kvtier._cost import ScanBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_a_recompute_estimate_nothing_is_declined_or_budgeted() -> None:
    cost = CostModel()
    cost.observe_promotion("slow", 10.0, 4096, ok=True)
    assert cost.recompute_seconds(8) is None
    assert cost.promote_before("slow", None, now=0.0)
    assert cost.statistics().tiers[0].declined == 0


def test_a_tier_slower_than_recompute_is_declined_and_a_faster_one_promoted() -> None:
    clock = Clock()
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
    clock = Clock()
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
    assert budget == pytest.approx(0.1)
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


def test_scan_budget_plans_its_deadline_once_and_keeps_the_latest_arrival() -> None:
    budget = ScanBudget(10.0, 0.5)
    budget.plan(4)
    budget.plan(100)  # a later scan does not move the deadline
    assert budget.deadline == 12.0
    budget.expect(1.0)
    budget.expect(3.0)
    budget.expect(2.0)
    assert budget.expected_ready == 3.0
    budget.unresolved = True
    budget.new_scan()
    assert not budget.unresolved and budget.expected_ready < 0
    unknown = ScanBudget(10.0, None)
    unknown.plan(4)
    assert unknown.deadline is None  # no recompute estimate: no deadline


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
