"""kvtier: an asyncio-native KV-cache offloading runtime for LLM serving.

Everything public is imported from here; the modules behind it are private. The wings:

- ``common``: the lookup contract, errors, block format and the plumbing every wing shares;
- ``pools``: primary pools (host memory, CUDA) and their eviction policies;
- ``tiers``: secondary tiers, the filesystem and S3 tiers among them;
- ``manager``: the ``TieringManager`` that answers lookups and promotes hits;
- ``writes``: what happens to a block after the manager stored it in the pool;
- ``scheduler``: the engine's side, the ``OffloadScheduler`` and its prefetches;
- ``integrations``: adapters for serving engines and the event stream routers read;
- ``testing``: conformance suites and tiers for code built on kvtier;
- ``_metrics``: Prometheus metrics (the ``metrics`` extra);
- ``_cli``: the ``kvtier`` command line.
"""

from __future__ import annotations

import sys as _sys

# What kvtier needs at run time: missing, it is named here rather than failing deep in a wing.
_DEPENDENCIES = frozenset({"anyio", "blake3", "numpy", "xxhash"})

try:
    from kvtier._metrics import (
        KVTierCollector,
        LatencyHistograms,
        MetricsServer,
        metrics_asgi_app,
        serve_metrics,
    )
    from kvtier.common import (
        BlockNotFoundError,
        CacheIdentity,
        CorruptBlockError,
        EventBuffer,
        EventKind,
        ExtraNotInstalledError,
        IdentityMismatchError,
        IntegrityConfig,
        IntegrityKey,
        InvalidArgumentError,
        KVTierError,
        LifecycleError,
        LookupResult,
        ManifestError,
        MissReason,
        TierContractError,
        TierError,
        TierEvent,
        TierNoSpaceError,
        TierTimeoutError,
        TierUnavailableError,
        _version,
        block_keys,
    )
    from kvtier.integrations import EventStream
    from kvtier.manager import (
        CostModel,
        CostStatistics,
        KVTierConfig,
        ManagerConfig,
        ManagerStatistics,
        TierCost,
        TieringManager,
    )
    from kvtier.pools import (
        ARCPolicy,
        CudaPool,
        CudaUnavailableError,
        EvictionPolicy,
        HostPool,
        LRUPolicy,
        PoolConfig,
        PoolStatistics,
        PrimaryPool,
        SlotState,
        cuda_available,
    )
    from kvtier.scheduler import (
        OffloadScheduler,
        PrefetchHandle,
        PrefetchState,
        PrefetchStatistics,
        SchedulerStatistics,
        Session,
        SessionSettings,
        SessionStatistics,
    )
    from kvtier.tiers import (
        AsyncLookupManager,
        LookupStatistics,
        MemoryTier,
        SecondaryTier,
        TierStatistics,
    )
    from kvtier.tiers.fs import FSConfig, FSTier, FSTierStatistics, UnusableRootError
    from kvtier.tiers.s3 import S3Config, S3Tier, S3TierStatistics
    from kvtier.writes import AdmissionPolicy, AdmissionStatistics

    def __getattr__(name: str) -> str:
        """``kvtier.__version__``, read from the package metadata on first use (``_version``)."""
        if name == "__version__":
            return _version.version()
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
except ModuleNotFoundError as exc:
    if exc.name not in _DEPENDENCIES:
        raise
    raise ImportError(
        f"kvtier needs {exc.name}, which this Python ({_sys.executable}) does not have: "
        "install kvtier with pip (pip install -e . in a clone) so its dependencies come with it"
    ) from exc

__all__ = [
    "ARCPolicy",
    "AdmissionPolicy",
    "AdmissionStatistics",
    "AsyncLookupManager",
    "BlockNotFoundError",
    "CacheIdentity",
    "CorruptBlockError",
    "CostModel",
    "CostStatistics",
    "CudaPool",
    "CudaUnavailableError",
    "EventBuffer",
    "EventKind",
    "EventStream",
    "EvictionPolicy",
    "ExtraNotInstalledError",
    "FSConfig",
    "FSTier",
    "FSTierStatistics",
    "HostPool",
    "IdentityMismatchError",
    "IntegrityConfig",
    "IntegrityKey",
    "InvalidArgumentError",
    "KVTierCollector",
    "KVTierConfig",
    "KVTierError",
    "LRUPolicy",
    "LatencyHistograms",
    "LifecycleError",
    "LookupResult",
    "LookupStatistics",
    "ManagerConfig",
    "ManagerStatistics",
    "ManifestError",
    "MemoryTier",
    "MetricsServer",
    "MissReason",
    "OffloadScheduler",
    "PoolConfig",
    "PoolStatistics",
    "PrefetchHandle",
    "PrefetchState",
    "PrefetchStatistics",
    "PrimaryPool",
    "S3Config",
    "S3Tier",
    "S3TierStatistics",
    "SchedulerStatistics",
    "SecondaryTier",
    "Session",
    "SessionSettings",
    "SessionStatistics",
    "SlotState",
    "TierContractError",
    "TierCost",
    "TierError",
    "TierEvent",
    "TierNoSpaceError",
    "TierStatistics",
    "TierTimeoutError",
    "TierUnavailableError",
    "TieringManager",
    "UnusableRootError",
    "block_keys",
    "cuda_available",
    "metrics_asgi_app",
    "serve_metrics",
]
