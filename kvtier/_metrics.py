"""Prometheus metrics for a ``TieringManager`` (the ``kvtier[metrics]`` extra).

The exporter is a *collector*: it reads ``manager.statistics()`` (and the scheduler's, when
given) at scrape time and turns the frozen snapshots into metric families. The hot path pays
nothing for it: no counter object is touched per lookup, the counters kvtier keeps anyway are
read once per scrape. A scrape costs one ``statistics()`` call per component.

Histograms are the exception: a distribution cannot be rebuilt from totals, so latencies are
recorded as they happen into a ``LatencyHistograms`` object, plain Python with no dependency
on prometheus_client (the core could call it without the extra installed), which the collector
exports next to the counters:

- lookup latency: the time ``await scheduler.lookup(keys)`` takes, end to end, which is what
  the engine waits for. ``with histograms.time_lookup(): n = await scheduler.lookup(keys)``.
- promotion latency, per tier and outcome: ``histograms.observe_promotion(tier, seconds, ok)``,
  meant to be called by ``TieringManager._promote`` (a hook the manager does not have yet).

``serve_metrics(manager, port)`` serves ``/metrics`` from the event loop itself (an anyio TCP
listener in an ``async with`` block): no thread reads kvtier's counters while the loop updates
them, and no daemon thread outlives the block. Bind it to 127.0.0.1 (the default) unless the
scraper is on another machine.

Two ``KVTierCollector`` for two managers cannot share one registry (their metric names would
collide); give each its own ``CollectorRegistry``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import math
import time
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.abc

from kvtier._admission import CAUSE_IN_FLIGHT, CAUSE_LATENCY, CAUSE_RATE
from kvtier._errors import ExtraNotInstalledError, InvalidArgumentError
from kvtier.manager._statistics import COUNTER, METRICS
from kvtier.tiers._base import TierStatistics

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from kvtier._scheduler import OffloadScheduler
    from kvtier.manager import ManagerStatistics, TieringManager

__all__ = [
    "DEFAULT_BUCKETS",
    "KVTierCollector",
    "LatencyHistograms",
    "MetricsServer",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

# Seconds: a promotion from a local disk takes well under a millisecond per block, one from S3
# tens of milliseconds, a deadline hit several seconds.
DEFAULT_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def _prometheus() -> types.ModuleType:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ExtraNotInstalledError("Prometheus metrics", "metrics", "prometheus_client") from exc
    return prometheus_client


# -- latency histograms ----------------------------------------------------------------------


class _Histogram:
    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(running)))
        return out


class LatencyHistograms:
    """Lookup and promotion latency distributions, recorded as they happen.

    Observing costs a ``bisect`` and three additions; nothing here needs prometheus_client.
    """

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(not (math.isfinite(b) and b > 0) for b in bounds):
            raise InvalidArgumentError("buckets must be finite positive numbers of seconds")
        if list(bounds) != sorted(set(bounds)):
            raise InvalidArgumentError("buckets must be strictly increasing")
        self.buckets = bounds
        self._lookup = _Histogram(bounds)
        self._promotions: dict[tuple[str, str], _Histogram] = {}

    def observe_lookup(self, seconds: float) -> None:
        """One ``await scheduler.lookup(...)`` took ``seconds``."""
        self._lookup.observe(seconds)

    @contextlib.contextmanager
    def time_lookup(self) -> Iterator[None]:
        """Time the block as one lookup (also when it raises or is cancelled)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._lookup.observe(time.perf_counter() - started)

    def observe_promotion(self, tier: str, seconds: float, ok: bool) -> None:
        """A promotion from ``tier`` finished after ``seconds`` (``ok``: it landed in the pool).

        The hook for ``TieringManager._promote``; see the module docstring.
        """
        key = (tier, "succeeded" if ok else "failed")
        histogram = self._promotions.get(key)
        if histogram is None:
            histogram = self._promotions[key] = _Histogram(self.buckets)
        histogram.observe(seconds)

    def __repr__(self) -> str:
        promotions = sum(h.count for h in self._promotions.values())
        return f"<LatencyHistograms lookups={self._lookup.count} promotions={promotions}>"


