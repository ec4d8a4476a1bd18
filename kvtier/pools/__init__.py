"""Primary pools: the slot state machine, eviction policies, host and CUDA pools."""

from __future__ import annotations

from kvtier.pools._base import PrimaryPool
from kvtier.pools._config import PoolConfig
from kvtier.pools._cuda import CudaPool
from kvtier.pools._cupy import CudaUnavailableError, cuda_available
from kvtier.pools._host import HostPool
from kvtier.pools._policy import ARCPolicy, EvictionPolicy, LRUPolicy
from kvtier.pools._slots import PoolStatistics, SlotState

__all__ = [
    "ARCPolicy",
    "CudaPool",
    "CudaUnavailableError",
    "EvictionPolicy",
    "HostPool",
    "LRUPolicy",
    "PoolConfig",
    "PoolStatistics",
    "PrimaryPool",
    "SlotState",
    "cuda_available",
]
