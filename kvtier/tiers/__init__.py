"""Secondary tiers: the interface, the async lookup helper, and the tiers kvtier ships."""

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
