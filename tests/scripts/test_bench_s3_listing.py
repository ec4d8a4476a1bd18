"""benchmarks/bench_s3_listing.py: a prefix listed with pages parsed by botocore on the loop
and in a worker thread, on the run's SeaweedFS (a short round here)."""

from __future__ import annotations

import pytest

from tests.scripts.conftest import RunJson
from tests.scripts.runner import Store, positive


@pytest.mark.timeout(300)
def test_both_sides_list_every_object_and_the_ratios_are_reported(
    run_json: RunJson, store: Store
) -> None:
    out = run_json("-m", "benchmarks.bench_s3_listing", "--quick", *store.flags()).out
    assert set(out["medians"]) == {"botocore", "thread"}
    for row in out["medians"].values():
        assert row["objects"] == out["settings"]["objects"] == 2_000
        assert positive(row["wall_s"]) and positive(row["cpu_s"])
    assert set(out["thread_over_botocore"]) >= {"wall_s", "cpu_s"}
    assert all(positive(v) for v in out["thread_over_botocore"].values())
