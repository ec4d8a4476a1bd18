"""benchmarks/bench_demo_tiers.py runs the demo's workload for several tier setups in one
process, each against its own round's baseline (a short round here, on the run's SeaweedFS)."""

from __future__ import annotations

import pytest

from tests.scripts.conftest import RunJson
from tests.scripts.runner import Store, positive

pytest.importorskip("torch", reason="the demo needs torch (the kvtier[torch] extra)")


@pytest.mark.timeout(300)
def test_one_quick_round_gives_each_setup_against_its_baseline(
    run_json: RunJson, store: Store
) -> None:
    names = ("fs", "fs+s3", "delayed", "memory")
    args = ("--quick", "--rounds", "1", "--setups", *names, *store.flags())
    out = run_json("-m", "benchmarks.bench_demo_tiers", *args).out
    setups = out["setups"]
    assert set(setups) == set(names)
    ceiling = setups.pop("memory")  # the ceiling: a tier in memory, run once, no prefetch rows
    assert ceiling["p50_share_of_memory"] == 1.0 and "no_prefetch" not in ceiling
    assert setups["fs"]["p50_share_of_fs"] == 1.0  # the FS-only setup is its own reference
    for setup in setups.values():
        assert setup["baseline"] == "without kvtier, same round"
        assert positive(setup["ttft_p50_speedup"]) and positive(setup["ttft_p95_speedup"])
        assert len(setup["rounds"]) == 1
        assert setup["rounds"][0]["ttft_p50"] == setup["ttft_p50_speedup"]  # one round: itself
    assert positive(setups["fs+s3"]["p50_share_of_fs"])
    assert positive(setups["fs+s3"]["server_cpu_cores"])  # SeaweedFS worked for the S3 tier
    assert out["settings"]["prefetch_rows"] is True
    for setup in setups.values():  # the prefetch rows: the same setup without prefetch
        off = setup["no_prefetch"]
        assert positive(off["ttft_p50_speedup"]) and len(off["rounds"]) == 1
        assert positive(setup["prefetch_gain_p50"]) and positive(setup["prefetch_gain_p95"])
        # one round: the gain is the ratio of the two speedups against the same baseline
        ratio = setup["ttft_p50_speedup"] / off["ttft_p50_speedup"]
        assert abs(setup["prefetch_gain_p50"] - ratio) <= 1e-9 * ratio
        # the bound: the ceiling's TTFT p50 against this setup's without prefetch
        bound = ceiling["ttft_p50_speedup"] / off["ttft_p50_speedup"]
        assert abs(setup["prefetch_gain_bound_p50"] - bound) <= 1e-9 * bound
        assert positive(setup["p50_share_of_memory"])
