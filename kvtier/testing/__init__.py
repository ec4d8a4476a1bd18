"""Tools for testing code built on kvtier, and tiers built for it.

- ``_conformance``: ``check_tier(make_tier)``, the conformance kit every secondary tier must
  pass;
- ``_tiers``: ``StallingTier``, ``FailingTier`` and ``SlowTier``, tiers that stall, fail or lag
  on demand.
"""

from __future__ import annotations

from kvtier.testing._conformance import CHECKS, check_tier, resolve_lookup
from kvtier.testing._tiers import FailingTier, SlowTier, StallingTier

__all__ = [
    "CHECKS",
    "FailingTier",
    "SlowTier",
    "StallingTier",
    "check_tier",
    "resolve_lookup",
]
