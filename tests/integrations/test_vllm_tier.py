"""kvtier's tiers behind vLLM's own tiering code, on a CPU-only machine (`nox -s vllm`).

Nothing of vLLM is mocked: each test builds vLLM's ``TieringOffloadingSpec`` from a real
``OffloadingConfig``; its ``get_manager()`` creates the CPU primary tier (a shared-memory
region), asks vLLM's ``SecondaryTierFactory`` for the kvtier tier by ``module_path`` and wraps
both in vLLM's ``TieringOffloadingManager``. The ``Engine`` helper below then calls that
manager the way vLLM's offloading connector does in a step (lookup, prepare/complete store,
prepare/complete load, on_schedule_end) and writes and reads the primary slots the way vLLM's
GPU worker does. Waiting is on the adapter's change counter, never a sleep.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvtier
from devtools.weed_server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, WeedServer
from kvtier.testing import FailingTier, StallingTier
from tests.support import vllm_imports

with vllm_imports("vllm.v1.kv_offload.tiering.spec"):
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadKey,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.integrations.vllm import KVTierSecondaryTier

BLOCK = 64 << 10  # a chunk of the primary tier, page aligned as vLLM requires
ROOT = Path(__file__).resolve().parents[2]
MODULE = "kvtier.integrations.vllm"
WAIT = 30.0  # generous bound on a promised deadline, not a timing assertion


# A single-GPU engine whose bytes vLLM calls parallelism-agnostic.
PARALLEL: dict[str, Any] = (
    dict.fromkeys(("rank", "data_parallel_index"), 0)
    | dict.fromkeys(("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size"), 1)
    | {"data_parallel_size": 1, "data_parallel_rank_local": None, "is_parallelism_agnostic": True}
)


def make_manager(
    tier_config: dict[str, Any],
    *,
    num_chunks: int = 32,
    model: str = "kvtier/test-model",
    parallel: dict[str, Any] | None = None,
    **change: Any,
) -> TieringOffloadingManager:
    """vLLM's own spec -> factory -> manager path, with ``tier_config`` as its one tier;
    ``parallel`` changes fields of the parallel config, ``change`` those of the config."""
    parts: dict[str, Any] = {
        "groups": (OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        "worker_kv_bytes_per_block": BLOCK,
        "enable_kv_cache_events": False,
        "extra_config": {
            "cpu_bytes_to_use": num_chunks * BLOCK,
            "secondary_tiers": [tier_config],
            "tier_poll_interval_s": 0,
        },
        "engine_id": f"kvtier-test-{uuid.uuid4().hex[:12]}",
        "model": OffloadingModelConfig(name=model, dtype="float16"),
        "cache": OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        "parallel": OffloadingParallelConfig(**(PARALLEL | (parallel or {}))),
    }
    manager = TieringOffloadingSpec(OffloadingConfig(**(parts | change))).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def kvtier_tier(**settings: Any) -> dict[str, Any]:
    return {"type": "kvtier", "module_path": MODULE, **settings}


class Engine:
    """Drives a TieringOffloadingManager the way vLLM's scheduler and worker do."""

    def __init__(self, manager: TieringOffloadingManager) -> None:
        self.manager = manager
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KVTierSecondaryTier)
        self.tier = tier
        self.flat: memoryview = manager.primary_tier.get_kv_memoryview().cast("B")
        self._requests = 0

    def slot(self, chunk_id: int) -> memoryview:
        return self.flat[chunk_id * BLOCK : (chunk_id + 1) * BLOCK]

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def step_until(self, done: Callable[[], bool]) -> None:
        """Step the engine until ``done()``, waiting on the tier's changes in between."""
        bridge = self.tier.bridge
        for _ in range(1000):
            seen = bridge.generation
            if done():
                return
            self.step()
            if done():
                return
            bridge.wait_for_change(seen, WAIT)
        raise AssertionError("the engine made no progress")

    def store(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> None:
        """GPU -> primary (written here, as the worker would) -> cascade to the kvtier tier."""
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.slot(int(chunk))[:] = payloads[list(keys).index(key)]
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)

    def settle(self) -> None:
        self.step_until(lambda: not self.manager.has_pending_work())

    def lookup_all(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """Look every key up until none is RETRY or HIT_PENDING, stepping as vLLM does."""
        results: list[LookupResult] = []

        def resolved() -> bool:
            results[:] = [self.manager.lookup(k, ctx) for k in keys]
            return all(r in (LookupResult.HIT, LookupResult.MISS) for r in results)

        self.step_until(resolved)
        return results

    def known(self, keys: Sequence[OffloadKey]) -> None:
        """Wait until the kvtier tier itself has a verdict for every key (asked directly, so
        nothing is promoted): the next manager pass then promotes them in one job."""
        ctx = ReqContext(req_id="existence")
        self.step_until(
            lambda: all(self.tier.lookup(k, ctx) is not LookupResult.RETRY for k in keys)
        )

    def read(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bytes]:
        """Primary -> GPU: the bytes the worker would copy for ``keys``."""
        spec = self.manager.prepare_load(keys, ctx)
        data = [bytes(self.slot(int(c))) for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return data

    def shutdown(self) -> None:
        self.flat.release()
        self.manager.shutdown()


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    """Makes engines (a fresh one is a restart) and shuts down what a test leaves open."""
    made: list[Engine] = []

    def make(tier_config: dict[str, Any], **kwargs: Any) -> Engine:
        engine = Engine(make_manager(tier_config, **kwargs))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.tier.bridge.statistics().state != "closed":
            engine.shutdown()


def offload_keys(n: int, *, seed: bytes | None = None) -> list[OffloadKey]:
    seed = seed if seed is not None else os.urandom(8)
    return [make_offload_key(seed + i.to_bytes(4, "big") + bytes(20), 0) for i in range(n)]


def payloads(n: int) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and re.fullmatch(r"[0-9a-f]{32}", p.name)]


# -- the FS tier ----------------------------------------------------------------------------


def test_store_cascades_to_fs_and_a_restart_promotes_it(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    config = kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)}, namespace="m")
    keys, data = offload_keys(6), payloads(6)

    first = engines(config)
    first.store(keys, data)
    first.settle()
    assert len(block_files(tmp_path)) == 6  # cascaded to kvtier's FS tier, one file a block
    assert first.tier.statistics().tier.stores == 6  # type: ignore[union-attr]
    first.shutdown()

    again = engines(config)  # a restart: an empty primary tier over the same folder
    ctx = again.request()
    assert again.manager.lookup(keys[0], ctx) is LookupResult.RETRY  # check in flight
    assert again.lookup_all(keys, ctx) == [LookupResult.HIT] * 6
    assert again.read(keys, ctx) == data
    stats = again.tier.statistics()
    assert stats.tier is not None and stats.tier.loads == 6
    assert stats.retries >= 1 and stats.hits >= 6


