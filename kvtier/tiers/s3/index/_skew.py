"""How far this node's wall clock is from the object store's, as the journal sees it.

Journal segment names carry the writer's wall time and a poll lists only the last
``index_lookback`` seconds (``_journal_format``), so a node whose clock is more than that behind the
others is never read and one ahead reads nobody. Every journal response's ``Date`` header
gives the server's time; a skew of more than half the lookback (and more than the header's
one-second resolution) is logged once until it recovers, and ``last`` keeps the last measure.
"""

from __future__ import annotations

import email.utils
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["ClockSkew"]

logger = logging.getLogger("kvtier.tiers.s3.index._sync")

_DATE_RESOLUTION = 1.0  # seconds: an HTTP Date header has whole seconds


class ClockSkew:
    """This node's clock (``wall``) against the ``Date`` of journal responses."""

    def __init__(self, name: str, lookback: float, wall: Callable[[], float]) -> None:
        self.name = name
        self._lookback = lookback
        self._limit = max(lookback / 2, 2 * _DATE_RESOLUTION)
        self._wall = wall
        self._warned = False
        self.last = 0.0  # this node's wall clock minus the server's, seconds

    def check(self, response: Any) -> None:
        """Compare this node's wall clock with the ``Date`` of a journal response; warn once
        while the skew is large enough to hide this node's segments (or theirs from it)."""
        try:
            date = response["ResponseMetadata"]["HTTPHeaders"]["date"]
            server = email.utils.parsedate_to_datetime(date).timestamp()
        except (KeyError, TypeError, ValueError, IndexError):
            return  # no usable Date header: nothing to compare
        self.last = skew = self._wall() - server
        if abs(skew) <= self._limit:
            self._warned = False
            return
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s: this node's clock is %.1f s %s the object store's; with index_lookback="
                "%.0f s, other nodes may %s through the journal: synchronise the clock (NTP)",
                self.name,
                abs(skew),
                "behind" if skew < 0 else "ahead of",
                self._lookback,
                "never see this node's writes" if skew < 0 else "stay unseen by this node",
            )
