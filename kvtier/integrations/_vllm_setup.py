"""What the vLLM adapter builds from its settings and vLLM's spec: the kvtier tier
(``tier_from_config``, with ``ADAPTER_DEFAULTS``), the cache identity (``identity_from_spec``,
by vLLM's own sharing rules in ``parallel_identity``) and the hasher that turns vLLM's keys into
kvtier keys under that identity (``vllm_key_hasher``). Nothing here imports vLLM: the spec is
read by its attributes, so these are tested and typed without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._identity import CacheIdentity
from kvtier.tiers._base import SecondaryTier
from kvtier.tiers.fs import FSTier
from kvtier.tiers.s3 import S3Tier

__all__ = [
    "ADAPTER_DEFAULTS",
    "identity_from_spec",
    "identity_of",
    "parallel_identity",
    "tier_from_config",
    "vllm_key_hasher",
]

_PERSON = b"kvtier.vllm.v1"
_KINDS = ("fs", "s3")
# Where the adapter's defaults differ from ``KVTierConfig``'s, and why (the measurements are in
# docs/design.md, "Measurements behind the defaults"): vLLM's own ``fs`` tier lets all 32 of its
# threads take loads, and one-block jobs arrive dozens at a time, so loads get 32 threads here
# (writers stay at 16; more did not help). And vLLM's ``fs`` tier never syncs: behind vLLM the
# FS tier keeps that durability (``fsync="never"``), with what vLLM's lacks: a kill -9 loses
# nothing stored (temporary file, then rename), and the checksum turns a block torn by a power
# loss into a miss. ``"fsync": "data"`` asks for fdatasync per block, at a cost to stores.
ADAPTER_DEFAULTS: dict[str, dict[str, Any]] = {"fs": {"max_concurrency": 32, "fsync": "never"}}


def tier_from_config(
    tier: Mapping[str, Any],
    *,
    num_blocks: int,
    block_bytes: int,
    identity: CacheIdentity | None = None,
) -> SecondaryTier:
    """Build the tier that ``{"kind": "fs"|"s3", ...}`` describes, with ``KVTierConfig``,
    recording and checking ``identity`` in its folder or prefix.

    The keys are those of the ``[fs]`` or ``[s3]`` section of a kvtier config file; a key
    left out takes ``KVTierConfig``'s default, except those in ``ADAPTER_DEFAULTS``.
    """
    if not isinstance(tier, Mapping):
        raise InvalidArgumentError(
            f"tier must be a mapping such as {{'kind': 'fs', 'root': '/var/cache/kvtier'}} "
            f"or a kvtier SecondaryTier, got {type(tier).__name__}"
        )
    settings = dict(tier)
    kind = settings.pop("kind", None)
    if kind not in _KINDS:
        raise InvalidArgumentError(f"tier.kind must be one of {_KINDS}, got {kind!r}")
    for name, value in ADAPTER_DEFAULTS.get(kind, {}).items():
        settings.setdefault(name, value)
    from kvtier.manager._stack_config import KVTierConfig

    # The pool section only satisfies KVTierConfig; the adapter builds no pool (vLLM's CPU
    # tier is the primary), but it does describe that primary truthfully.
    config = KVTierConfig.from_dict(
        {"pool": {"num_blocks": num_blocks, "block_bytes": block_bytes}, kind: settings},
        source="secondary tier 'kvtier'",
    )
    if identity is None:
        (built,) = config.build_tiers()
        return built
    key = None if config.integrity is None else config.integrity.key
    if config.fs is not None:
        return FSTier(config.fs.root, config=config.fs, integrity_key=key, identity=identity)
    assert config.s3 is not None
    return S3Tier(config.s3.bucket, config=config.s3, integrity_key=key, identity=identity)


def identity_from_spec(
    spec: object,
    block_bytes: int,
    *,
    namespace: str = "",
    extra: Mapping[str, str] | None = None,
) -> CacheIdentity:
    """The cache identity of vLLM's offloading ``spec`` (see the module doc); raises
    ``InvalidArgumentError`` when the spec does not say what the blocks are."""
    config: Any = getattr(spec, "config", None)
    try:
        groups = [[g.tokens_per_block, list(g.layer_names)] for g in config.groups]
        layout = {
            "kv_cache_layout": config.kv_cache_layout,
            "canonical": bool(config.canonical_layout),
            "replicated": bool(config.replicated_layout),
            "chunk_bytes": block_bytes,
            "groups": hashlib.blake2b(json.dumps(groups).encode(), digest_size=8).hexdigest(),
        }
        parallel = parallel_identity(config)
        cache = config.cache
        return CacheIdentity(
            model=config.model.name,
            kv_dtype=str(config.model.dtype),
            block_size=cache.tokens_per_hash * cache.blocks_per_chunk,
            layout=json.dumps(layout, sort_keys=True, separators=(",", ":")),
            parallel=parallel,
            extra={**({"namespace": namespace} if namespace else {}), **(extra or {})},
        )
    except AttributeError as exc:  # no config, or another vLLM version: refuse, never guess
        raise InvalidArgumentError(
            f"the kvtier secondary tier cannot tell what vLLM's blocks are ({exc}): pass "
            "'identity' with the model, kv_dtype, block_size, layout and parallel fields of "
            "kvtier.CacheIdentity, so blocks are never shared across a difference"
        ) from None


def parallel_identity(config: Any) -> str:
    """The ``parallel`` field of the identity, by vLLM's own sharing rules (its ``FileMapper``
    with ``parallel_agnostic``, as its fs tier builds it): bytes that are parallelism-agnostic,
    or replicated across ranks (``replicated_layout``: MLA at TP > 1, one copy per block),
    are shared by every TP, PP and CP layout, and ``"agnostic"`` says so; otherwise each
    layout and rank keeps its own blocks (TP, PP, PCP, DCP sizes and the rank). The data
    parallel rank never separates: DP replicas hold the same bytes. Whether the layout is
    replicated stays in the ``layout`` field, so replicated and head-sharded blocks, which
    vLLM keeps apart too, never meet."""
    p = config.parallel
    if p.is_parallelism_agnostic or config.replicated_layout:
        return "agnostic"
    return f"tp={p.tp_size} pp={p.pp_size} pcp={p.pcp_size} dcp={p.dcp_size} rank={p.rank}"


def identity_of(
    given: CacheIdentity | Mapping[str, Any] | None,
    spec: object,
    block_bytes: int,
    namespace: str,
    extra: Mapping[str, str] | None,
) -> CacheIdentity:
    if given is None:
        return identity_from_spec(spec, block_bytes, namespace=namespace, extra=extra)
    if isinstance(given, CacheIdentity):
        return given
    if not isinstance(given, Mapping):
        raise InvalidArgumentError(
            f"identity must be a kvtier.CacheIdentity or a mapping of its fields, got {given!r}"
        )
    try:
        return CacheIdentity(**given)
    except TypeError as exc:
        raise InvalidArgumentError(f"identity: {exc}") from None


def vllm_key_hasher(identity: CacheIdentity) -> hashlib.blake2b:
    """A blake2b state holding the identity; ``copy()`` it and add an OffloadKey."""
    ns = identity.namespace
    h = hashlib.blake2b(digest_size=15, person=_PERSON)
    h.update(len(ns).to_bytes(8, "little"))
    h.update(ns)
    return h
