"""benchmarks/bench_s3_packs.py: a request's blocks stored and loaded raw, one object per
block through the tier, and in packs, on a real SeaweedFS (a short round here)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_s3_packs.py"


@pytest.mark.timeout(300)
def test_packs_send_one_request_per_group_of_blocks(run_script: Callable[..., Any]) -> None:
    proc = run_script(SCRIPT, "--quick")
    rows = {
        m[1]: (int(m[2]), int(m[3]))
        for m in re.finditer(
            r"^  (raw|tier, 1 per object|tier, packs)\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)\s",
            proc.stdout,
            re.M,
        )
    }
    # 4 requests of 8 blocks: one PUT and one GET per block, except in packs: one per request.
    assert rows == {"raw": (32, 32), "tier, 1 per object": (32, 32), "tier, packs": (4, 4)}
    assert len(re.findall(r"x\s+[\d.]+x\s+of raw$", proc.stdout, re.M)) == 2, proc.stdout
