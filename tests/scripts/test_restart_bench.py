"""benchmarks/restart.py: a tier filled by a process killed with SIGKILL, reopened in a fresh
one (FS, and S3 from a listing and from an index snapshot on the run's SeaweedFS), with few
blocks. Figures are not asserted (they describe today's behaviour); the report's shape is,
and so is that no key never stored answers HIT."""

from __future__ import annotations

from typing import Any

import pytest

from tests.scripts.conftest import RunJson
from tests.scripts.runner import Store, positive

BLOCKS = 2000


def fraction(value: Any) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and 0 <= value <= 1


def check_case(case: dict[str, Any], tier: str) -> None:
    assert case["tier"] == tier
    assert case["blocks"] == BLOCKS and case["block_bytes"] == 4096
    assert case["killed_by"] == "SIGKILL"
    assert isinstance(case["page_cache_dropped"], bool)
    assert positive(case["fill_s"]) and positive(case["fill_blocks_per_s"])
    assert positive(case["open_s"]) and positive(case["empty_open_s"])
    # Every block stored before the kill is found again in time here: none is missing.
    assert positive(case["first_hit_s"]) and positive(case["index_complete_s"])
    assert case["stored_blocks_missing"] == 0
    assert case["blocks_indexed"] == BLOCKS
    assert isinstance(case["rss_delta_bytes"], int)
    assert isinstance(case["rss_bytes_per_block"], float)
    assert positive(case["traced_raw_bytes_per_block"])
    assert isinstance(case["traced_bytes_per_block"], float)
    assert case["false_hit_probes"] == 1000
    assert case["false_hits"] == 0  # a key never stored is never a HIT


@pytest.mark.timeout(600)
def test_restart_reports_each_tier_after_a_kill(run_json: RunJson, store: Store) -> None:
    run = run_json(
        "-m",
        "benchmarks.restart",
        "--quick",
        "--blocks",
        str(BLOCKS),
        "--tier",
        "both",
        *store.flags(pid=False),
        timeout=560,
    )
    out = run.out
    assert out["settings"]["blocks"] == BLOCKS
    assert set(out["aims"]) == {
        "first_hit_s_at_1e6_blocks",
        "bytes_per_block",
        "eviction_order_match",
    }
    assert isinstance(out["notes"], list)
    cases = out["cases"]
    assert set(cases) == {"fs", "s3_listing", "s3_snapshot"}

    fs = cases["fs"]
    check_case(fs, "fs")
    evictions = fs["evictions"]
    assert evictions["measured"] == 1000 and evictions["evicted"] == 1000
    assert evictions["stores_evicting_one"] == 1000  # the reopened tier was exactly full
    assert evictions["lru_order_confirmed"] is True  # the filler's order was as planned
    for name in ("order_match", "set_match", "touched_evicted"):
        assert fraction(evictions[name]), name

    for how in ("listing", "snapshot"):
        s3 = cases[f"s3_{how}"]
        check_case(s3, "s3")
        assert s3["s3_open"] == how
        assert s3["evictions"] is None  # the S3 tier never evicts for capacity
        assert s3["index_listing_complete"] is True
        assert s3["opened_from"] in ("listing", "snapshot")
    assert cases["s3_listing"]["opened_from"] == "listing"  # no snapshot was written
