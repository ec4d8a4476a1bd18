"""Prometheus metrics for a ``TieringManager`` (the ``kvtier[metrics]`` extra).

The exporter is a *collector* (``_collector``, with the per-tier families in ``_tiers``): it
reads ``manager.statistics()`` (and the scheduler's, when given) at scrape time and turns the
frozen snapshots into metric families. The hot path pays nothing for it: no counter object is
touched per lookup, the counters kvtier keeps anyway are read once per scrape. A scrape costs
one ``statistics()`` call per component.

Histograms are the exception (``_histograms``): a distribution cannot be rebuilt from totals,
so latencies are recorded as they happen into a ``LatencyHistograms`` object, plain Python with
no dependency on prometheus_client (the core calls it without the extra installed), which the
collector exports next to the counters:

- lookup latency: the time ``await scheduler.lookup(keys)`` takes, end to end, which is what
  the engine waits for. Pass the histograms as the scheduler's ``latency=``, or time a call
  yourself: ``with histograms.time_lookup(): n = await scheduler.lookup(keys)``.
- promotion latency, per tier and outcome: pass the histograms as the manager's ``latency=``
  (``TieringManager(pool, tiers, latency=histograms)``); the manager calls
  ``histograms.observe_promotion(tier, seconds, ok)`` as each promotion ends.

``serve_metrics(manager, port)`` (``_server``) serves ``/metrics`` through prometheus_client's
WSGI app on a server thread that the ``async with`` block owns and joins; the collection itself
runs on the event loop, so no thread reads kvtier's counters while the loop updates them. Bind
it to 127.0.0.1 (the default) unless the scraper is on another machine. An engine that already
runs an ASGI server mounts ``metrics_asgi_app(manager)`` (prometheus_client's ASGI app) instead.

Two ``KVTierCollector`` for two managers cannot share one registry (their metric names would
collide); give each its own ``CollectorRegistry``.
"""

from __future__ import annotations

from kvtier._metrics._collector import KVTierCollector
from kvtier._metrics._histograms import DEFAULT_BUCKETS, LatencyHistograms
from kvtier._metrics._server import MetricsServer, metrics_asgi_app, serve_metrics

__all__ = [
    "DEFAULT_BUCKETS",
    "KVTierCollector",
    "LatencyHistograms",
    "MetricsServer",
    "metrics_asgi_app",
    "serve_metrics",
]
