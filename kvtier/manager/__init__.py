"""The TieringManager and the parts it is built from, one job per module.

- ``_manager``: the async shell (lifecycle, ``lookup``'s primary hit, store and load,
  watching, statistics);
- ``_decision``: the synchronous lookup decision past a primary hit;
- ``_promotions``: promotion tasks and the copy up of promoted blocks;
- ``_transfers``: ``store`` and ``load``, the copies into the pool and out of it;
- ``_joining``: opening the tiers; a tier that cannot open is retried in the background and
  joins when it opens;
- ``_statistics``: the nested statistics snapshot;
- ``_config``: ``ManagerConfig``, the manager's settings;
- ``_cost``: the cost model behind "never slower than recompute", which the scheduler's scans
  consult too;
- ``_watch``: who waits for which key, and what a waiter sleeps on;
- ``_failures``: promotions that failed recently;
- ``_stack_config``: ``KVTierConfig``, one typed configuration for a whole stack (pool, tiers
  and manager), read from a TOML file.
"""

from __future__ import annotations

from kvtier.manager._config import ManagerConfig
from kvtier.manager._cost import CostModel, CostStatistics, TierCost
from kvtier.manager._manager import TieringManager
from kvtier.manager._stack_config import KVTierConfig
from kvtier.manager._statistics import ManagerStatistics

__all__ = [
    "CostModel",
    "CostStatistics",
    "KVTierConfig",
    "ManagerConfig",
    "ManagerStatistics",
    "TierCost",
    "TieringManager",
]
