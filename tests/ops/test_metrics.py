"""The Prometheus exporter: a real manager, a real registry, a real HTTP scrape."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

import anyio
import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvtier import (
    AdmissionPolicy,
    CorruptBlockError,
    CostModel,
    ExtraNotInstalledError,
    HostPool,
    InvalidArgumentError,
    KVTierCollector,
    LatencyHistograms,
    LookupResult,
    MemoryTier,
    OffloadScheduler,
    TierStatistics,
    metrics_asgi_app,
    serve_metrics,
)
from kvtier.manager import TieringManager
from kvtier.testing import FailingTier
from kvtier.tiers.s3 import S3TierStatistics

BLOCK = 4096


def key() -> bytes:
    return b"\x01" + os.urandom(15)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and sorted labels, parsed back from the text."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_collector_reads_manager_pool_and_tiers_at_scrape_time() -> None:
    memory = MemoryTier("disk")
    in_tier = key()
    await memory.store(in_tier, memoryview(os.urandom(BLOCK)))
    manager = TieringManager(HostPool(4, BLOCK), [memory])
    registry = CollectorRegistry()
    KVTierCollector(manager).register(registry)
    stored = [key(), key()]
    async with manager:
        assert await manager.store(stored, np.zeros((2, BLOCK), np.uint8)) == 2
        await manager.wait_idle()  # write-through to the tier
        assert manager.lookup(stored[0]) is LookupResult.HIT
        assert manager.lookup(key()) is LookupResult.MISS  # in no tier
        assert manager.lookup(in_tier) is LookupResult.RETRY  # promotion starts
        assert manager.lookup(in_tier) is LookupResult.HIT_PENDING
        await manager.wait_idle()
        assert manager.lookup(in_tier) is LookupResult.HIT
        out = np.empty((1, BLOCK), np.uint8)
        assert await manager.load([stored[1]], out) == 1
        got = samples(registry)

    def v(name: str, **labels: str) -> float:
        return got[name, tuple(sorted(labels.items()))]

    assert v("kvtier_lookups_total", result="hit") == 2
    assert v("kvtier_lookups_total", result="hit_pending") == 1
    assert v("kvtier_lookups_total", result="retry") == 1
    assert v("kvtier_lookups_total", result="miss") == 1
    assert v("kvtier_misses_total", reason="not_found") == 1
    assert v("kvtier_promotions_total", outcome="started") == 1
    assert v("kvtier_promotions_total", outcome="succeeded") == 1
    assert v("kvtier_promotions_total", outcome="failed") == 0
    assert v("kvtier_blocks_stored_total") == 2
    assert v("kvtier_blocks_loaded_total") == 1
    assert v("kvtier_write_through_total", outcome="succeeded") == 2
    assert v("kvtier_in_flight_bytes") == 0
    assert v("kvtier_background_tasks") == 0
    assert v("kvtier_pool_blocks", state="ready") == 3
    assert v("kvtier_pool_blocks", state="free") == 1
    assert v("kvtier_pool_capacity_bytes") == 4 * BLOCK
    assert v("kvtier_pool_commits_total") == 3
    assert v("kvtier_tier_lookups_total", tier="disk", result="hit") == 1
    assert v("kvtier_tier_lookups_total", tier="disk", result="miss") == 1
    assert v("kvtier_tier_misses_total", tier="disk", reason="not_found") == 1
    assert v("kvtier_tier_operations_total", tier="disk", op="store") == 3
    assert v("kvtier_tier_operations_total", tier="disk", op="load") == 1
    assert v("kvtier_tier_read_bytes_total", tier="disk") == BLOCK
    assert v("kvtier_tier_loads_on_loop_total", tier="disk") == 0  # a memory tier never does
    assert v("kvtier_tier_written_bytes_total", tier="disk") == 3 * BLOCK
    assert v("kvtier_tier_blocks", tier="disk") == 3
    assert v("kvtier_tier_stored_bytes", tier="disk") == 3 * BLOCK
    assert ("kvtier_tier_read_seconds_total", (("tier", "disk"),)) in got
    # The text itself, as a scraper sees it: typed families with help.
    text = generate_latest(registry).decode()
    assert "# TYPE kvtier_lookups_total counter" in text
    assert "# TYPE kvtier_pool_blocks gauge" in text
    assert 'kvtier_tier_misses_total{reason="not_found",tier="disk"} 1.0' in text


async def test_promotion_failures_and_scheduler_counters() -> None:
    inner = MemoryTier("inner")
    k = key()
    await inner.store(k, memoryview(os.urandom(BLOCK)))
    tier = FailingTier(inner, name="flaky")
    tier.fail("load", error=CorruptBlockError)
    manager = TieringManager(HostPool(2, BLOCK), [tier])
    scheduler = OffloadScheduler(manager)
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager, scheduler=scheduler))
    async with manager:
        assert await scheduler.lookup([k], timeout=5.0) == 0
        await manager.wait_idle()
        got = samples(registry)
    assert got["kvtier_promotions_total", (("outcome", "failed"),)] == 1
    assert got["kvtier_promotion_failures_total", (("reason", "corrupt"),)] == 1
    assert got["kvtier_tier_misses_total", (("reason", "corrupt"), ("tier", "flaky"))] == 1
    assert got["kvtier_scheduler_async_lookups_total", ()] == 1
    assert got["kvtier_scheduler_waits_total", ()] >= 1
    assert got["kvtier_scheduler_timeouts_total", ()] == 0


@dataclass(frozen=True, slots=True)
class _RemoteStatistics(TierStatistics):
    breaker_state: str = "open"
    retries: int = 7
    conditional_put: bool = False


class _RemoteTier(MemoryTier):
    """A tier whose statistics add fields, as S3Tier's do."""

    def statistics(self) -> TierStatistics:
        s = super().statistics()
        return _RemoteStatistics(name=s.name, lookups=s.lookups, blocks=s.blocks)


