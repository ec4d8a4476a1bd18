"""The per-tier metric families: each tier's own statistics, what a tier kind adds to them, and
what the manager's policies (cost model, write-through admission) keep per tier.

Every family here carries a ``tier`` label, the tier's name; a name listed twice gets ``#2``,
``#3`` so series never collide.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvtier._metrics._families import Families, add_by
from kvtier.manager._statistics import COUNTER, GAUGE
from kvtier.tiers._base import TierStatistics
from kvtier.writes._admission import DROP_CAUSES

if TYPE_CHECKING:
    from kvtier.manager import ManagerStatistics

__all__ = ["collect_policies", "collect_tiers"]

_TIER = ["tier"]

_BASE_TIER_FIELDS = frozenset(f.name for f in dataclasses.fields(TierStatistics))


# Counters with a second label: (name, help, label, its values for one tier).
_BY_LABEL: tuple[tuple[str, str, str, Callable[[TierStatistics], Mapping[str, float]]], ...] = (
    (
        "tier_lookups",
        "Tier lookups by result.",
        "result",
        lambda t: {"hit": t.lookups.hits, "miss": t.lookups.misses, "retry": t.lookups.retries},
    ),
    (
        "tier_misses",
        "Tier lookup misses by reason.",
        "reason",
        lambda t: t.lookups.misses_by_reason,
    ),
    (
        "tier_operations",
        "Completed tier operations.",
        "op",
        lambda t: {"load": t.loads, "store": t.stores, "delete": t.deletes},
    ),
    (
        "tier_failures",
        "Failed tier operations by reason.",
        "reason",
        lambda t: t.failures_by_reason,
    ),
)


class _Tier(NamedTuple):
    """One tier as the families read it: its label value, its statistics, and the failures of
    its change listeners (which the tier counts outside its statistics)."""

    label: str
    stats: TierStatistics
    listener_failures: int


# Families with the tier label only: (kind, name after ``tier_``, where its value is on a
# _Tier, help).
_FIGURES = (
    (COUNTER, "read_bytes", "stats.bytes_read", "Payload bytes loaded from the tier."),
    (COUNTER, "written_bytes", "stats.bytes_written", "Payload bytes stored in the tier."),
    (COUNTER, "read_seconds", "stats.read_seconds", "Seconds spent in loads."),
    (COUNTER, "write_seconds", "stats.write_seconds", "Seconds spent in stores."),
    (COUNTER, "evictions", "stats.evictions", "Blocks the tier evicted for room."),
    (COUNTER, "lookup_batches", "stats.lookups.batches", "Batched existence checks run."),
    (COUNTER, "lookup_keys_checked", "stats.lookups.keys_checked", "Keys asked of the storage."),
    (
        COUNTER,
        "request_path_requests",
        "stats.request_path_requests",
        "Requests sent because lookup() was asked about a key the tier's index lacks.",
    ),
    (
        COUNTER,
        "loads_on_loop",
        "stats.loads_on_loop",
        "Loads read from the page cache on the event loop, with no worker thread.",
    ),
    (
        COUNTER,
        "listener_failures",
        "listener_failures",
        "Change listeners that raised (contained and logged).",
    ),
    (GAUGE, "blocks", "stats.blocks", "Blocks the tier holds."),
    (GAUGE, "stored_bytes", "stats.bytes_stored", "Bytes the tier holds."),
    (GAUGE, "lookup_pending", "stats.lookups.pending", "Keys waiting for an existence check."),
    (GAUGE, "lookup_in_flight", "stats.lookups.in_flight", "Keys being checked now."),
    (GAUGE, "lookup_cached_verdicts", "stats.lookups.cached_verdicts", "Lookup verdicts cached."),
)


def _labels(tiers: Sequence[TierStatistics]) -> list[str]:
    """Each tier's label value: its name, numbered from its second appearance on."""
    seen: dict[str, int] = {}
    names: list[str] = []
    for t in tiers:
        seen[t.name] = seen.get(t.name, 0) + 1
        names.append(t.name if seen[t.name] == 1 else f"{t.name}#{seen[t.name]}")
    return names