def test_namespace_keeps_models_apart_and_keys_are_shared(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    keys, data = offload_keys(3), payloads(3)
    llama = kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)}, namespace="llama")
    writer = engines(llama)
    writer.store(keys, data)
    writer.settle()

    other = engines(kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)}, namespace="qwen"))
    assert other.lookup_all(keys, other.request()) == [LookupResult.MISS] * 3
    other_model = engines(llama, model="another/model")  # same namespace, other model
    assert other_model.lookup_all(keys, other_model.request()) == [LookupResult.MISS] * 3

    peer = engines(llama)  # a second vLLM instance on the same folder
    assert [peer.tier.kvtier_key(k) for k in keys] == [writer.tier.kvtier_key(k) for k in keys]
    ctx = peer.request()
    assert peer.lookup_all(keys, ctx) == [LookupResult.HIT] * 3
    assert peer.read(keys, ctx) == data


def test_a_corrupt_block_is_a_miss_and_the_rest_of_the_job_loads(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    config = kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)})
    keys, data = offload_keys(4), payloads(4)
    writer = engines(config)
    writer.store(keys, data)
    writer.settle()
    bad = tmp_path.rglob(writer.tier.kvtier_key(keys[2]).hex())
    (path,) = list(bad)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the payload: only the checksum can tell
    path.write_bytes(bytes(raw))
    writer.shutdown()

    reader = engines(config)
    reader.known(keys)
    ctx = reader.request()
    # One promotion job for the four keys; the corrupt one fails, the others load
    # (vLLM gets successful_keys) and the failed key then reads as a miss.
    results = reader.lookup_all(keys, ctx)
    assert results == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    good = [keys[0], keys[1], keys[3]]
    assert reader.read(good, ctx) == [data[0], data[1], data[3]]
    stats = reader.tier.statistics()
    assert stats.loads_failed == 1
    assert stats.misses_by_reason.get("corrupt") == 1
    assert not path.exists()  # kvtier removed the bad file


# -- faults ---------------------------------------------------------------------------------


