"""benchmarks/residency.py: node processes on the run's SeaweedFS, a router fed only by their
events, one divergence of every kind. What kvtier announces itself (FS evictions, corrupt and
deleted blocks, S3 stores and deletes) must reach the view, and so must an object removed
from the bucket behind kvtier's back or a file removed by hand that nobody loads (the S3
index's audit, the FS owner's walk find them); the nodes' folders must agree again after a
router restart and a stalled router; the whole-view figures are reported, not asserted."""

from __future__ import annotations

import pytest

from benchmarks.residency import KINDS
from tests.scripts.conftest import RunJson
from tests.scripts.runner import Store

ANNOUNCED = (
    *("evicted", "corrupt", "fs_deleted", "s3_deleted", "s3_other_store"),
    *("s3_removed_unloaded", "fs_removed_unloaded"),
)


@pytest.mark.timeout(300)
def test_residency_quick_reports_every_divergence_and_kvtiers_own_changes_converge(
    run_json: RunJson, store: Store
) -> None:
    out = run_json(
        "-m", "benchmarks.residency", "--quick", "--s3-keep-rounds", "1", *store.flags(pid=False)
    ).out
    assert set(out["convergence"]) == set(KINDS)
    assert all(c["count"] == 1 for c in out["convergence"].values())
    for kind in ANNOUNCED:
        assert out["convergence"][kind]["converged"] == 1, kind
    assert set(out["precision"]) == set(out["recall"]) == {"fs", "s3"}
    # The whole-view divergences, on the nodes' own folders: a router restarted takes each
    # node's full state; a router stalled past the high-water marks lost the end of a burst,
    # which the publishers' heartbeats show and a replay repairs.
    for kind in ("router_restart", "slow_subscriber"):
        assert out["convergence_by_tier"][kind]["fs"]["converged"] == 1, kind
    fs = out["settled"]["fs"]
    assert fs["samples"] >= 1 and fs["precision"] == fs["recall"] == 1.0
    assert out["block_operations"] > 0 and out["router"]["bad_messages"] == 0
    assert out["s3_blocks_credited_to_one_node_or_nodes_not_credited"] == 0
    # Each evicted key's own latency, from the store that evicted it: within the burst's.
    each = out["eviction_latency"]
    assert 1 <= each["count"] <= out["settings"]["fs_blocks"]
    assert 0 < each["max_s"] <= out["convergence"]["evicted"]["max_s"]
    # The wait for the audit counts the audits' own time, as docs/events.md states the bound.
    assert out["s3_removed_unloaded_stated_bound_max_s"] > out["settings"]["audit_every"]
