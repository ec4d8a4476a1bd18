"""What the collector and the server share: the ``metrics`` extra, imported when first used,
and the metric families of one scrape, built under one namespace in the order they are made."""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.common._errors import ExtraNotInstalledError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["Families", "add_by", "prometheus"]


def prometheus() -> types.ModuleType:
    """prometheus_client, or an error that names the extra to install."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ExtraNotInstalledError("Prometheus metrics", "metrics", "prometheus_client") from exc
    return prometheus_client


class Families:
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


def add_by(family: Any, values: Mapping[str, float], *prefix: str) -> None:
    """One sample per ``values`` item, its key the last label (after ``prefix``), sorted."""
    for label, value in sorted(values.items()):
        family.add_metric([*prefix, label], value)
