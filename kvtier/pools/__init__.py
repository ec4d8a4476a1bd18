"""Primary pools: the slot state machine, eviction policies, host and CUDA pools.

- ``_base``: ``PrimaryPool``, what every pool offers the manager;
- ``_slots``: the synchronous slot table (free, writing, ready, pins) and ``PoolStatistics``;
- ``_policy``: the eviction policies (``LRUPolicy``, ``ARCPolicy``);
- ``_config``: ``PoolConfig``, every pool setting defined once;
- ``_host``: ``HostPool``, blocks in host memory; ``_host_gpu``, its copies to and from a GPU;
- ``_device``: an engine's device arrays (tensors), as the pools copy them;
- ``_cupy``: the CUDA runtime through CuPy, and ``cuda_available``;
- ``_cuda``: ``CudaPool``, blocks in GPU memory, over ``_cuda_core`` (its synchronous
  state), ``_cuda_copies`` (copies to and from the tiers), ``_cuda_stream`` (staging buffers,
  copy lanes and their completions), ``_cuda_caller`` (the thread its CUDA calls run on) and
  ``_cuda_thread`` (what that thread and the lanes' waiters share).
"""

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