# -- the collector ---------------------------------------------------------------------------


class _Families:
    """Builds metric families under one namespace; keeps the order they were made in."""

    def __init__(self, prometheus: types.ModuleType, namespace: str) -> None:
        self._core = prometheus.metrics_core
        self._ns = namespace
        self.families: list[Metric] = []

    def _add(self, family: Metric) -> Any:
        self.families.append(family)
        return family

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._add(
            self._core.CounterMetricFamily(f"{self._ns}_{name}", doc, labels=list(labels))
        )

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._add(
            self._core.GaugeMetricFamily(f"{self._ns}_{name}", doc, labels=list(labels))
        )

    def histogram(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._add(
            self._core.HistogramMetricFamily(f"{self._ns}_{name}", doc, labels=list(labels))
        )


def _by(family: Any, values: Mapping[str, float], *prefix: str) -> None:
    for label, value in sorted(values.items()):
        family.add_metric([*prefix, label], value)


_BASE_TIER_FIELDS = frozenset(f.name for f in dataclasses.fields(TierStatistics))

# Every cause admission drops a write for: exported at 0 before the first drop, so a series
# exists for each from the first scrape (rate() and alerts see a drop from its first one).
_DROP_CAUSES = (CAUSE_IN_FLIGHT, CAUSE_LATENCY, CAUSE_RATE)


def _collect_manager(f: _Families, s: ManagerStatistics) -> None:
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
            _by(make(name, doc, [label]), values.get(name, {}))


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
        self._prometheus = _prometheus()
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
        f = _Families(self._prometheus, self.namespace)
        s = self.manager.statistics()

        _collect_manager(f, s)

        # -- pool
        p = s.pool
        _by(
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

        # -- tiers
        self._collect_tiers(f, s.tiers, [t.listener_failures for t in self.manager.tiers])
        self._collect_policies(f, s)

        # -- scheduler
        if self.scheduler is not None:
            sch = self.scheduler.statistics()
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

        # -- latency
        if self.latency is not None:
            h = self.latency
            f.histogram("lookup_seconds", "Time of one await scheduler.lookup().").add_metric(
                [], h._lookup.cumulative(), h._lookup.sum
            )
            promotions = f.histogram(
                "promotion_seconds", "Time of one promotion.", ["tier", "outcome"]
            )
            for (tier, outcome), histogram in sorted(h._promotions.items()):
                promotions.add_metric([tier, outcome], histogram.cumulative(), histogram.sum)
        return f.families

    def _collect_tiers(
        self, f: _Families, tiers: Sequence[TierStatistics], listener_failures: Sequence[int]
    ) -> None:
        L = ["tier"]
        lookups = f.counter("tier_lookups", "Tier lookups by result.", [*L, "result"])
        misses = f.counter("tier_misses", "Tier lookup misses by reason.", [*L, "reason"])
        ops = f.counter("tier_operations", "Completed tier operations.", [*L, "op"])
        failures = f.counter("tier_failures", "Failed tier operations by reason.", [*L, "reason"])
        read_bytes = f.counter("tier_read_bytes", "Payload bytes loaded from the tier.", L)
        written_bytes = f.counter("tier_written_bytes", "Payload bytes stored in the tier.", L)
        read_seconds = f.counter("tier_read_seconds", "Seconds spent in loads.", L)
        write_seconds = f.counter("tier_write_seconds", "Seconds spent in stores.", L)
        evictions = f.counter("tier_evictions", "Blocks the tier evicted for room.", L)
        batches = f.counter("tier_lookup_batches", "Batched existence checks run.", L)
        checked = f.counter("tier_lookup_keys_checked", "Keys asked of the storage.", L)
        request_path = f.counter(
            "tier_request_path_requests",
            "Requests sent because lookup() was asked about a key the tier's index lacks.",
            L,
        )
        listeners = f.counter(
            "tier_listener_failures", "Change listeners that raised (contained and logged).", L
        )
        blocks = f.gauge("tier_blocks", "Blocks the tier holds.", L)
        stored = f.gauge("tier_stored_bytes", "Bytes the tier holds.", L)
        pending = f.gauge("tier_lookup_pending", "Keys waiting for an existence check.", L)
        in_flight = f.gauge("tier_lookup_in_flight", "Keys being checked now.", L)
        cached = f.gauge("tier_lookup_cached_verdicts", "Lookup verdicts cached.", L)
        extras: dict[str, Any] = {}
        seen: dict[str, int] = {}
        for t, listener_failed in zip(tiers, listener_failures, strict=True):
            seen[t.name] = seen.get(t.name, 0) + 1
            name = t.name if seen[t.name] == 1 else f"{t.name}#{seen[t.name]}"
            lk = t.lookups
            _by(lookups, {"hit": lk.hits, "miss": lk.misses, "retry": lk.retries}, name)
            _by(misses, lk.misses_by_reason, name)
            _by(ops, {"load": t.loads, "store": t.stores, "delete": t.deletes}, name)
            _by(failures, t.failures_by_reason, name)
            for family, value in (
                (read_bytes, t.bytes_read),
                (written_bytes, t.bytes_written),
                (read_seconds, t.read_seconds),
                (write_seconds, t.write_seconds),
                (evictions, t.evictions),
                (batches, lk.batches),
                (checked, lk.keys_checked),
                (request_path, t.request_path_requests),
                (listeners, listener_failed),
                (blocks, t.blocks),
                (stored, t.bytes_stored),
                (pending, lk.pending),
                (in_flight, lk.in_flight),
                (cached, lk.cached_verdicts),
            ):
                family.add_metric([name], value)
            # What a tier adds to TierStatistics (S3TierStatistics: breaker_state, retries,
            # index_keys, journal_segments_published, ...), exported as gauges of its value
            # now (kvtier_tier_<field>); a string becomes a label with the value 1.
            for field in dataclasses.fields(t):
                if field.name in _BASE_TIER_FIELDS:
                    continue
                value = getattr(t, field.name)
                metric = f"tier_{field.name}"
                if isinstance(value, str):
                    if metric not in extras:
                        extras[metric] = f.gauge(metric, f"Tier {field.name}.", [*L, field.name])
                    extras[metric].add_metric([name, value], 1)
                elif isinstance(value, int | float):
                    if metric not in extras:
                        extras[metric] = f.gauge(metric, f"Tier {field.name}.", L)
                    extras[metric].add_metric([name], float(value))

    def _collect_policies(self, f: _Families, s: ManagerStatistics) -> None:
        """The cost model (promotion estimates, recompute) and write-through admission."""
        c = s.cost
        if c.recompute_seconds_per_block is not None:
            f.gauge(
                "recompute_seconds_per_block", "The engine's recompute cost per block."
            ).add_metric([], c.recompute_seconds_per_block)
        L = ["tier"]
        latency = f.gauge(
            "tier_promotion_latency_seconds", "Moving average of one promotion, per tier.", L
        )
        rate = f.gauge(
            "tier_promotion_throughput_bytes_per_second",
            "Moving average of one promotion's throughput, per tier.",
            L,
        )
        declined = f.counter(
            "tier_promotions_declined", "Promotions not started: tier slower than recompute.", L
        )
        for t in c.tiers:
            if t.latency_seconds is not None:
                latency.add_metric([t.name], t.latency_seconds)
            if t.throughput_bytes_per_second is not None:
                rate.add_metric([t.name], t.throughput_bytes_per_second)
            declined.add_metric([t.name], t.declined)
        admitted = f.counter("tier_writes_admitted", "Writes a tier's admission let through.", L)
        dropped = f.counter(
            "tier_writes_dropped", "Writes a tier's admission refused, by cause.", [*L, "cause"]
        )
        write_latency = f.gauge(
            "tier_write_latency_seconds", "Moving average of one write, per tier.", L
        )
        closed = f.gauge("tier_write_closed", "1 while a tier refuses writes (too slow).", L)
        in_flight = f.gauge("tier_write_in_flight_bytes", "Bytes being written to a tier.", L)
        for a in s.admission:
            admitted.add_metric([a.name], a.admitted)
            _by(dropped, dict.fromkeys(_DROP_CAUSES, 0) | a.dropped_by_cause, a.name)
            if a.write_latency_seconds is not None:
                write_latency.add_metric([a.name], a.write_latency_seconds)
            closed.add_metric([a.name], float(a.closed))
            in_flight.add_metric([a.name], a.in_flight_bytes)

    def __repr__(self) -> str:
        return f"<KVTierCollector namespace={self.namespace!r} manager={self.manager!r}>"


# -- serving /metrics from the event loop ---------------------------------------------------

_MAX_REQUEST_HEAD = 16 << 10
_REQUEST_TIMEOUT = 5.0


class MetricsServer:
    """An HTTP endpoint for Prometheus on the current event loop; see ``serve_metrics``."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str) -> None:
        self.registry = registry
        self.host = host
        self.port = port  # the bound port once entered (useful with port=0)
        self._prometheus = _prometheus()
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self.scrapes = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def __aenter__(self) -> Self:
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._listener, self._task_group = listener, task_group
        task_group.start_soon(listener.serve, self._handle)
        logger.info("serving kvtier metrics on %s", self.url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        task_group, self._task_group = self._task_group, None
        listener, self._listener = self._listener, None
        if task_group is None or listener is None:
            return
        task_group.cancel_scope.cancel()
        try:
            await task_group.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(_REQUEST_TIMEOUT):
                    head = await _read_head(stream)
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, ValueError):
                return
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:])
            }
            status, content_type, body = self._respond(parts, headers.get("accept", ""))
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1")
                    + (b"" if parts[0] == "HEAD" else body)
                )

    def _respond(self, parts: list[str], accept: str) -> tuple[str, str, bytes]:
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if target not in ("/metrics", "/"):
            return "404 Not Found", "text/plain", b"kvtier metrics are at /metrics\n"
        encoder, content_type = self._prometheus.exposition.choose_encoder(accept)
        self.scrapes += 1
        return "200 OK", content_type, encoder(self.registry)

    def __repr__(self) -> str:
        state = "serving" if self._task_group is not None else "closed"
        return f"<MetricsServer {state} {self.url} scrapes={self.scrapes}>"


async def _read_head(stream: anyio.abc.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > _MAX_REQUEST_HEAD:
            raise ValueError("request head too large")
        data += await stream.receive()
    return data.split(b"\r\n\r\n", 1)[0]


def serve_metrics(
    manager: TieringManager,
    port: int,
    host: str = "127.0.0.1",
    *,
    scheduler: OffloadScheduler | None = None,
    latency: LatencyHistograms | None = None,
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve Prometheus metrics for ``manager`` at ``http://host:port/metrics``::

        async with serve_metrics(manager, 9464) as server:
            ...  # the serving loop

    A fresh ``CollectorRegistry`` with one ``KVTierCollector`` is used unless ``registry`` is
    given (then the collector is added to it). ``port=0`` picks a free port (``server.port``).
    """
    prometheus = _prometheus()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int from 0 to 65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"host must be an address such as '127.0.0.1', got {host!r}")
    if registry is None:
        registry = prometheus.CollectorRegistry()
    registry.register(KVTierCollector(manager, scheduler=scheduler, latency=latency))
    return MetricsServer(registry, port, host)
