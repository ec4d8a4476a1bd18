"""Where the TieringManager used to live; it is in ``kvtier.manager`` now."""

from __future__ import annotations

from kvtier.manager import ManagerStatistics, TieringManager

__all__ = ["ManagerStatistics", "TieringManager"]
