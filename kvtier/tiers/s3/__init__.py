"""A secondary tier on any S3-compatible object store, through aiobotocore (design §3-4)."""

from __future__ import annotations

from kvtier.tiers.s3._config import S3TierStatistics
from kvtier.tiers.s3._tier import S3Tier

__all__ = ["S3Tier", "S3TierStatistics"]
