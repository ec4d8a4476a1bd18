"""What the engine threads and the bridge's loop thread share, under one lock.

The engine's threads and the loop thread meet only here: one ``threading.Lock``, held for dict
and list operations alone, the condition that blocking callers wait on, a generation counter
that moves whenever a verdict or a job lands, and the bridge's state.
"""

from __future__ import annotations

import threading
from typing import Final

__all__ = ["ACCEPTING", "CLOSED", "OVERLOAD", "TIER_ERROR", "Shared"]

# Reasons a lookup or a job fails besides the tier's own (``MissReason``).
CLOSED: Final = "closed"  # the bridge was shut down, or its tier failed to open
OVERLOAD: Final = "overload"  # too many existence checks waiting
TIER_ERROR: Final = "tier_error"  # the tier raised or answered nonsense: a bug, contained
ACCEPTING: Final = ("opening", "open")  # the states that take new lookups and jobs


class Shared:
    """The lock, the condition and the generation, and the bridge's state: opening -> open
    -> closing -> closed, or failed (the tier did not open; it answers misses)."""

    __slots__ = ("changed", "generation", "lock", "state")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.generation = 0
        self.state = "opening"

    def landed(self) -> None:
        """Something landed (call under the lock): move the generation, wake the waiters."""
        self.generation += 1
        self.changed.notify_all()
