"""The TieringManager and the parts it is built from, one job per module.

- ``_manager``: the async shell (lifecycle, ``lookup``'s primary hit, store and load,
  watching, statistics);
- ``_decision``: the synchronous lookup decision past a primary hit;
- ``_promotions``: promotion tasks and the copy up of promoted blocks;
- ``_transfers``: ``store`` and ``load``, the copies into the pool and out of it;
- ``_statistics``: the nested statistics snapshot;
- ``_config``: ``ManagerConfig``, the manager's settings.
"""

from __future__ import annotations

from kvtier.manager._config import ManagerConfig
from kvtier.manager._manager import TieringManager
from kvtier.manager._statistics import ManagerStatistics

__all__ = ["ManagerConfig", "ManagerStatistics", "TieringManager"]
