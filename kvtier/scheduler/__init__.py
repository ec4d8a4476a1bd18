"""The engine's side of kvtier: the ``OffloadScheduler`` and its prefetches.

- ``_scheduler``: prefix and sliding-window scans over any manager, and the async layer that
  waits for state changes instead of polling;
- ``_protocols``: what the scheduler needs of a manager, as typed protocols;
- ``_progress``: scans an async lookup resumes after each wake instead of starting over;
- ``_prefetch``: fetching a queued request's prefix while it waits for the engine.

The cost model the scans consult belongs to the manager (``kvtier.manager``).
"""

from __future__ import annotations

from kvtier.scheduler._prefetch import PrefetchHandle, PrefetchState, PrefetchStatistics
from kvtier.scheduler._scheduler import OffloadScheduler, SchedulerStatistics

__all__ = [
    "OffloadScheduler",
    "PrefetchHandle",
    "PrefetchState",
    "PrefetchStatistics",
    "SchedulerStatistics",
]
