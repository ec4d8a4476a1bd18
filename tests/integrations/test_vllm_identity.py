"""The vLLM adapter's cache identity: built from vLLM's own offloading config, one field of it
changed at a time changes every key, a tier folder that records another identity is refused
(its lookups miss, and the log names the field), and no identity means no start."""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

import kvtier
from tests.support import vllm_imports

with vllm_imports("vllm.v1.kv_offload.tiering.spec"):
    from vllm.v1.kv_offload import config as vllm_config
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.integrations.vllm import KVTierSecondaryTier, identity_from_spec, vllm_key_hasher

CHUNK = 64 << 10
WAIT = 30.0  # a bound on the tier's open, not a timing assertion
PARALLEL: dict[str, Any] = {
    "rank": 0,
    "world_size": 2,
    "tp_size": 2,
    "pp_size": 1,
    "pcp_size": 1,
    "dcp_size": 1,
    "data_parallel_index": 0,
    "data_parallel_size": 1,
    "data_parallel_rank_local": None,
    "is_parallelism_agnostic": False,
}


def config(
    secondary: list[dict[str, Any]] | None = None, **change: Any
) -> vllm_config.OffloadingConfig:
    """vLLM's offloading config of a two-way tensor-parallel fp16 model, with ``change``."""
    parts: dict[str, Any] = {
        "groups": (
            vllm_config.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),
        ),
        "worker_kv_bytes_per_block": CHUNK,
        "enable_kv_cache_events": False,
        "extra_config": {
            "cpu_bytes_to_use": 8 * CHUNK,
            "secondary_tiers": secondary or [],
            "tier_poll_interval_s": 0,
        },
        "engine_id": f"kvtier-identity-{uuid.uuid4().hex[:12]}",
        "model": vllm_config.OffloadingModelConfig(name="org/model", dtype="float16"),
        "cache": vllm_config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        "parallel": vllm_config.OffloadingParallelConfig(**PARALLEL),
        "kv_cache_layout": "NHD",
    }
    return vllm_config.OffloadingConfig(**(parts | change))


CHANGES: dict[str, dict[str, Any]] = {
    "model": {"model": vllm_config.OffloadingModelConfig(name="org/other", dtype="float16")},
    "kv_dtype": {"model": vllm_config.OffloadingModelConfig(name="org/model", dtype="bfloat16")},
    "block_size": {
        "cache": vllm_config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2)
    },
    "layout": {"kv_cache_layout": "HND"},
    "parallel": {"parallel": vllm_config.OffloadingParallelConfig(**(PARALLEL | {"tp_size": 4}))},
}


def test_the_identity_comes_from_vllms_config() -> None:
    identity = identity_from_spec(TieringOffloadingSpec(config()), CHUNK, namespace="prod")
    assert (identity.model, identity.kv_dtype, identity.block_size) == ("org/model", "float16", 16)
    assert identity.parallel == "tp=2 pp=1 pcp=1 dcp=1 rank=0"
    assert dict(identity.extra) == {"namespace": "prod"}
    agnostic = vllm_config.OffloadingParallelConfig(
        **(PARALLEL | {"is_parallelism_agnostic": True})
    )
    assert identity_from_spec(TieringOffloadingSpec(config(parallel=agnostic)), CHUNK).parallel == (
        "agnostic"
    )


def test_each_changed_setting_changes_the_identity_and_every_key() -> None:
    base = identity_from_spec(TieringOffloadingSpec(config()), CHUNK)
    key = make_offload_key(os.urandom(32), 0)

    def kvtier_key(identity: kvtier.CacheIdentity) -> bytes:
        h = vllm_key_hasher(identity)
        h.update(bytes(key))
        return h.digest()

    for name, change in CHANGES.items():
        other = identity_from_spec(TieringOffloadingSpec(config(**change)), CHUNK)
        assert [d[0] for d in base.differences(other)] == [name]
        assert kvtier_key(other) != kvtier_key(base)
    extra = identity_from_spec(TieringOffloadingSpec(config()), CHUNK, extra={"rope": "yarn"})
    assert [d[0] for d in base.differences(extra)] == ["extra"]


def test_no_identity_no_start() -> None:
    with pytest.raises(kvtier.InvalidArgumentError, match="pass 'identity'"):
        identity_from_spec(object(), CHUNK)


def _manager(tier: dict[str, Any], **change: Any) -> TieringOffloadingManager:
    entry = {"type": "kvtier", "module_path": "kvtier.integrations.vllm", "tier": tier}
    manager = TieringOffloadingSpec(config([entry], **change)).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def _opened(manager: TieringOffloadingManager) -> tuple[KVTierSecondaryTier, str]:
    """The adapter of ``manager`` and how its tier's open ended (``open`` or ``failed``)."""
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, KVTierSecondaryTier)
    bridge = tier.bridge
    seen = bridge.generation
    while bridge.statistics().state == "opening":
        assert bridge.wait_for_change(seen, WAIT)
        seen = bridge.generation
    return tier, bridge.statistics().state


def test_a_folder_of_another_identity_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = {"kind": "fs", "root": str(tmp_path)}
    first = _manager(fs)
    try:
        tier, state = _opened(first)
        assert state == "open"
        recorded = kvtier.CacheIdentity.from_manifest(
            (tmp_path / ".kvtier-fs-identity.json").read_bytes()
        )
        assert recorded == tier.identity
    finally:
        first.shutdown()

    with caplog.at_level(logging.ERROR, logger="kvtier"):
        other = _manager(fs, kv_cache_layout="HND")
        try:
            tier, state = _opened(other)
            assert state == "failed"
            key = make_offload_key(os.urandom(32), 0)
            assert tier.lookup(key, ReqContext(req_id="r")) is LookupResult.MISS
        finally:
            other.shutdown()
    assert "layout" in caplog.text and "records another cache identity" in caplog.text

    apart = _manager({**fs, "separate_identities": True}, kv_cache_layout="HND")
    try:
        tier, state = _opened(apart)
        assert state == "open"
    finally:
        apart.shutdown()


def test_a_ready_tier_of_another_identity_is_refused(tmp_path: Path) -> None:
    base = identity_from_spec(TieringOffloadingSpec(config()), CHUNK)
    ready = kvtier.FSTier(tmp_path, identity=dataclasses.replace(base, kv_dtype="int8"))
    spec = TieringOffloadingSpec(config())
    view = memoryview(bytearray(CHUNK))
    with pytest.raises(kvtier.IdentityMismatchError, match="kv_dtype"):
        KVTierSecondaryTier(spec, view, "kvtier", tier=ready)
