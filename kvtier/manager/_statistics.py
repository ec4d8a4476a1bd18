"""What ``TieringManager.statistics()`` returns: frozen snapshots grouped by job.

``ManagerStatistics`` holds one group per job of the manager (``lookups``, ``promotions``,
``stores``, ``writes``, ``background``, ``opens``) next to the snapshots of what it drives
(``pool``, ``tiers``, ``cost``, ``admission``).

Each counter says, in its field's metadata, which Prometheus family it is exported under and
with which label value (``METRICS`` lists the families), so the metrics collector walks these
groups instead of naming every field again. Each part of the manager fills its own group
(``counts()``); ``WriteCounts`` is defined beside the writer that fills it
(``kvtier.writes._counts``), since the write path does not import the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.manager._cost import CostStatistics
from kvtier.pools._slots import PoolStatistics
from kvtier.tiers._base import TierStatistics
from kvtier.writes._admission import AdmissionStatistics
from kvtier.writes._counts import WriteCounts, metric

__all__ = [
    "COUNTER",
    "GAUGE",
    "METRICS",
    "BackgroundCounts",
    "LookupCounts",
    "ManagerStatistics",
    "PromotionCounts",
    "StoreCounts",
    "TierOpenCounts",
    "WriteCounts",
]

COUNTER, GAUGE = "counter", "gauge"

# family -> (kind, help text, label name or None); in the order the collector exports them
METRICS: dict[str, tuple[str, str, str | None]] = {
    "lookups": (COUNTER, "Manager lookups by result.", "result"),
    "misses": (COUNTER, "Manager lookup misses by reason.", "reason"),
    "promotions": (COUNTER, "Promotions from a tier into the pool.", "outcome"),
    "promotion_failures": (COUNTER, "Failed promotions by reason.", "reason"),
    "blocks_stored": (COUNTER, "Blocks placed in the pool by store().", None),
    "stores_skipped": (COUNTER, "Blocks store() did not place, by why.", "why"),
    "blocks_loaded": (COUNTER, "Blocks copied out by load().", None),
    "write_through": (COUNTER, "Write-through of stored blocks to the tiers.", "outcome"),
    "write_through_failures": (COUNTER, "Write-through failures by reason.", "reason"),
    "in_flight_bytes": (GAUGE, "Bytes being written through now.", None),
    "background_tasks": (GAUGE, "Promotions and write-through running now.", None),
    "callback_failures": (
        COUNTER,
        "Tier hooks and observers that raised in background work (contained and logged).",
        None,
    ),
    "promotions_not_started": (
        COUNTER,
        "Tier hits not promoted: deferred (lazy) or declined (slower than recompute).",
        "why",
    ),
    "write_back_blocks": (COUNTER, "Blocks written back on leaving the pool.", None),
    "write_back_dirty_blocks": (GAUGE, "Blocks waiting in the pool for write-back.", None),
    "promotions_written_up": (
        COUNTER,
        "Promoted blocks whose write to the faster tiers above their source was started.",
        None,
    ),
    "deferred_writes": (
        COUNTER,
        "Writes to a deferred tier that back-pressure dropped: queued, then written "
        "(copied from a faster tier) or lost.",
        "outcome",
    ),
    "deferred_writes_pending": (
        GAUGE,
        "Deferred writes waiting for their tier to have room.",
        None,
    ),
    "write_ups_waiting": (
        GAUGE,
        "Promoted blocks in the pool to be copied to the faster tiers when evicted.",
        None,
    ),
    "tiers_unavailable": (
        GAUGE,
        "Tiers that have not opened: skipped by lookups and writes, opened again in the "
        "background.",
        None,
    ),
    "tier_open_failures": (COUNTER, "Attempts to open a tier that failed.", None),
    "tiers_joined_late": (COUNTER, "Tiers that opened after the manager did.", None),
}


@dataclass(frozen=True, slots=True)
class LookupCounts:
    """``lookup`` answers since the manager was made (primary hits included)."""

    hit: int = field(metadata=metric("lookups", "hit"))
    hit_pending: int = field(metadata=metric("lookups", "hit_pending"))
    retry: int = field(metadata=metric("lookups", "retry"))
    miss: int = field(metadata=metric("lookups", "miss"))
    misses_by_reason: dict[str, int] = field(metadata=metric("misses"))


@dataclass(frozen=True, slots=True)
class PromotionCounts:
    """Tier hits copied into the pool, and those not promoted (yet)."""

    started: int = field(metadata=metric("promotions", "started"))
    succeeded: int = field(metadata=metric("promotions", "succeeded"))
    failed: int = field(metadata=metric("promotions", "failed"))
    failed_by_reason: dict[str, int] = field(metadata=metric("promotion_failures"))
    cancelled: int = field(metadata=metric("promotions", "cancelled"))
    deferred: int = field(metadata=metric("promotions_not_started", "deferred"))
    """Tier hits not promoted yet because an earlier key of the scan was still unknown."""
    declined: int = field(metadata=metric("promotions_not_started", "declined"))
    """Tier hits not promoted because the tier was expected later than recompute."""
    written_up: int = field(metadata=metric("promotions_written_up"))
    """Promoted blocks whose write to the faster tiers above their source was started."""
    write_ups_waiting: int = field(metadata=metric("write_ups_waiting"))
    """Promoted blocks in the pool to be copied to the faster tiers when they are evicted."""


@dataclass(frozen=True, slots=True)
class StoreCounts:
    """``store`` and ``load``: blocks copied into and out of the pool."""

    stored: int = field(metadata=metric("blocks_stored"))
    skipped_present: int = field(metadata=metric("stores_skipped", "present"))
    skipped_full: int = field(metadata=metric("stores_skipped", "full"))
    loaded: int = field(metadata=metric("blocks_loaded"))


@dataclass(frozen=True, slots=True)
class BackgroundCounts:
    tasks: int = field(metadata=metric("background_tasks"))
    """Promotions and write-through running now."""
    callback_failures: int = field(metadata=metric("callback_failures"))
    """Tier hooks and observers that raised in background work (contained and logged)."""


@dataclass(frozen=True, slots=True)
class TierOpenCounts:
    """Which tiers are open: a tier that cannot open does not stop the manager, it is
    unavailable and opened again in the background until it joins."""

    unavailable: tuple[str, ...]
    """The tiers not open now, in the manager's order: lookups skip them (a miss no open
    tier answers is ``unavailable``) and writes to them are dropped (admission cause
    ``unavailable``)."""
    unavailable_tiers: int = field(metadata=metric("tiers_unavailable"))
    open_failures: int = field(metadata=metric("tier_open_failures"))
    """Attempts to open a tier that failed (or passed ``open_timeout``), all tiers."""
    joined_late: int = field(metadata=metric("tiers_joined_late"))
    """Tiers that opened after the manager did (not within ``tier_open_wait``)."""


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    """One consistent snapshot of the manager and every part below it, in nested groups
    (lookups, promotions, stores, writes, background work, which tiers are open, the pool,
    each tier, the cost model, the admission policies), so a dashboard reads one object,
    not many calls."""

    lookups: LookupCounts
    promotions: PromotionCounts
    stores: StoreCounts
    writes: WriteCounts
    background: BackgroundCounts
    opens: TierOpenCounts
    pool: PoolStatistics
    tiers: tuple[TierStatistics, ...]
    cost: CostStatistics
    admission: tuple[AdmissionStatistics, ...]

    def groups(self) -> tuple[Any, ...]:
        """The manager's own groups, in the order the metrics collector walks them."""
        return (
            self.lookups,
            self.promotions,
            self.stores,
            self.writes,
            self.background,
            self.opens,
        )
