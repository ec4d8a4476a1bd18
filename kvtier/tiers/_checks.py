"""The batched existence checks of a tier that keeps settings (FS shared, S3 ask mode).

Both tiers build their ``AsyncLookupManager`` the same way from the same four settings; only
the check behind it and how many batches may run at once differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from kvtier.tiers._async_lookup import AsyncLookupManager, ContainsMany
from kvtier.tiers._base import SecondaryTier

__all__ = ["LookupSettings", "existence_checks"]


class LookupSettings(Protocol):
    """The settings of a tier's existence checks (``FSConfig`` and ``S3Config`` have them)."""

    @property
    def lookup_batch_size(self) -> int: ...
    @property
    def lookup_timeout(self) -> float: ...
    @property
    def miss_ttl(self) -> float: ...
    @property
    def max_concurrency(self) -> int: ...


def existence_checks(
    tier: SecondaryTier,
    check: ContainsMany,
    settings: LookupSettings,
    *,
    most: int,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncLookupManager:
    """``check`` run in batches for ``tier``: at most ``most`` batches at once (fewer when
    the tier's own ``max_concurrency`` is lower), each verdict told to the tier's listeners."""
    return AsyncLookupManager(
        check,
        name=tier.name,
        batch_size=settings.lookup_batch_size,
        max_concurrency=max(1, min(most, settings.max_concurrency)),
        timeout=settings.lookup_timeout,
        miss_ttl=settings.miss_ttl,
        on_verdict=tier.notify,
        clock=clock,
    )
