"""What ``TieringManager.statistics()`` returns: frozen snapshots grouped by job.

``ManagerStatistics`` holds one group per job of the manager (``lookups``, ``promotions``,
``stores``, ``writes``, ``background``) next to the snapshots of what it drives (``pool``,
``tiers``, ``cost``, ``admission``). The flat names of earlier releases (``lookups_hit``,
``cascades_started``, ...) stay readable as properties.

Each counter says, in its field's metadata, which Prometheus family it is exported under and
with which label value (``METRICS`` lists the families), so the metrics collector walks these
groups instead of naming every field again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from kvtier.manager._cost import CostStatistics
from kvtier.pools._slots import PoolStatistics
from kvtier.tiers._base import TierStatistics
from kvtier.writes._admission import AdmissionStatistics

__all__ = [
    "COUNTER",
    "GAUGE",
    "METRICS",
    "BackgroundCounts",
    "LookupCounts",
    "ManagerStatistics",
    "PromotionCounts",
    "StoreCounts",
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
}


_T = TypeVar("_T")


class _Flat(Generic[_T]):
    """A flat attribute of earlier releases that reads one field of a group."""

    __slots__ = ("_field", "_group")

    def __init__(self, group: str, field: str) -> None:
        self._group = group
        self._field = field

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> _Flat[_T]: ...
    @overload
    def __get__(self, instance: object, owner: type[Any]) -> _T: ...
    def __get__(self, instance: object | None, owner: type[Any]) -> _Flat[_T] | _T:
        if instance is None:
            return self
        value: _T = getattr(getattr(instance, self._group), self._field)
        return value


def _metric(family: str, label: str | None = None) -> dict[str, tuple[str, str | None]]:
    """The metadata of a field exported as ``family`` (with ``label`` as its label value,
    if the family has a label; a dict field gives one label value per key)."""
    return {"metric": (family, label)}


@dataclass(frozen=True, slots=True)
class LookupCounts:
    """``lookup`` answers since the manager was made (primary hits included)."""

    hit: int = field(metadata=_metric("lookups", "hit"))
    hit_pending: int = field(metadata=_metric("lookups", "hit_pending"))
    retry: int = field(metadata=_metric("lookups", "retry"))
    miss: int = field(metadata=_metric("lookups", "miss"))
    misses_by_reason: dict[str, int] = field(metadata=_metric("misses"))


@dataclass(frozen=True, slots=True)
class PromotionCounts:
    """Tier hits copied into the pool, and those not promoted (yet)."""

    started: int = field(metadata=_metric("promotions", "started"))
    succeeded: int = field(metadata=_metric("promotions", "succeeded"))
    failed: int = field(metadata=_metric("promotions", "failed"))
    failed_by_reason: dict[str, int] = field(metadata=_metric("promotion_failures"))
    cancelled: int = field(metadata=_metric("promotions", "cancelled"))
    deferred: int = field(metadata=_metric("promotions_not_started", "deferred"))
    """Tier hits not promoted yet because an earlier key of the scan was still unknown."""
    declined: int = field(metadata=_metric("promotions_not_started", "declined"))
    """Tier hits not promoted because the tier was expected later than recompute."""
    written_up: int = field(metadata=_metric("promotions_written_up"))
    """Promoted blocks whose write to the faster tiers above their source was started."""
    write_ups_waiting: int = field(metadata=_metric("write_ups_waiting"))
    """Promoted blocks in the pool to be copied to the faster tiers when they are evicted."""


@dataclass(frozen=True, slots=True)
class StoreCounts:
    """``store`` and ``load``: blocks copied into and out of the pool."""

    stored: int = field(metadata=_metric("blocks_stored"))
    skipped_present: int = field(metadata=_metric("stores_skipped", "present"))
    skipped_full: int = field(metadata=_metric("stores_skipped", "full"))
    loaded: int = field(metadata=_metric("blocks_loaded"))


@dataclass(frozen=True, slots=True)
class WriteCounts:
    """Write-through (cascades) to the tiers, write-back and deferred writes."""

    started: int = field(metadata=_metric("write_through", "started"))
    succeeded: int = field(metadata=_metric("write_through", "succeeded"))
    failures_by_reason: dict[str, int] = field(metadata=_metric("write_through_failures"))
    skipped: int = field(metadata=_metric("write_through", "skipped"))
    cancelled: int = field(metadata=_metric("write_through", "cancelled"))
    dropped: int
    """Writes to a tier that its admission refused (back-pressure), all tiers together
    (exported per tier with the admission statistics)."""
    in_flight_bytes: int = field(metadata=_metric("in_flight_bytes"))
    written_back: int = field(metadata=_metric("write_back_blocks"))
    dirty_blocks: int = field(metadata=_metric("write_back_dirty_blocks"))
    deferred: int = field(metadata=_metric("deferred_writes", "queued"))
    """Writes to a ``deferred`` tier that back-pressure dropped and that were queued."""
    deferred_written: int = field(metadata=_metric("deferred_writes", "written"))
    """Deferred writes since copied to their tier from a faster one."""
    deferred_lost: int = field(metadata=_metric("deferred_writes", "lost"))
    """Deferred writes given up: the queue overflowed, no faster tier held the block any
    more, the write failed, or the manager closed first."""
    deferred_pending: int = field(metadata=_metric("deferred_writes_pending"))


@dataclass(frozen=True, slots=True)
class BackgroundCounts:
    tasks: int = field(metadata=_metric("background_tasks"))
    """Promotions and write-through running now."""
    callback_failures: int = field(metadata=_metric("callback_failures"))
    """Tier hooks and observers that raised in background work (contained and logged)."""


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    lookups: LookupCounts
    promotions: PromotionCounts
    stores: StoreCounts
    writes: WriteCounts
    background: BackgroundCounts
    pool: PoolStatistics
    tiers: tuple[TierStatistics, ...]
    cost: CostStatistics
    admission: tuple[AdmissionStatistics, ...]

    def groups(self) -> tuple[Any, ...]:
        """The manager's own groups, in the order the metrics collector walks them."""
        return (self.lookups, self.promotions, self.stores, self.writes, self.background)

    # -- the flat names of earlier releases, read through to their group ------------------
    lookups_hit = _Flat[int]("lookups", "hit")
    lookups_hit_pending = _Flat[int]("lookups", "hit_pending")
    lookups_retry = _Flat[int]("lookups", "retry")
    lookups_miss = _Flat[int]("lookups", "miss")
    misses_by_reason = _Flat[dict[str, int]]("lookups", "misses_by_reason")
    promotions_started = _Flat[int]("promotions", "started")
    promotions_succeeded = _Flat[int]("promotions", "succeeded")
    promotions_failed_by_reason = _Flat[dict[str, int]]("promotions", "failed_by_reason")
    promotions_cancelled = _Flat[int]("promotions", "cancelled")
    promotions_deferred = _Flat[int]("promotions", "deferred")
    promotions_declined = _Flat[int]("promotions", "declined")
    promotions_written_up = _Flat[int]("promotions", "written_up")
    write_ups_waiting = _Flat[int]("promotions", "write_ups_waiting")
    blocks_stored = _Flat[int]("stores", "stored")
    stores_skipped_present = _Flat[int]("stores", "skipped_present")
    stores_skipped_full = _Flat[int]("stores", "skipped_full")
    blocks_loaded = _Flat[int]("stores", "loaded")
    cascades_started = _Flat[int]("writes", "started")
    cascades_succeeded = _Flat[int]("writes", "succeeded")
    cascade_failures_by_reason = _Flat[dict[str, int]]("writes", "failures_by_reason")
    cascades_skipped = _Flat[int]("writes", "skipped")
    cascades_cancelled = _Flat[int]("writes", "cancelled")
    cascades_dropped = _Flat[int]("writes", "dropped")
    in_flight_bytes = _Flat[int]("writes", "in_flight_bytes")
    written_back = _Flat[int]("writes", "written_back")
    dirty_blocks = _Flat[int]("writes", "dirty_blocks")
    writes_deferred = _Flat[int]("writes", "deferred")
    deferred_written = _Flat[int]("writes", "deferred_written")
    deferred_lost = _Flat[int]("writes", "deferred_lost")
    deferred_pending = _Flat[int]("writes", "deferred_pending")
    background_tasks = _Flat[int]("background", "tasks")
    callback_failures = _Flat[int]("background", "callback_failures")
