"""Latency distributions, recorded as they happen: plain Python, no prometheus_client.

A distribution cannot be rebuilt from totals, so unlike the counters the collector reads at
scrape time, latencies are observed one by one into a ``LatencyHistograms``. It is both
observers the runtime takes: the scheduler's ``latency=`` (``observe_lookup``, one per
``await scheduler.lookup(...)``) and the manager's ``latency=`` (``observe_promotion``, one per
finished promotion). Nothing here imports the ``metrics`` extra, so the hooks cost a ``bisect``
and three additions whether or not anything exports them.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.common._errors import InvalidArgumentError

__all__ = ["DEFAULT_BUCKETS", "HistogramSamples", "LatencyHistograms", "samples_of"]

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

        The manager calls it for each promotion when the histograms are its ``latency=``.
        """
        key = (tier, "succeeded" if ok else "failed")
        histogram = self._promotions.get(key)
        if histogram is None:
            histogram = self._promotions[key] = _Histogram(self.buckets)
        histogram.observe(seconds)

    def __repr__(self) -> str:
        promotions = sum(h.count for h in self._promotions.values())
        return f"<LatencyHistograms lookups={self._lookup.count} promotions={promotions}>"


@dataclass(frozen=True, slots=True)
class HistogramSamples:
    """One histogram as an exporter reads it: cumulative ``(le, count)`` buckets and the sum."""

    buckets: list[tuple[str, float]]
    sum: float


def samples_of(
    latency: LatencyHistograms,
) -> tuple[HistogramSamples, list[tuple[tuple[str, str], HistogramSamples]]]:
    """The lookup histogram, and each promotion histogram by ``(tier, outcome)`` in order."""
    lookup = latency._lookup
    promotions = [
        (labels, HistogramSamples(h.cumulative(), h.sum))
        for labels, h in sorted(latency._promotions.items())
    ]
    return HistogramSamples(lookup.cumulative(), lookup.sum), promotions
