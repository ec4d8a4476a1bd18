"""The trace replay benchmark on the first requests of the Mooncake trace."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import kvtier

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "benchmarks" / "data" / "mooncake_trace_first1000.jsonl"
SCRIPT = REPO / "benchmarks" / "replay_trace.py"
LIMIT = 200


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_bench_replay_trace", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def requests(bench: ModuleType) -> list[list[bytes]]:
    return bench.load_trace(TRACE, LIMIT)  # type: ignore[no-any-return]


def test_trace_keys(bench: ModuleType, requests: list[list[bytes]]) -> None:
    assert len(requests) == LIMIT
    assert all(len(k) == 16 for r in requests for k in r)
    assert bench.key_of(7) == bench.key_of(7) != bench.key_of(8)


def test_references(bench: ModuleType, requests: list[list[bytes]]) -> None:
    requested = sum(len(r) for r in requests)
    infinite = bench.infinite_hits(requests)
    assert 0 < infinite < requested
    small, large = bench.lru_hits(requests, 64), bench.lru_hits(requests, 10**9)
    assert small <= large == infinite


async def test_replay_with_fs_tier(
    bench: ModuleType, requests: list[list[bytes]], tmp_path: Path
) -> None:
    payload = 64
    tier = kvtier.FSTier(
        tmp_path, capacity_bytes=bench.fs_capacity_bytes(100_000, payload), fsync="never"
    )
    result = await bench.replay(
        requests,
        primary_blocks=256,
        policy="arc",
        tiers=[tier],
        payload_bytes=payload,
        progress=False,
    )
    requested = sum(len(r) for r in requests)
    infinite = bench.infinite_hits(requests)
    assert result.requested == requested
    assert result.hits <= infinite
    assert result.verified == result.hits  # every served block was checked byte for byte
    assert sum(result.hits_by_tier.values()) == result.hits
    assert result.stats.cascades_dropped == 0  # however busy the machine, every block was written
    assert result.hits_by_tier["fs"] > 0  # the pool is too small: the file tier served some
    assert result.hits > bench.lru_hits(requests, 256)  # and that beats the pool alone ...
    assert result.hits == infinite  # ... up to the bound: the file tier holds every block
    assert len(result.lookup_us) == len(result.request_us) == LIMIT
    assert all(0 <= a <= b for a, b in zip(result.lookup_us, result.request_us, strict=True))
    stats = result.stats
    assert stats is not None
    assert stats.promotions_succeeded >= result.hits_by_tier["fs"]
    assert not stats.promotions_failed_by_reason
    assert stats.background_tasks == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
async def test_replay_pool_alone(
    bench: ModuleType, requests: list[list[bytes]], policy: str
) -> None:
    result = await bench.replay(requests, primary_blocks=128, policy=policy, progress=False)
    requested = sum(len(r) for r in requests)
    assert result.hits <= bench.infinite_hits(requests)
    assert result.hits_by_tier == {"primary": result.hits}
    if policy == "lru":  # the pool under LRU is a plain LRU cache, up to how present keys age
        assert abs(result.hits - bench.lru_hits(requests, 128)) <= 0.01 * requested


@pytest.mark.timeout(300)
def test_cli(tmp_path: Path) -> None:
    png = tmp_path / "hit.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(TRACE),
            "--limit",
            str(LIMIT),
            "--quick",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONWARNINGS": "error", "MPLBACKEND": "Agg"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    ratios = {}
    for name in ("infinite cache", "plain LRU", "kvtier pool"):
        m = re.search(rf"^  {name}.*?([\d,]+)\s+([\d.]+)%\s+([\d.]+)%$", out, re.M)
        assert m, out
        ratios[name] = float(m[2])
    assert ratios["plain LRU"] <= ratios["infinite cache"]
    assert ratios["kvtier pool"] <= ratios["infinite cache"]
    assert "check PASS: no run beats the infinite bound" in out
    assert re.search(r"lookup \+ load \+ store\s+\d+\s+\d+\s+\d+", out), out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
