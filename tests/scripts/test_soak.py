"""benchmarks/soak: the quick soak (fixed seeds plus a random one, about two minutes) finds no
wrong or foreign bytes, no durable loss, no leak and no crash, with false misses and deadline
overruns under the issue's limits, while real faults were injected of every family."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.weed_server import find_weed
from tests.scripts.conftest import RunJson

FALSE_MISS_LIMIT = 0.001
OVERRUN_LIMIT = 0.0001


@pytest.mark.timeout(280)
def test_quick_soak_finds_nothing_wrong(run_json: RunJson, tmp_path: Path) -> None:
    pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")
    try:
        find_weed()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    # A failing run's reproducer goes to the test's folder, never into the repository.
    out = run_json(
        "-m", "benchmarks.soak", "--quick", "--repro-dir", str(tmp_path), timeout=270
    ).out
    assert isinstance(out["seed"], int)
    assert out["operations"] > 1000
    for name in ("wrong_bytes", "foreign_bytes", "durable_losses", "leaks"):
        assert out[name] == 0, (name, out["runs"])
    assert out["clean_probes"] >= 100  # the false-miss oracle judged real lookups
    assert out["false_miss_rate"] <= FALSE_MISS_LIMIT
    assert out["deadline_overruns"] <= OVERRUN_LIMIT * out["operations"]
    assert out["failures"] == []
    faults = out["faults_injected"]
    for family in ("fs_", "s3_", "proxy_"):
        assert sum(n for kind, n in faults.items() if kind.startswith(family)) > 0, family
    assert faults["sigkill"] > 0
    assert faults.get("fs_eio", 0) > 0
    assert faults.get("fs_hang", 0) > 0
    # Where the soak could mount its tmpfs, the shared folder's disk was full (the ballast).
    if not any("no tmpfs" in note for note in out["notes"]):
        assert faults.get("fs_enospc", 0) > 0
        assert faults.get("fs_disk_full", 0) > 0
