"""The trace replay benchmark on the first requests of the Mooncake trace."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

import kvtier
from benchmarks import replay_trace
from tests.scripts.conftest import RunJson
from tests.scripts.runner import ROOT

TRACE = ROOT / "benchmarks" / "data" / "mooncake_trace_first1000.jsonl"
LIMIT = 200


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return replay_trace


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
def test_cli(run_json: RunJson, tmp_path: Path) -> None:
    png = tmp_path / "hit.png"
    args = (str(TRACE), "--limit", str(LIMIT), "--quick", "--plot", str(png))
    out = run_json("-m", "benchmarks.replay_trace", *args, env={"MPLBACKEND": "Agg"}).out
    assert out["settings"]["requests"] == LIMIT
    hit = out["hit_ratio"]
    assert hit["baseline"] == "infinite"
    assert hit["infinite"]["of_bound"] == 1.0
    bound = hit["infinite"]["ratio"]
    assert 0 < bound <= 1
    assert hit["plain_lru"]["ratio"] <= bound
    assert hit["kvtier"]["ratio"] <= bound
    assert all(row["ratio"] <= bound for row in hit["pool_alone"].values())
    # every hit was served by one tier, and checked byte for byte
    assert sum(row["hits"] for row in hit["served_by"].values()) == hit["kvtier"]["hits"]
    assert out["verified"] == hit["kvtier"]["hits"]
    assert out["checks"]["within_bound"]["ok"] is True
    assert out["whole_trace"] is False
    for overhead in out["overhead_us"].values():  # a request's time includes its lookup
        assert 0 <= overhead["lookup"]["mean"] <= overhead["request"]["mean"]
        assert overhead["request"]["p50"] <= overhead["request"]["p99"]
    assert out["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
