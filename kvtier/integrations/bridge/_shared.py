"""What the parts of one bridge share, and what its threads share under one lock.

The parts (the lookup snapshot, the jobs, the bridge itself) share the tier, the loop thread
and one burst logger. The engine's threads and the loop thread meet only under one
``threading.Lock``, held for dict and list operations alone: the condition that blocking
callers wait on, a generation counter that moves whenever a verdict or a job lands, and the
bridge's state.
"""

from __future__ import annotations

import threading
from typing import Final

from kvtier.common._logging import BurstLogger
from kvtier.integrations.bridge._loop import LoopThread
from kvtier.tiers._base import SecondaryTier

__all__ = ["ACCEPTING", "CLOSED", "OVERLOAD", "TIER_ERROR", "Shared"]

# Reasons a lookup or a job fails besides the tier's own (``MissReason``).
CLOSED: Final = "closed"  # the bridge was shut down, or its tier failed to open
OVERLOAD: Final = "overload"  # too many existence checks waiting
TIER_ERROR: Final = "tier_error"  # the tier raised or answered nonsense: a bug, contained
ACCEPTING: Final = ("opening", "open")  # the states that take new lookups and jobs


class Shared:
    """The tier, the loop thread (``thread.name`` names the bridge in messages) and the log;
    under ``lock``: the condition, the generation and the bridge's state, opening -> open ->
    closing -> closed, or failed (the tier did not open; it answers misses)."""

    __slots__ = ("changed", "generation", "lock", "log", "state", "thread", "tier")

    def __init__(self, tier: SecondaryTier, thread: LoopThread, log: BurstLogger) -> None:
        self.tier = tier
        self.thread = thread
        self.log = log
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.generation = 0
        self.state = "opening"

    @property
    def name(self) -> str:
        """The bridge's name, for messages."""
        return self.thread.name

    def landed(self) -> None:
        """Something landed (call under the lock): move the generation, wake the waiters."""
        self.generation += 1
        self.changed.notify_all()
