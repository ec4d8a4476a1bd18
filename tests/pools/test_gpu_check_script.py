"""``benchmarks.gpu_check`` without a GPU: every part imports, the dry run reports each section
in the shape a real run does, and a machine without a GPU gets a clean SKIPPED (exit 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_check_probes, gpu_check_sizes
from kvtier import cuda_available

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_dry_run_reports_every_section_in_the_shape_of_a_real_run() -> None:
    proc = _run("--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["dry_run"] is True
    assert result["sections"] == list(gpu_check.SECTIONS)
    for section in gpu_check.SECTIONS:
        assert section in result
    assert set(result["probes"]) == set(gpu_check_probes.PROBES)
    assert result["sizes"]["block_bytes"] == list(gpu_check_sizes.SIZES)
    assert min(gpu_check_sizes.SIZES) == 16 << 10
    assert max(gpu_check_sizes.SIZES) == 2 << 20


def test_the_options_parse() -> None:
    args = gpu_check.parse(["--no-tests", "--blocks", "8", "--repeats", "1", "--json"])
    assert (args.no_tests, args.blocks, args.repeats, args.json) == (True, 8, 1, True)
    assert args.budget < 8 * 60


@pytest.mark.skipif(cuda_available()[0], reason="a CUDA GPU is visible")
def test_without_a_gpu_it_says_skipped_and_exits_cleanly() -> None:
    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["skipped"]
    assert result["ok"] is False
    plain = _run()
    assert plain.returncode == 0
    assert plain.stdout.startswith("SKIPPED")
