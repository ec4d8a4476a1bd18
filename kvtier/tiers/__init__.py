"""Secondary tiers: the interface, the async lookup helper, and the tiers kvtier ships.

- ``_base``: ``SecondaryTier``, the interface every tier implements, and its statistics;
- ``_answer``: how a tier's open tells its opener that the backend answered;
- ``_checks``: the batched existence checks the FS (shared) and S3 (ask) tiers build alike;
- ``_async_lookup``: ``AsyncLookupManager``, batched existence checks that answer RETRY while
  they are in flight;
- ``_memory``: ``MemoryTier``, a tier in this process's memory (tests, examples);
- ``fs``: the filesystem tier;
- ``s3``: the S3 tier and its fleet index.
"""

from __future__ import annotations

from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import LookupStatistics, SecondaryTier, TierStatistics
from kvtier.tiers._memory import MemoryTier

__all__ = [
    "AsyncLookupManager",
    "LookupStatistics",
    "MemoryTier",
    "SecondaryTier",
    "TierStatistics",
]
