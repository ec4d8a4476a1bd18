"""The file-system tier: one verified file per block under a local or shared folder."""

from __future__ import annotations

from kvtier.tiers.fs._tier import FSYNC_POLICIES, FSTier

__all__ = ["FSYNC_POLICIES", "FSTier"]