def collect_tiers(
    f: Families, tiers: Sequence[TierStatistics], listener_failures: Sequence[int]
) -> None:
    """The tiers' statistics, one family per figure with one sample per tier, then what a tier
    kind adds (``_collect_extras``). ``listener_failures`` is per tier, in the same order."""
    names = _labels(tiers)
    rows = [
        _Tier(name, t, failed)
        for name, t, failed in zip(names, tiers, listener_failures, strict=True)
    ]
    for metric, doc, label, values in _BY_LABEL:
        family = f.counter(metric, doc, [*_TIER, label])
        for row in rows:
            add_by(family, values(row.stats), row.label)
    for kind, metric, where, doc in _FIGURES:
        family = (f.counter if kind == COUNTER else f.gauge)(f"tier_{metric}", doc, _TIER)
        value = operator.attrgetter(where)
        for row in rows:
            family.add_metric([row.label], value(row))
    _collect_extras(f, rows)


def _collect_extras(f: Families, rows: Sequence[_Tier]) -> None:
    """What a tier adds to TierStatistics (S3TierStatistics: breaker_state, retries,
    index_keys, journal_segments_published, ...), exported as gauges of its value now
    (``<namespace>_tier_<field>``); a string becomes a label with the value 1."""
    extras: dict[str, Any] = {}
    for name, t, _ in rows:
        for field in dataclasses.fields(t):
            if field.name in _BASE_TIER_FIELDS:
                continue
            value = getattr(t, field.name)
            metric = f"tier_{field.name}"
            if isinstance(value, str):
                if metric not in extras:
                    extras[metric] = f.gauge(metric, f"Tier {field.name}.", [*_TIER, field.name])
                extras[metric].add_metric([name, value], 1)
            elif isinstance(value, int | float):
                if metric not in extras:
                    extras[metric] = f.gauge(metric, f"Tier {field.name}.", _TIER)
                extras[metric].add_metric([name], float(value))


def collect_policies(f: Families, s: ManagerStatistics) -> None:
    """The cost model (promotion estimates, recompute) and write-through admission."""
    c = s.cost
    if c.recompute_seconds_per_block is not None:
        f.gauge("recompute_seconds_per_block", "The engine's recompute cost per block.").add_metric(
            [], c.recompute_seconds_per_block
        )
    latency = f.gauge(
        "tier_promotion_latency_seconds", "Moving average of one promotion, per tier.", _TIER
    )
    rate = f.gauge(
        "tier_promotion_throughput_bytes_per_second",
        "Moving average of one promotion's throughput, per tier.",
        _TIER,
    )
    declined = f.counter(
        "tier_promotions_declined", "Promotions not started: tier slower than recompute.", _TIER
    )
    for t in c.tiers:
        if t.latency_seconds is not None:
            latency.add_metric([t.name], t.latency_seconds)
        if t.throughput_bytes_per_second is not None:
            rate.add_metric([t.name], t.throughput_bytes_per_second)
        declined.add_metric([t.name], t.declined)
    _collect_admission(f, s)


def _collect_admission(f: Families, s: ManagerStatistics) -> None:
    """Write-through admission per tier: what it let through, dropped (by cause), and its
    state now."""
    admitted = f.counter("tier_writes_admitted", "Writes a tier's admission let through.", _TIER)
    dropped = f.counter(
        "tier_writes_dropped", "Writes a tier's admission refused, by cause.", [*_TIER, "cause"]
    )
    write_latency = f.gauge(
        "tier_write_latency_seconds", "Moving average of one write, per tier.", _TIER
    )
    closed = f.gauge("tier_write_closed", "1 while a tier refuses writes (too slow).", _TIER)
    in_flight = f.gauge("tier_write_in_flight_bytes", "Bytes being written to a tier.", _TIER)
    for a in s.admission:
        admitted.add_metric([a.name], a.admitted)
        add_by(dropped, dict.fromkeys(DROP_CAUSES, 0) | a.dropped_by_cause, a.name)
        if a.write_latency_seconds is not None:
            write_latency.add_metric([a.name], a.write_latency_seconds)
        closed.add_metric([a.name], float(a.closed))
        in_flight.add_metric([a.name], a.in_flight_bytes)