def test_a_failing_tier_is_a_miss_never_an_exception(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    keys, data = offload_keys(3), payloads(3)
    writer = engines(kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)}))
    writer.store(keys, data)
    writer.settle()
    writer.shutdown()

    failing = FailingTier(kvtier.FSTier(tmp_path))
    reader = engines(kvtier_tier(tier=failing))
    reader.tier.bridge.run(_async(failing.fail, "load"))
    reader.known(keys)
    ctx = reader.request()
    assert reader.lookup_all(keys, ctx) == [LookupResult.MISS] * 3
    stats = reader.tier.statistics()
    assert stats.loads_failed == 1 and failing.failures["load"] == 3
    assert stats.misses_by_reason.get("unavailable") == 3

    reader.tier.bridge.run(_async(failing.fail, "contains"))
    fresh = offload_keys(2)
    assert reader.lookup_all(fresh, ctx) == [LookupResult.MISS] * 2
    assert reader.tier.statistics().misses_by_reason.get("unavailable", 0) >= 5


def test_a_tier_that_cannot_open_answers_misses(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "kvtier-fs.json").write_text('{"format": "something else"}')
    engine = engines(kvtier_tier(tier={"kind": "fs", "root": str(foreign)}))
    ctx = engine.request()
    assert engine.lookup_all(offload_keys(2), ctx) == [LookupResult.MISS] * 2
    assert engine.tier.statistics().state == "failed"
    keys, data = offload_keys(2), payloads(2)
    engine.store(keys, data)  # the cascade fails; vLLM's primary tier keeps the blocks
    engine.settle()
    assert engine.tier.statistics().stores_failed == 1


