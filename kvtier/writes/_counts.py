"""What the writes report: the ``writes`` group of the manager's statistics.

It lives here, beside the writer that fills it, so that the writer hands the manager one
snapshot of its own counters (``WriteThrough.counts``) without the write path importing the
manager. ``metric`` is the field metadata every statistics group uses: it names the Prometheus
family a counter is exported under (the families are listed in
``kvtier.manager._statistics.METRICS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["WriteCounts", "metric"]


def metric(family: str, label: str | None = None) -> dict[str, tuple[str, str | None]]:
    """The metadata of a field exported as ``family`` (with ``label`` as its label value,
    if the family has a label; a dict field gives one label value per key)."""
    return {"metric": (family, label)}


@dataclass(frozen=True, slots=True)
class WriteCounts:
    """Write-through (cascades) to the tiers, write-back and deferred writes."""

    started: int = field(metadata=metric("write_through", "started"))
    succeeded: int = field(metadata=metric("write_through", "succeeded"))
    failures_by_reason: dict[str, int] = field(metadata=metric("write_through_failures"))
    skipped: int = field(metadata=metric("write_through", "skipped"))
    cancelled: int = field(metadata=metric("write_through", "cancelled"))
    dropped: int
    """Writes to a tier that its admission refused (back-pressure), all tiers together
    (exported per tier with the admission statistics)."""
    in_flight_bytes: int = field(metadata=metric("in_flight_bytes"))
    written_back: int = field(metadata=metric("write_back_blocks"))
    dirty_blocks: int = field(metadata=metric("write_back_dirty_blocks"))
    deferred: int = field(metadata=metric("deferred_writes", "queued"))
    """Writes to a ``deferred`` tier that back-pressure dropped and that were queued."""
    deferred_written: int = field(metadata=metric("deferred_writes", "written"))
    """Deferred writes since copied to their tier from a faster one."""
    deferred_lost: int = field(metadata=metric("deferred_writes", "lost"))
    """Deferred writes given up: the queue overflowed, no faster tier held the block any
    more, the write failed, or the manager closed first."""
    deferred_pending: int = field(metadata=metric("deferred_writes_pending"))
