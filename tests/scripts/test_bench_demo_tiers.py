"""benchmarks/bench_demo_tiers.py runs the demo's workload for several tier setups in one
process, each against its own round's baseline (a short round here, on a real SeaweedFS)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the demo needs torch (the kvtier[torch] extra)")
pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_demo_tiers.py"


@pytest.mark.timeout(300)
def test_one_quick_round_prints_each_setup_against_its_baseline(
    run_script: Callable[..., Any],
) -> None:
    proc = run_script(SCRIPT, "--quick", "--rounds", "1", "--setups", "fs", "fs+s3")
    rows = {
        m[1]: (float(m[2]), float(m[3]), m[4], float(m[5]))
        for m in re.finditer(
            r"^(fs|fs\+s3)\s+([\d.]+) x\s+([\d.]+) x\s+(\d+)%\s+([\d.]+) cores$", proc.stdout, re.M
        )
    }
    assert set(rows) == {"fs", "fs+s3"}, proc.stdout
    assert rows["fs"][2] == "100"  # the FS-only setup is its own reference
    assert all(p50 > 0 and p95 > 0 for p50, p95, _, _ in rows.values())
    assert rows["fs+s3"][3] > 0  # SeaweedFS worked while the S3 tier was written
    assert re.search(r"^round 1/1: TTFT p50 speedup fs [\d.]+x, fs\+s3 [\d.]+x$", proc.stdout, re.M)