async def test_tier_extras_and_duplicate_names() -> None:
    manager = TieringManager(HostPool(2, BLOCK), [_RemoteTier("t"), MemoryTier("t")])
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager, namespace="engine_kv"))
    got = samples(registry)
    assert got["engine_kv_tier_breaker_state", (("breaker_state", "open"), ("tier", "t"))] == 1
    assert got["engine_kv_tier_retries", (("tier", "t"),)] == 7
    assert got["engine_kv_tier_conditional_put", (("tier", "t"),)] == 0
    assert got["engine_kv_tier_blocks", (("tier", "t"),)] == 0
    assert got["engine_kv_tier_blocks", (("tier", "t#2"),)] == 0
    assert not any(name.startswith("kvtier_") for name, _ in got)


async def test_latency_histograms() -> None:
    latency = LatencyHistograms(buckets=(0.001, 0.01, 1.0))
    manager = TieringManager(HostPool(2, BLOCK), [MemoryTier()])
    scheduler = OffloadScheduler(manager)
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager, latency=latency))
    async with manager:
        with latency.time_lookup():
            assert await scheduler.lookup([key()], timeout=1.0) == 0
    latency.observe_promotion("disk", 0.005, ok=True)
    latency.observe_promotion("disk", 0.5, ok=True)
    latency.observe_promotion("disk", 30.0, ok=False)
    latency.observe_lookup(0.0005)
    got = samples(registry)
    assert got["kvtier_lookup_seconds_count", ()] == 2
    assert got["kvtier_lookup_seconds_bucket", (("le", "+Inf"),)] == 2
    assert got["kvtier_lookup_seconds_bucket", (("le", "0.001"),)] >= 1
    ok = (("outcome", "succeeded"), ("tier", "disk"))
    assert got["kvtier_promotion_seconds_bucket", (("le", "0.001"), *ok)] == 0
    assert got["kvtier_promotion_seconds_bucket", (("le", "0.01"), *ok)] == 1
    assert got["kvtier_promotion_seconds_bucket", (("le", "1.0"), *ok)] == 2
    assert got["kvtier_promotion_seconds_sum", ok] == pytest.approx(0.505)
    failed = (("outcome", "failed"), ("tier", "disk"))
    assert got["kvtier_promotion_seconds_bucket", (("le", "1.0"), *failed)] == 0
    assert got["kvtier_promotion_seconds_bucket", (("le", "+Inf"), *failed)] == 1
    assert "promotions=3" in repr(latency)


