"""The trace replay benchmark on the first requests of the Mooncake trace."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType
from typing import Any

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
    assert bench.lru_hits(requests, 10**9, tail_first=True) == infinite
    for size in (16, 64, 256):  # the offline reference keeps at least what LRU keeps
        assert bench.min_hits(requests, size) >= bench.lru_hits(requests, size)
    assert bench.min_hits(requests, 10**9) == infinite


def test_tail_first_keeps_the_head_of_a_chain(bench: ModuleType) -> None:
    """Two chains through a pool that holds one and a half: touched head first, LRU drops the
    heads of the older chain; touched tail first, its tail goes and its head still hits."""
    a = [bench.key_of(i) for i in range(4)]
    b = [bench.key_of(100 + i) for i in range(2)]
    requests = [a, b, a]
    assert bench.lru_hits(requests, 5) == 0
    assert bench.lru_hits(requests, 5, tail_first=True) == 3


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
    assert result.stats.writes.dropped == 0  # however busy the machine, every block was written
    assert result.hits_by_tier["fs"] > 0  # the pool is too small: the file tier served some
    assert result.hits > bench.lru_hits(requests, 256)  # and that beats the pool alone ...
    assert result.hits == infinite  # ... up to the bound: the file tier holds every block
    assert len(result.lookup_us) == len(result.request_us) == LIMIT
    assert all(0 <= a <= b for a, b in zip(result.lookup_us, result.request_us, strict=True))
    stats = result.stats
    assert stats is not None
    assert stats.promotions.succeeded >= result.hits_by_tier["fs"]
    assert not stats.promotions.failed_by_reason
    assert stats.background.tasks == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
async def test_replay_pool_alone(
    bench: ModuleType, requests: list[list[bytes]], policy: str
) -> None:
    result = await bench.replay(requests, primary_blocks=128, policy=policy, progress=False)
    requested = sum(len(r) for r in requests)
    assert result.hits <= bench.infinite_hits(requests)
    assert result.hits_by_tier == {"primary": result.hits}
    if policy == "lru":  # the pool under LRU is a tail-first LRU cache (up to how present
        # keys age, and a store never evicts its own chain's head)
        assert abs(result.hits - bench.lru_hits(requests, 128, tail_first=True)) <= 0.01 * requested
        assert result.hits >= bench.lru_hits(requests, 128)


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
    assert hit["plain_lru"]["ratio"] <= hit["min"]["ratio"] <= bound
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
    assert len(out["sweep"]) == len(bench_shares := replay_trace.SWEEP_QUICK)
    for point in out["sweep"]:
        assert point["plain_lru"] <= point["min"]
        assert set(point["pool"]) == {"lru", "arc"}
    assert bench_shares[-1] == 1.0  # the last size holds every block: nothing is evicted
    assert out["sweep"][-1]["pool"]["lru"] == hit["infinite"]["hits"]
    for check in ("default_vs_tail_first", "default_vs_lru", "sweep_vs_tail_first"):
        assert isinstance(out["checks"][check]["ok"], bool)


@pytest.mark.timeout(300)
def test_cli_agent_workload(run_json: RunJson) -> None:
    args = ("--agent", "--agent-sessions", "3", "--fs-tokens", "0", "--sweep", "--quick")
    out = run_json("-m", "benchmarks.replay_trace", *args).out
    assert out["settings"]["trace"] == "agent(sessions=3, seed=0)"
    # the sessions' turns reuse their previous prompt: most of it is a prefix hit
    assert out["hit_ratio"]["infinite"]["ratio"] > 0.8
    for point in out["sweep"]:
        assert point["pool"]["lru"] >= point["plain_lru"]


def test_agent_trace_shape() -> None:
    from benchmarks import agent_trace

    workload = agent_trace.AgentWorkload(sessions=4, seed=7)
    rows = agent_trace.generate(workload)
    assert rows == agent_trace.generate(workload)  # seeded
    assert rows != agent_trace.generate(agent_trace.AgentWorkload(sessions=4, seed=8))
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    assert 4 * 20 <= len(rows) <= 4 * 100
    sessions: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        sessions.setdefault(row["session"], []).append(row)
    assert len(sessions) == 4
    for turns in sessions.values():
        assert 20 <= len(turns) <= 100
        for before, after in itertools.pairwise(turns):
            # the previous prompt and answer plus 1-4K new tokens; its full blocks are kept
            grown = after["input_length"] - before["input_length"] - before["output_length"]
            assert 1_000 <= grown <= 4_000
            full = before["input_length"] // 512
            assert after["hash_ids"][:full] == before["hash_ids"][:full]
            assert 2_000 <= after["timestamp"] - before["timestamp"] <= 300_000
    longest = max(r["input_length"] for r in rows)
    assert longest > 100_000
    summary = agent_trace.summary(rows)
    assert summary["requests"] == len(rows)
    assert summary["blocks_distinct"] < summary["blocks_requested"]


@pytest.mark.timeout(300)
def test_cli_session_hints(run_json: RunJson) -> None:
    args: tuple[str, ...] = ("--agent", "--session-hints", "--quick", "--agent-sessions", "6")
    args += ("--primary-tokens", "200k", "--tier-model", "fs:0.5:3000")
    out = run_json("-m", "benchmarks.replay_trace", *args).out
    sessions = out["sessions"]
    assert 0 <= sessions["hit_ratio_without_hints"] <= sessions["hit_ratio_ceiling"] <= 1
    assert set(sessions["tiers"]) == {"fs"}
    for mode in ("predicted", "predicted_no_retention", "return_hinted"):
        figures = sessions["tiers"]["fs"][mode]
        for name in ("hidden_fraction", "waste", "hit_ratio_with_hints", "bytes_promoted"):
            assert isinstance(figures[name], int | float)
        assert set(figures["checks"]) == {
            "hidden_at_least_0",
            "hit_ratio_at_least_without_hints",
            "hidden_at_least_90pct",
            "waste_at_most_10pct",
            "hit_ratio_within_2_points_of_ceiling",
        }
