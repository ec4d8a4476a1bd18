"""benchmarks/open_unreachable.py: a manager over FS + S3 opened with the endpoint refusing and
silent, against FS alone. Figures are not asserted; that each open happened as described is
(the benchmark itself checks that S3 is unavailable and FS serves at every open)."""

from __future__ import annotations

from tests.scripts.conftest import RunJson
from tests.scripts.runner import positive


def test_open_unreachable_reports_each_case(run_json: RunJson) -> None:
    out = run_json("-m", "benchmarks.open_unreachable", "--opens", "1").out
    assert out["opens"] == 1 and out["aim_seconds"] == 1.0
    assert set(out["seconds"]) == {"fs_alone", "s3_refused", "s3_silent"}
    for figures in out["seconds"].values():
        assert positive(figures["min"]) and figures["min"] <= figures["max"]
    assert set(out["over_fs_alone"]) == {"s3_refused", "s3_silent"}
    # The silent endpoint is let go after the answer wait, not before: the wait is a floor.
    assert out["seconds"]["s3_silent"]["min"] >= out["tier_answer_wait"]