@pytest.mark.parametrize("buckets", [(), (1.0, 0.5), (0.0, 1.0), (1.0, float("inf"))])
def test_latency_buckets_are_validated(buckets: tuple[float, ...]) -> None:
    with pytest.raises(InvalidArgumentError):
        LatencyHistograms(buckets)


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    manager = TieringManager(HostPool(1, BLOCK))
    with pytest.raises(ExtraNotInstalledError, match=r"kvtier\[metrics\]") as info:
        KVTierCollector(manager)
    assert "prometheus_client" in str(info.value)
    with pytest.raises(ExtraNotInstalledError):
        serve_metrics(manager, 0)
    LatencyHistograms().observe_lookup(0.1)  # the hooks need no extra


def test_bad_arguments() -> None:
    manager = TieringManager(HostPool(1, BLOCK))
    with pytest.raises(InvalidArgumentError, match="namespace"):
        KVTierCollector(manager, namespace="kv tier")
    with pytest.raises(InvalidArgumentError, match="port"):
        serve_metrics(manager, 70000)


async def test_serve_metrics_over_http() -> None:
    manager = TieringManager(HostPool(2, BLOCK), [MemoryTier("disk")])
    async with manager, serve_metrics(manager, 0) as server:
        assert server.port > 0 and server.url.startswith("http://127.0.0.1:")
        manager.lookup(key())
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(server.url)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert 'kvtier_lookups_total{result="miss"} 1.0' in response.text
            assert 'kvtier_tier_blocks{tier="disk"} 0.0' in response.text
            open_metrics = await client.get(
                server.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
            )
            assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
            assert open_metrics.text.endswith("# EOF\n")
            head = await client.head(server.url)
            assert head.status_code == 200 and head.content == b""
            assert (await client.get(server.url.replace("/metrics", "/nope"))).status_code == 404
            assert (await client.post(server.url, content=b"x")).status_code == 405
        assert server.scrapes == 3
        assert "serving" in repr(server)
        # A client that connects and says nothing does not hold up the server.
        async with await anyio.connect_tcp("127.0.0.1", server.port) as idle:
            async with httpx.AsyncClient(timeout=10.0) as client:
                assert (await client.get(server.url)).status_code == 200
            del idle
    assert "closed" in repr(server)
    with pytest.raises(OSError):
        await anyio.connect_tcp("127.0.0.1", server.port)


async def test_serve_metrics_into_a_given_registry() -> None:
    manager = TieringManager(HostPool(2, BLOCK))
    registry = CollectorRegistry()
    async with serve_metrics(manager, 0, registry=registry) as server:
        assert server.registry is registry
        assert samples(registry)["kvtier_pool_blocks", (("state", "free"),)] == 2


async def test_metrics_server_aclose_is_idempotent() -> None:
    manager = TieringManager(HostPool(2, BLOCK))
    async with serve_metrics(manager, 0) as server:
        await server.aclose()  # stops serving before the block ends
        assert "closed" in repr(server)
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", server.port)
        await server.aclose()  # a second close, then leaving the block, do nothing
    assert "closed" in repr(server)


