"""The engine's side of kvtier: the ``OffloadScheduler`` and its prefetches.

- ``_scheduler``: prefix and sliding-window scans over any manager, and the async layer that
  waits for state changes instead of polling;
- ``_protocols``: what the scheduler needs of a manager, as typed protocols;
- ``_progress``: scans an async lookup resumes after each wake instead of starting over;
- ``_prefetch``: fetching a queued request's prefix while it waits for the engine;
- ``_sessions``: the session table, a synchronous state machine that predicts when an agent
  session returns, plans bringing its prefix back, and says which sessions' private blocks
  may go first (ended, forgotten, quiet); ``_session_settings``: its settings;
- ``_bringback``: the async driver that acts on that plan, and the engine's ``Session``.

The cost model the scans consult belongs to the manager (``kvtier.manager``).
"""

from __future__ import annotations

from kvtier.scheduler._bringback import Session, SessionStatistics
from kvtier.scheduler._prefetch import PrefetchHandle, PrefetchState, PrefetchStatistics
from kvtier.scheduler._scheduler import OffloadScheduler, SchedulerStatistics
from kvtier.scheduler._session_settings import SessionSettings

__all__ = [
    "OffloadScheduler",
    "PrefetchHandle",
    "PrefetchState",
    "PrefetchStatistics",
    "SchedulerStatistics",
    "Session",
    "SessionSettings",
    "SessionStatistics",
]
