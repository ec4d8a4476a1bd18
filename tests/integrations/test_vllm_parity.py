"""Behind vLLM, kvtier behaves as vLLM's own fs tier wherever vLLM's tests say how, through
vLLM's ``TieringOffloadingManager`` (``nox -s vllm``): events from ``take_events`` (stored,
and, beyond vLLM's tier, removed), a root that cannot be used raises when vLLM builds the
tier, a job naming a chunk outside the CPU tier fails as a job, and blocks are shared across
parallel layouts exactly where vLLM shares them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier.testing import FailingTier
from tests.integrations.test_vllm_tier import (
    BLOCK,
    PARALLEL,
    Engine,
    _async,
    block_files,
    kvtier_tier,
    make_manager,
    offload_keys,
    payloads,
    s3_tier_config,
)
from tests.integrations.test_vllm_tier import engines as engines  # the fixtures, shared
from tests.integrations.test_vllm_tier import s3_endpoint as s3_endpoint
from tests.support import vllm_imports

with vllm_imports("vllm.v1.kv_offload.tiering.spec"):
    import msgspec  # type: ignore[import-not-found, unused-ignore]  # vLLM brings it
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingKVEventsConfig,
        ReqContext,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.integrations.vllm import identity_from_spec


def fs(root: Path, **settings: Any) -> dict[str, Any]:
    return {"kind": "fs", "root": str(root), **settings}


def block_file_bytes(engines: Callable[..., Engine], root: Path) -> int:
    """What one stored block takes in an FS tier, as a probe engine of its own on ``root``
    (shut down after) counts it."""
    probe = engines(kvtier_tier(tier=fs(root)))
    probe.store(offload_keys(1), payloads(1))
    probe.settle()
    file_bytes = probe.tier.statistics().tier.bytes_stored  # type: ignore[union-attr]
    probe.shutdown()
    return file_bytes


def storage_events(engine: Engine) -> list[OffloadingEvent]:
    """The secondary tier's events that vLLM's manager hands out now."""
    return [e for e in engine.manager.take_events() if e.medium is Medium.STORAGE]


def events_until(engine: Engine, done: Callable[[list[OffloadingEvent]], bool]) -> list[Any]:
    seen: list[OffloadingEvent] = []

    def check() -> bool:
        seen.extend(storage_events(engine))
        return done(seen)

    engine.step_until(check)
    return seen


# -- 1. events ------------------------------------------------------------------------------


def test_a_store_is_one_stored_event_through_vllms_manager(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = engines(
        kvtier_tier(tier=fs(tmp_path), enable_kv_events=True, locality="LOCAL"),
        enable_kv_cache_events=True,
    )
    keys = offload_keys(3)
    engine.store(keys, payloads(3))
    engine.settle()
    (event,) = events_until(engine, bool)
    assert event.keys == keys and not event.removed
    assert (event.medium, event.locality, event.ownership) == (
        Medium.STORAGE,
        Locality.LOCAL,
        "kvtier",
    )
    assert storage_events(engine) == []  # taken once

    ctx = engine.request()  # a promotion (load) says nothing
    engine.tier.drain_jobs()
    assert engine.lookup_all(keys, ctx) == [LookupResult.HIT] * 3
    assert storage_events(engine) == []


def test_a_failed_store_job_says_nothing_and_the_next_one_does(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    failing = FailingTier(kvtier.FSTier(tmp_path))
    engine = engines(kvtier_tier(tier=failing, enable_kv_events=True), enable_kv_cache_events=True)
    engine.tier.bridge.run(_async(failing.fail, "store"))
    engine.store(offload_keys(2), payloads(2))
    engine.settle()
    assert engine.tier.statistics().stores_failed == 1
    assert storage_events(engine) == []
    engine.tier.bridge.run(_async(failing.recover, "store"))
    keys = offload_keys(1)
    engine.store(keys, payloads(1))
    engine.settle()
    assert [e.keys for e in events_until(engine, bool)] == [keys]


@pytest.mark.parametrize(("asked", "globally"), [(False, True), (True, False)])
def test_events_need_the_tiers_switch_and_vllms(
    engines: Callable[..., Engine], tmp_path: Path, asked: bool, globally: bool
) -> None:
    engine = engines(
        kvtier_tier(tier=fs(tmp_path), enable_kv_events=asked), enable_kv_cache_events=globally
    )
    engine.store(offload_keys(2), payloads(2))
    engine.settle()
    assert not engine.tier.events_enabled and list(engine.tier.take_events()) == []
    fs_tier = engine.tier.bridge.tier
    assert isinstance(fs_tier, kvtier.FSTier) and not fs_tier.events.enabled


def test_capacity_evictions_and_corrupt_blocks_are_removed_events_vllm_can_publish(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    file_bytes = block_file_bytes(engines, tmp_path / "probe")
    engine = engines(
        kvtier_tier(tier=fs(tmp_path / "c", capacity_bytes=3 * file_bytes), enable_kv_events=True),
        enable_kv_cache_events=True,
        num_chunks=4,
    )
    keys = offload_keys(4)
    for k in keys:  # one job each: the fourth evicts the oldest
        engine.store([k], payloads(1))
        engine.settle()
    events = events_until(engine, lambda seen: any(e.removed for e in seen))
    assert [e.keys for e in events if not e.removed] == [[k] for k in keys]
    assert [e.keys for e in events if e.removed] == [[keys[0]]]

    # vLLM's own event code turns them into BlockStored / BlockRemoved, which decode.
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    published = list(tracker.take_events(events))
    batch = KVEventBatch(ts=time.time(), events=published)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)
    removed = [e for e in decoded.events if isinstance(e, BlockRemoved)]
    stored = [e for e in decoded.events if isinstance(e, BlockStored)]
    assert len(stored) == 4 and len(removed) == 1
    assert removed[0].medium == "STORAGE" and removed[0].ownership == "kvtier"


def test_events_name_only_the_newest_event_keys_and_count_the_rest(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    file_bytes = block_file_bytes(engines, tmp_path / "probe")
    engine = engines(
        kvtier_tier(
            tier=fs(tmp_path / "c", capacity_bytes=2 * file_bytes),
            enable_kv_events=True,
            event_keys=1,
        ),
        enable_kv_cache_events=True,
    )
    for k in offload_keys(3):  # the third evicts the first, which the adapter forgot
        engine.store([k], payloads(1))
        engine.settle()
        (event,) = events_until(engine, bool)  # taken at once: the adapter still knows k
        assert event.keys == [k] and not event.removed
    assert engine.tier.events_unmapped == 1 and len(engine.tier._vllm_keys) == 1
    assert storage_events(engine) == []


def test_a_block_that_fails_verification_at_a_promotion_is_a_removed_event(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = engines(
        kvtier_tier(tier=fs(tmp_path), enable_kv_events=True),
        enable_kv_cache_events=True,
        num_chunks=4,
    )
    keys = offload_keys(2)
    engine.store(keys, payloads(2))
    engine.settle()
    for path in block_files(tmp_path):
        path.write_bytes(b"not a block")
    for _ in range(4):  # push both out of vLLM's CPU tier: the next lookup promotes
        engine.store(offload_keys(1), payloads(1))
        engine.settle()
    storage_events(engine)
    ctx = engine.request()
    assert engine.lookup_all(keys, ctx) == [LookupResult.MISS] * 2  # promoted, failed
    events = events_until(engine, lambda seen: any(e.removed for e in seen))
    assert sorted(k for e in events if e.removed for k in e.keys) == sorted(keys)
    assert engine.tier.statistics().loads_failed >= 1


def test_another_nodes_blocks_are_remote_stored_events_through_vllms_manager(
    engines: Callable[..., Engine], s3_endpoint: str
) -> None:
    # polled by hand below
    tier = s3_tier_config(s3_endpoint, index_refresh=100.0, index_lookback=1000.0)
    config = kvtier_tier(tier=tier, enable_kv_events=True, locality="LOCAL")
    here = engines(config, enable_kv_cache_events=True)
    there = engines(config, enable_kv_cache_events=True)
    keys = offload_keys(3)
    assert here.lookup_all(keys, here.request()) == [LookupResult.MISS] * 3
    there.store(keys, payloads(3))
    there.settle()
    assert [e.keys for e in storage_events(there)] == [keys]  # its own: LOCAL

    there_tier, here_tier = there.tier.bridge.tier, here.tier.bridge.tier
    assert isinstance(there_tier, kvtier.S3Tier) and isinstance(here_tier, kvtier.S3Tier)
    there.tier.bridge.run(there_tier.refresh_index)  # publishes its journal
    here.tier.bridge.run(here_tier.refresh_index)  # reads it
    (event,) = events_until(here, bool)
    assert sorted(event.keys) == sorted(keys) and not event.removed
    assert (event.locality, event.ownership) == (Locality.REMOTE, "kvtier")


# -- 2. a root that cannot be used ----------------------------------------------------------


def test_a_root_that_cannot_be_made_raises_when_vllm_builds_the_tier(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    root = tmp_path / "a-file" / "cache"
    with pytest.raises(OSError, match=rf"{root}.*ENOTDIR") as info:
        make_manager(kvtier_tier(tier=fs(root)))
    assert isinstance(info.value, kvtier.UnusableRootError) and info.value.path == root


def test_missing_parents_are_created(engines: Callable[..., Engine], tmp_path: Path) -> None:
    root = tmp_path / "not" / "there" / "yet"
    engine = engines(kvtier_tier(tier=fs(root)))
    engine.store(offload_keys(2), payloads(2))
    engine.settle()
    assert len(block_files(root)) == 2


# -- 3. jobs outside the CPU tier ----------------------------------------------------------


@pytest.mark.parametrize("operation", ["store", "load"])
def test_a_job_outside_the_cpu_tier_is_a_failed_job(
    engines: Callable[..., Engine], tmp_path: Path, operation: str
) -> None:
    engine = engines(kvtier_tier(tier=fs(tmp_path)), num_chunks=4)
    tier = engine.tier
    keys = offload_keys(2)
    job = TransferJob(
        job_id=7,
        keys=keys,
        chunk_ids=np.array([0, 4], dtype=np.int64),  # 4: one past the last chunk
        is_promotion=operation == "load",
        req_context=ReqContext(req_id="r"),
    )
    (tier.submit_store if operation == "store" else tier.submit_load)(job)  # no raise
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert result.job_id == 7 and not result.success and not result.successful_keys
    assert tier._job_keys == {} and not tier.has_pending_work()
    assert getattr(tier.statistics(), f"{operation}s_failed") == 1
    assert block_files(tmp_path) == []


# -- 4. sharing across parallel layouts, by vLLM's rules ----------------------------------


def _identity(parallel: dict[str, Any], **change: Any) -> kvtier.CacheIdentity:
    """The identity the adapter gives an MLA-sized model's blocks under ``parallel``."""
    parts: dict[str, Any] = {
        "groups": (OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        "worker_kv_bytes_per_block": BLOCK,
        "enable_kv_cache_events": False,
        "extra_config": {"cpu_bytes_to_use": 4 * BLOCK, "secondary_tiers": []},
        "engine_id": "kvtier-layouts",
        "model": OffloadingModelConfig(name="org/mla", dtype="bfloat16"),
        "cache": OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        "parallel": OffloadingParallelConfig(**(PARALLEL | parallel)),
    }
    return identity_from_spec(TieringOffloadingSpec(OffloadingConfig(**(parts | change))), BLOCK)


def tp(size: int, rank: int = 0, **more: Any) -> dict[str, Any]:
    return {"tp_size": size, "world_size": size, "rank": rank, **more}


AGNOSTIC = {"is_parallelism_agnostic": True}
SHARDED = {"is_parallelism_agnostic": False}


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        # replicated_layout (MLA at TP > 1, one copy a block): every TP size and rank shares
        (
            (tp(2, **SHARDED), {"replicated_layout": True}),
            (tp(4, 3, **SHARDED), {"replicated_layout": True}),
            True,
        ),
        # parallelism-agnostic (head-sharded pages, concatenated in rank order): shared
        ((tp(2, **AGNOSTIC), {}), (tp(8, 5, **AGNOSTIC), {}), True),
        # neither: each TP size keeps its own blocks, and so does each rank
        ((tp(2, **SHARDED), {}), (tp(4, **SHARDED), {}), False),
        ((tp(2, 0, **SHARDED), {}), (tp(2, 1, **SHARDED), {}), False),
        ((tp(2, **SHARDED) | {"pp_size": 2, "world_size": 4}, {}), (tp(2, **SHARDED), {}), False),
        # replicated and head-sharded bytes never meet (vLLM: replicated_layout in the path)
        ((tp(2, **AGNOSTIC), {"replicated_layout": True}), (tp(2, **AGNOSTIC), {}), False),
        # the canonical layout is another byte format (vLLM: canonical_format in the path)
        (
            (tp(2, **AGNOSTIC), {"canonical_layout": True, "kv_cache_layout": "NHD"}),
            (tp(2, **AGNOSTIC), {"kv_cache_layout": "NHD"}),
            False,
        ),
        # data parallel replicas hold the same bytes: shared
        (
            (tp(2, **SHARDED) | {"data_parallel_index": 0}, {}),
            (tp(2, **SHARDED) | {"data_parallel_index": 3, "data_parallel_size": 4}, {}),
            True,
        ),
    ],
)
def test_keys_are_shared_across_layouts_exactly_where_vllm_shares_them(
    a: tuple[dict[str, Any], dict[str, Any]], b: tuple[dict[str, Any], dict[str, Any]], shared: bool
) -> None:
    first, second = _identity(a[0], **a[1]), _identity(b[0], **b[1])
    assert (first == second) is shared, first.differences(second)


def test_a_replicated_tp2_writer_and_tp4_reader_share_blocks(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    keys, data = offload_keys(2), payloads(2)
    config = kvtier_tier(tier=fs(tmp_path))
    writer = engines(config, parallel=tp(2, **SHARDED), replicated_layout=True)
    writer.store(keys, data)
    writer.settle()
    writer.shutdown()
    reader = engines(config, parallel=tp(4, 3, **SHARDED), replicated_layout=True)
    ctx = reader.request()
    assert reader.lookup_all(keys, ctx) == [LookupResult.HIT] * 2
    assert reader.read(keys, ctx) == data
    apart = engines(
        kvtier_tier(tier=fs(tmp_path, separate_identities=True)), parallel=tp(4, **SHARDED)
    )
    assert apart.lookup_all(keys, apart.request()) == [LookupResult.MISS] * 2
