"""benchmarks/bench_s3_packs.py: a request's blocks stored and loaded raw, one object per
block through the tier, and in packs, on the run's SeaweedFS (a short round here)."""

from __future__ import annotations

import pytest

from tests.scripts.conftest import RunJson
from tests.scripts.runner import Store, positive


@pytest.mark.timeout(300)
def test_packs_send_one_request_per_group_of_blocks(run_json: RunJson, store: Store) -> None:
    out = run_json("-m", "benchmarks.bench_s3_packs", "--quick", *store.flags()).out
    sides = out["sides"]
    # 4 requests of 8 blocks: one PUT and one GET per block, except in packs: one per request.
    requests = {side: (row["puts"], row["gets"]) for side, row in sides.items()}
    assert requests == {"raw": (32, 32), "tier, 1 per object": (32, 32), "tier, packs": (4, 4)}
    for side, row in sides.items():
        assert positive(row["store_mib_s"]) and positive(row["load_mib_s"])
        assert row["server_ms_per_block"]["store"] >= 0  # measured: the store's pid was given
        if side != "raw":
            assert row["of_raw"]["baseline"] == "raw"
            assert positive(row["of_raw"]["store"]) and positive(row["of_raw"]["load"])
