"""The lookup contract shared by pools, tiers, the manager and the scheduler (docs/design.md, "The
lookup contract")."""

from __future__ import annotations

from enum import Enum, StrEnum

__all__ = ["HIT", "HIT_PENDING", "MISS", "RETRY", "LookupResult", "MissReason"]


class LookupResult(Enum):
    """What one ``lookup(key)`` knows right now; see docs/design.md, "The lookup contract" for the
    exact meaning."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class MissReason(StrEnum):
    """Why a key is a miss; every miss is counted under one of these."""

    NOT_FOUND = "not_found"
    CORRUPT = "corrupt"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    EVICTED = "evicted"
    NO_SPACE = "no_space"
    PRIMARY_FULL = "primary_full"
    TIER_ERROR = "tier_error"  # a tier broke its own contract (a malformed answer)
    TOO_SLOW = "too_slow"  # a scheduler's scan: no tier can deliver it before recompute would


# The answers bound once as module globals, for the modules on the hit path to import: a global
# read is cheaper than an enum member read through its class, which costs as much as the rest
# of a cached answer.
HIT = LookupResult.HIT
HIT_PENDING = LookupResult.HIT_PENDING
RETRY = LookupResult.RETRY
MISS = LookupResult.MISS
