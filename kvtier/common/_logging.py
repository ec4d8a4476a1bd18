"""Logging that stays quiet under a storm: a fault repeated for many keys logs once per burst."""

from __future__ import annotations

import logging
import time

__all__ = ["BurstLogger"]


class BurstLogger:
    """Logs the first occurrence of each fault kind, then at most one summary per window."""

    def __init__(self, logger: logging.Logger, window: float = 10.0) -> None:
        self._logger = logger
        self._window = window
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._window:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            self._logger.warning("%s (%d similar suppressed)", msg % args, suppressed)
        else:
            self._logger.warning(msg, *args)
