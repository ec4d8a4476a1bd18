"""The Prometheus collector: reads the statistics kvtier keeps anyway at scrape time.

``manager.statistics()`` (and the scheduler's, when given) are frozen snapshots; a scrape turns
them into metric families and touches nothing on the hot path. The manager's own counters are
walked from its nested statistics (each field names the family it is exported under), the
pool's and the scheduler's are listed here, the per-tier families live in ``_tiers``, and the
latency histograms, the one thing recorded as it happens, are read last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Self

from kvtier._metrics._families import Families, add_by, prometheus
from kvtier._metrics._histograms import LatencyHistograms, samples_of
from kvtier._metrics._tiers import collect_policies, collect_tiers
from kvtier.common._errors import InvalidArgumentError
from kvtier.manager._statistics import COUNTER, METRICS

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from kvtier.manager import ManagerStatistics, TieringManager
    from kvtier.pools._slots import PoolStatistics
    from kvtier.scheduler._scheduler import OffloadScheduler, SchedulerStatistics

__all__ = ["KVTierCollector"]


class KVTierCollector:
    """A prometheus_client collector over a ``TieringManager`` (and optionally its scheduler
    and a ``LatencyHistograms``). Register it in a registry::

        registry.register(KVTierCollector(manager, scheduler=scheduler))

    Every metric is named ``<namespace>_...``; per-tier metrics carry a ``tier`` label (the
    tier's name; a name listed twice gets ``#2``, ``#3`` so series never collide).
    """

    def __init__(
        self,
        manager: TieringManager,
        *,
        scheduler: OffloadScheduler | None = None,
        latency: LatencyHistograms | None = None,
        namespace: str = "kvtier",
    ) -> None:
        self._prometheus = prometheus()
        if not isinstance(namespace, str) or not namespace.isidentifier():
            raise InvalidArgumentError(
                f"namespace must be a metric name prefix such as 'kvtier', got {namespace!r}"
            )
        self.manager = manager
        self.scheduler = scheduler
        self.latency = latency
        self.namespace = namespace

    def register(self, registry: CollectorRegistry | None = None) -> Self:
        """Register in ``registry`` (default: prometheus_client's global one)."""
        (registry or self._prometheus.REGISTRY).register(self)
        return self

    def collect(self) -> Iterable[Metric]:
        f = Families(self._prometheus, self.namespace)
        s = self.manager.statistics()
        _collect_manager(f, s)
        _collect_pool(f, s.pool)
        collect_tiers(f, s.tiers, [t.listener_failures for t in self.manager.tiers])
        collect_policies(f, s)
        if self.scheduler is not None:
            _collect_scheduler(f, self.scheduler.statistics())
        if self.latency is not None:
            _collect_latency(f, self.latency)
        return f.families

    def __repr__(self) -> str:
        return f"<KVTierCollector namespace={self.namespace!r} manager={self.manager!r}>"


def _collect_manager(f: Families, s: ManagerStatistics) -> None:
    """The manager's own counters: each field of its statistics groups names the family it
    is exported under (``METRICS``), so the walk adds a counter with nothing written here."""
    values: dict[str, dict[str, float]] = {}
    for group in s.groups():
        for field in dataclasses.fields(group):
            exported = field.metadata.get("metric")
            if exported is None:
                continue
            family, label = exported
            value = getattr(group, field.name)
            if isinstance(value, dict):  # by reason: one label value per key
                values.setdefault(family, {}).update(value)
            else:
                values.setdefault(family, {})[label or ""] = value
    for name, (kind, doc, label) in METRICS.items():
        make = f.counter if kind == COUNTER else f.gauge
        if label is None:
            make(name, doc).add_metric([], values[name][""])
        else:
            add_by(make(name, doc, [label]), values.get(name, {}))


def _collect_pool(f: Families, p: PoolStatistics) -> None:
    """The primary pool: its slots by state, its size, and what it counted."""
    add_by(
        f.gauge("pool_blocks", "Primary pool slots by state.", ["state"]),
        {"free": p.free, "writing": p.writing, "ready": p.ready},
    )
    f.gauge("pool_pinned_blocks", "Slots pinned by readers now.").add_metric([], p.pinned)
    f.gauge("pool_capacity_bytes", "Size of the primary pool.").add_metric(
        [], p.num_blocks * p.block_bytes
    )
    f.gauge("pool_block_bytes", "Bytes per block.").add_metric([], p.block_bytes)
    for name, value, doc in (
        ("pool_evictions", p.evictions, "Blocks evicted from the pool."),
        ("pool_reservations", p.reservations, "Slots reserved for a write."),
        ("pool_reservation_failures", p.reservation_failures, "Reservations refused: full."),
        ("pool_commits", p.commits, "Writes committed (slot became readable)."),
        ("pool_aborts", p.aborts, "Writes aborted (slot freed)."),
    ):
        f.counter(name, doc).add_metric([], value)


def _collect_scheduler(f: Families, sch: SchedulerStatistics) -> None:
    """The scheduler's counters (scans, async lookups, waits and how they ended)."""
    for name, value, doc in (
        ("scheduler_scans", sch.scans, "Prefix scans run."),
        ("scheduler_deferred_scans", sch.deferred_scans, "Scans that asked to defer."),
        ("scheduler_async_lookups", sch.async_lookups, "await scheduler.lookup() calls."),
        ("scheduler_waits", sch.waits, "Waits for a change notification."),
        ("scheduler_timeouts", sch.timeouts, "Lookups that hit their deadline."),
        (
            "scheduler_waits_cut",
            sch.waits_cut,
            "Lookups that stopped waiting: recomputing was expected to be cheaper.",
        ),
        (
            "scheduler_callback_failures",
            sch.callback_failures,
            "Latency observers that raised (contained and logged).",
        ),
    ):
        f.counter(name, doc).add_metric([], value)


def _collect_latency(f: Families, latency: LatencyHistograms) -> None:
    """The lookup histogram, then one promotion histogram per tier and outcome."""
    lookup, promotions = samples_of(latency)
    f.histogram("lookup_seconds", "Time of one await scheduler.lookup().").add_metric(
        [], lookup.buckets, lookup.sum
    )
    family = f.histogram("promotion_seconds", "Time of one promotion.", ["tier", "outcome"])
    for (tier, outcome), histogram in promotions:
        family.add_metric([tier, outcome], histogram.buckets, histogram.sum)