class _ThreadOf:
    """A collector that records which thread collects it."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self) -> list[Metric]:
        self.threads.append(threading.get_ident())
        return []


async def test_metrics_server_collects_on_the_loop_and_joins_its_threads() -> None:
    manager = TieringManager(HostPool(2, BLOCK))
    registry = CollectorRegistry()
    spy = _ThreadOf()
    registry.register(spy)
    async with manager, serve_metrics(manager, 0, registry=registry) as server:
        serving = [t for t in threading.enumerate() if t.name.startswith("kvtier-metrics")]
        assert serving and not any(t.daemon for t in serving)
        async with httpx.AsyncClient(timeout=10.0) as client:
            assert (await client.get(server.url)).status_code == 200
    assert spy.threads == [threading.get_ident()]  # the loop's thread, not the server's
    assert not any(t.is_alive() for t in serving)


async def test_metrics_asgi_app() -> None:
    manager = TieringManager(HostPool(2, BLOCK), [MemoryTier("disk")])
    app = metrics_asgi_app(manager)
    async with manager:
        manager.lookup(key())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvtier") as client:
            response = await client.get("/metrics")
            open_metrics = await client.get(
                "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
            )
    assert response.status_code == 200
    assert 'kvtier_lookups_total{result="miss"} 1.0' in response.text
    assert open_metrics.text.endswith("# EOF\n")


async def test_cost_model_and_admission_are_exported() -> None:
    inner = MemoryTier("remote")
    k = key()
    await inner.store(k, memoryview(os.urandom(BLOCK)))
    cost = CostModel(recompute_seconds_per_block=0.002)
    policy = AdmissionPolicy(max_write_latency=0.5)
    manager = TieringManager(HostPool(4, BLOCK), [inner], cost=cost, admission=policy)
    scheduler = OffloadScheduler(manager)
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager, scheduler=scheduler))
    async with manager:
        assert await scheduler.lookup([k], timeout=5.0) == 1  # one promotion: measured
        policy.observe_write_latency("remote", 3.0)  # a write that took 3 s: admission closes
        await manager.store([key()], np.zeros((1, BLOCK), np.uint8))  # a probe
        await manager.store([key()], np.zeros((1, BLOCK), np.uint8))  # dropped
        await manager.wait_idle()
        got = samples(registry)
    assert got["kvtier_recompute_seconds_per_block", ()] == pytest.approx(0.002)
    assert got["kvtier_tier_promotion_latency_seconds", (("tier", "remote"),)] > 0
    assert got["kvtier_tier_promotion_throughput_bytes_per_second", (("tier", "remote"),)] > 0
    assert got["kvtier_tier_promotions_declined_total", (("tier", "remote"),)] == 0
    assert got["kvtier_tier_writes_dropped_total", (("cause", "latency"), ("tier", "remote"))] == 1
    assert got["kvtier_tier_write_closed", (("tier", "remote"),)] == 1
    assert got["kvtier_tier_writes_admitted_total", (("tier", "remote"),)] == 1
    assert got["kvtier_scheduler_waits_cut_total", ()] == 0
    assert got["kvtier_promotions_not_started_total", (("why", "declined"),)] == 0


class _BrokenObserver:
    """A latency observer with a bug: each call raises."""

    def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None:
        raise RuntimeError("observer bug")

    def observe_lookup(self, seconds: float) -> None:
        raise RuntimeError("observer bug")


async def test_contained_callback_and_listener_failures_are_exported() -> None:
    disk = MemoryTier("disk")
    k = key()
    await disk.store(k, memoryview(os.urandom(BLOCK)))
    observer = _BrokenObserver()
    manager = TieringManager(HostPool(4, BLOCK), [disk, MemoryTier("other")], latency=observer)
    scheduler = OffloadScheduler(manager, latency=observer)
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager, scheduler=scheduler))

    def broken_listener(changed: bytes) -> None:
        raise RuntimeError("listener bug")

    async with manager:
        remove = disk.add_listener(broken_listener)
        assert await scheduler.lookup([k], timeout=5.0) == 1  # one promotion, one lookup
        assert await manager.store([key()], np.zeros((1, BLOCK), np.uint8)) == 1
        await manager.wait_idle()  # write-through: each tier notifies its listeners
        remove()
        got = samples(registry)
    assert got["kvtier_callback_failures_total", ()] == 1  # the promotion's observer call
    assert got["kvtier_scheduler_callback_failures_total", ()] == 1  # the lookup's
    assert got["kvtier_tier_listener_failures_total", (("tier", "disk"),)] == 1
    assert got["kvtier_tier_listener_failures_total", (("tier", "other"),)] == 0


class _IndexedTier(MemoryTier):
    """A tier that reports S3TierStatistics, with the figures an S3 tier keeps."""

    def statistics(self) -> TierStatistics:
        s = super().statistics()
        return S3TierStatistics(
            name=s.name,
            lookups=s.lookups,
            request_path_requests=3,
            breaker_state="half_open",
            lookup_mode="index",
            index_keys=1234,
            index_listing_complete=True,
            index_refreshes=9,
            journal_segments_published=5,
            journal_segments_read=11,
        )


async def test_s3_index_statistics_are_exported() -> None:
    manager = TieringManager(HostPool(2, BLOCK), [MemoryTier("disk"), _IndexedTier("s3")])
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager))
    got = samples(registry)
    s3 = (("tier", "s3"),)
    assert got["kvtier_tier_request_path_requests_total", s3] == 3
    assert got["kvtier_tier_request_path_requests_total", (("tier", "disk"),)] == 0
    assert got["kvtier_tier_index_keys", s3] == 1234
    assert got["kvtier_tier_index_listing_complete", s3] == 1
    assert got["kvtier_tier_index_refreshes", s3] == 9
    assert got["kvtier_tier_journal_segments_published", s3] == 5
    assert got["kvtier_tier_journal_segments_read", s3] == 11
    assert got["kvtier_tier_breaker_state", (("breaker_state", "half_open"), *s3)] == 1
    assert got["kvtier_tier_lookup_mode", (("lookup_mode", "index"), *s3)] == 1
    assert ("kvtier_tier_index_keys", (("tier", "disk"),)) not in got  # not an S3 tier


async def test_deferred_writes_promotions_written_up_and_rate_drops_are_exported() -> None:
    """A remote tier paced to one block per second defers what it cannot take; each deferred
    write ends written (copied from the disk tier) or lost; a block promoted from the remote
    tier is written up to the disk."""
    now = [0.0]
    disk, remote = MemoryTier("disk"), MemoryTier("remote")
    in_remote = key()
    await remote.store(in_remote, memoryview(os.urandom(BLOCK)))
    policy = AdmissionPolicy(
        deferred=["remote"], max_write_rate={"remote": BLOCK}, clock=lambda: now[0]
    )
    manager = TieringManager(HostPool(4, BLOCK), [disk, remote], admission=policy)
    registry = CollectorRegistry()
    registry.register(KVTierCollector(manager))
    first, second, third, fourth = (key() for _ in range(4))
    async with manager:
        got = samples(registry)
        # every cause has a series from the start
        for cause in ("in_flight", "latency", "rate", "unavailable"):
            labels = (("cause", cause), ("tier", "disk"))
            assert got["kvtier_tier_writes_dropped_total", labels] == 0
        assert manager.lookup(in_remote) is LookupResult.RETRY  # promoted into the pool
        await manager.wait_idle()
        # One block fits the remote tier's budget; the other two wait for it.
        assert await manager.store([first, second, third], np.zeros((3, BLOCK), np.uint8)) == 3
        await manager.wait_idle()
        await disk.delete(second)  # no faster tier holds it any more: its deferred write is lost
        now[0] = 1.0  # one more block's worth of budget
        # The pool is full: this store evicts the promoted block, which is written up then.
        assert await manager.store([fourth], np.zeros((1, BLOCK), np.uint8)) == 1
        await manager.wait_idle()
        got = samples(registry)
        assert disk.lookup(in_remote) is LookupResult.HIT
        assert remote.lookup(third) is LookupResult.HIT  # the deferred write, copied from disk

    remote_rate = (("cause", "rate"), ("tier", "remote"))
    assert got["kvtier_tier_writes_dropped_total", remote_rate] == 3  # second, third, fourth
    assert got["kvtier_deferred_writes_total", (("outcome", "queued"),)] == 3
    assert got["kvtier_deferred_writes_total", (("outcome", "written"),)] == 1  # third
    assert got["kvtier_deferred_writes_total", (("outcome", "lost"),)] == 1  # second
    assert got["kvtier_deferred_writes_pending", ()] == 1  # fourth
    assert got["kvtier_write_ups_waiting", ()] == 0  # the promoted block was evicted, copied
    assert got["kvtier_promotions_written_up_total", ()] == 1