def test_settings_are_checked_with_messages_that_say_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"did you mean 'root'"):
        make_manager(kvtier_tier(tier={"kind": "fs", "roots": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"tier.kind must be one of"):
        make_manager(kvtier_tier(tier={"kind": "nfs", "root": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['namepsace'\]"):
        make_manager(kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)}, namepsace="x"))
    with pytest.raises(ValueError, match=r"needs 'tier'"):
        make_manager(kvtier_tier())


def test_the_fs_tier_reads_and_syncs_as_vllms_unless_told(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    default = engines(kvtier_tier(tier={"kind": "fs", "root": str(tmp_path / "a")})).tier
    told = engines(
        kvtier_tier(
            tier={"kind": "fs", "root": str(tmp_path / "b"), "max_concurrency": 4, "fsync": "data"}
        )
    ).tier
    for tier, readers, fsync in ((default, 32, "never"), (told, 4, "data")):
        fs = tier.bridge.tier
        assert isinstance(fs, kvtier.FSTier)
        assert (fs.max_concurrency, fs.max_write_concurrency) == (readers, 16)
        assert fs.fsync == fsync


# -- concurrency, drain, shutdown -----------------------------------------------------------


def test_concurrent_jobs_from_many_requests(engines: Callable[..., Engine], tmp_path: Path) -> None:
    config = kvtier_tier(tier={"kind": "fs", "root": str(tmp_path)})
    groups = [offload_keys(6) for _ in range(5)]
    blobs = [payloads(6) for _ in range(5)]
    writer = engines(config, num_chunks=64)
    for keys, data in zip(groups, blobs, strict=True):
        writer.store(keys, data)  # five store jobs in flight at once
    submitted = writer.tier.bridge.statistics()  # one snapshot: a job may finish meanwhile
    assert submitted.jobs_active + submitted.jobs_finished == 5
    writer.settle()
    assert len(block_files(tmp_path)) == 30
    writer.shutdown()

    reader = engines(config, num_chunks=64)
    reader.known([k for keys in groups for k in keys])  # verdicts first: one job a request
    contexts = [reader.request() for _ in groups]
    # Every request's lookups in one pass per step: five promotion jobs run together.
    done: dict[int, list[LookupResult]] = {}

    def all_resolved() -> bool:
        for i, (keys, ctx) in enumerate(zip(groups, contexts, strict=True)):
            done[i] = [reader.manager.lookup(k, ctx) for k in keys]
        return all(r is LookupResult.HIT for rs in done.values() for r in rs)

    reader.step_until(all_resolved)
    for keys, data, ctx in zip(groups, blobs, contexts, strict=True):
        assert reader.read(keys, ctx) == data
    assert reader.tier.statistics().jobs_finished == 5


def _stalled_in_a_store(
    engines: Callable[..., Engine], root: Path, n: int
) -> tuple[Engine, StallingTier, list[OffloadKey]]:
    """An engine over an FSTier at ``root`` whose stores stall: ``n`` blocks stored (their
    keys), and the cascade held in the middle of copying them to the tier."""
    stalling = StallingTier(kvtier.FSTier(root))
    engine = engines(kvtier_tier(tier=stalling))
    engine.tier.bridge.run(_async(stalling.stall, "store"))
    keys = offload_keys(n)
    engine.store(keys, payloads(n))
    engine.tier.bridge.run(stalling.wait_stalled, "store")
    return engine, stalling, keys


def test_drain_jobs_waits_for_jobs_in_flight(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    engine, stalling, _ = _stalled_in_a_store(engines, tmp_path, 3)
    bridge = engine.tier.bridge

    drained = threading.Event()

    def reset() -> None:  # vLLM's reset_cache() calls drain_jobs() on every tier
        engine.manager.reset_cache()
        drained.set()

    resetter = threading.Thread(target=reset)
    seen = bridge.generation
    resetter.start()
    try:
        assert bridge.wait_for_change(seen, WAIT)
        while bridge.statistics().draining == 0:
            seen = bridge.generation
            bridge.wait_for_change(seen, WAIT)
        assert not drained.is_set() and resetter.is_alive()  # held by the stalled store
    finally:
        bridge.run(_async(stalling.release, "store"))
        resetter.join(WAIT)
    assert drained.is_set()
    assert bridge.statistics().jobs_active == 0
    assert len(block_files(tmp_path)) == 3  # whole blocks, written after the release


def test_shutdown_waits_for_jobs_then_closes_the_tier_and_its_thread(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    engine, stalling, keys = _stalled_in_a_store(engines, tmp_path, 2)
    bridge = engine.tier.bridge
    closer = threading.Thread(target=engine.shutdown)
    seen = bridge.generation
    closer.start()
    bridge.wait_for_change(seen, WAIT)  # shutdown is draining
    assert closer.is_alive()
    bridge.run(_async(stalling.release, "store"))
    closer.join(WAIT)
    assert not closer.is_alive()
    assert bridge.statistics().state == "closed"
    assert not bridge._thread.is_alive()
    assert len(block_files(tmp_path)) == 2
    # After shutdown the tier answers misses; vLLM never sees an exception.
    assert engine.tier.lookup(keys[0], ReqContext(req_id="late")) is LookupResult.MISS


# -- the S3 tier ----------------------------------------------------------------------------


@pytest.fixture
def s3_endpoint(weed_server: WeedServer) -> str:
    """The run's SeaweedFS on 127.0.0.1 (``weed_server`` in tests/conftest.py)."""
    return weed_server.endpoint_url


def s3_tier_config(endpoint: str, **settings: Any) -> dict[str, Any]:
    """The ``tier`` of an S3 tier on ``endpoint`` under a fresh prefix, with ``settings``."""
    return {
        "kind": "s3",
        "bucket": BUCKET,
        "prefix": f"vllm/{uuid.uuid4().hex}",
        "endpoint_url": endpoint,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        **settings,
    }


def test_store_cascades_to_s3_and_a_restart_promotes_it(
    engines: Callable[..., Engine], s3_endpoint: str
) -> None:
    tier = s3_tier_config(s3_endpoint)
    keys, data = offload_keys(4), payloads(4)
    first = engines(kvtier_tier(tier=tier, namespace="m"))
    first.store(keys, data)
    first.settle()
    assert first.tier.statistics().stores_failed == 0
    first.shutdown()

    again = engines(kvtier_tier(tier=tier, namespace="m"))
    ctx = again.request()
    assert again.lookup_all(keys, ctx) == [LookupResult.HIT] * 4
    assert again.read(keys, ctx) == data


# -- the README ---------------------------------------------------------------------------


def test_the_readme_config_works_as_written(engines: Callable[..., Engine], tmp_path: Path) -> None:
    section = (ROOT / "README.md").read_text().split("## Use it from vLLM", 1)[1]
    section = section.split("\n## ", 1)[0]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block, "no json block in 'Use it from vLLM'"
    extra = json.loads(block[1])
    (tier,) = extra["secondary_tiers"]
    assert tier["type"] == "kvtier" and tier["module_path"] == MODULE
    tier["tier"]["root"] = str(tmp_path)  # the README's folder, moved into the test's
    keys, data = offload_keys(2), payloads(2)
    writer = engines(tier)
    writer.store(keys, data)
    writer.settle()
    writer.shutdown()
    reader = engines(tier)
    ctx = reader.request()
    assert reader.lookup_all(keys, ctx) == [LookupResult.HIT] * 2
    assert reader.read(keys, ctx) == data


def _async(func: Callable[..., object], *args: object) -> Callable[[], Any]:
    """``func(*args)`` as a coroutine function, to run on the adapter's loop thread."""

    async def call() -> object:
        return func(*args)

    return call
