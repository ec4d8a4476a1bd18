"""kvtier: an asyncio-native KV-cache offloading runtime for LLM serving.

Everything public is imported from here; the modules behind it are private.
"""

from __future__ import annotations

from kvtier import _version
from kvtier._config import (
    FSConfig,
    IntegrityConfig,
    KVTierConfig,
    PoolConfig,
    S3Config,
)
from kvtier._cost import CostModel, CostStatistics, TierCost
from kvtier._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    ExtraNotInstalledError,
    InvalidArgumentError,
    KVTierError,
    LifecycleError,
    TierContractError,
    TierError,
    TierNoSpaceError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvtier._event_stream import EventStream
from kvtier._events import EventBuffer, EventKind, TierEvent
from kvtier._format import IntegrityKey
from kvtier._identity import CacheIdentity, IdentityMismatchError, ManifestError
from kvtier._keys import block_keys
from kvtier._lookup import LookupResult, MissReason
from kvtier._metrics import (
    KVTierCollector,
    LatencyHistograms,
    MetricsServer,
    metrics_asgi_app,
    serve_metrics,
)
from kvtier._prefetch import PrefetchHandle, PrefetchState, PrefetchStatistics
from kvtier._scheduler import OffloadScheduler, SchedulerStatistics
from kvtier.manager import ManagerConfig, ManagerStatistics, TieringManager
from kvtier.pools._base import PrimaryPool
from kvtier.pools._cuda import CudaPool
from kvtier.pools._cupy import CudaUnavailableError, cuda_available
from kvtier.pools._host import HostPool
from kvtier.pools._policy import ARCPolicy, EvictionPolicy, LRUPolicy
from kvtier.pools._slots import PoolStatistics, SlotState
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import LookupStatistics, SecondaryTier, TierStatistics
from kvtier.tiers._memory import MemoryTier
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._io import UnusableRootError
from kvtier.tiers.s3 import S3Tier, S3TierStatistics
from kvtier.writes._admission import AdmissionPolicy, AdmissionStatistics


def __getattr__(name: str) -> str:
    """``kvtier.__version__``, read from the package metadata on first use (``_version``)."""
    if name == "__version__":
        return _version.version()
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


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
