"""What every write from the pool to the secondary tiers counts against and reports to.

Three kinds of writes share one account: the write-through of a stored or promoted block
(``kvtier._cascade``), the write-backs, and the deferred copies (``kvtier._copydown``). Each
takes its bytes in flight against one global ``max_in_flight_bytes`` before its task starts
and gives them back when it ends, counts itself in the counters the manager's statistics
show, and runs in the manager's task group (``task_group``, None while closed) as one of the
``cascades`` that closing waits for.
"""

from __future__ import annotations

import anyio.abc

from kvtier._background import InFlight
from kvtier._errors import TierError
from kvtier._lookup import MissReason

__all__ = ["WriteAccount", "bump", "reason_of"]


def bump(counter: dict[str, int], reason: MissReason) -> None:
    counter[reason.value] = counter.get(reason.value, 0) + 1


def reason_of(exc: BaseException) -> MissReason:
    """The miss reason a failed tier operation is counted and remembered under."""
    if isinstance(exc, TimeoutError):
        return MissReason.TIMEOUT
    if isinstance(exc, TierError):
        return exc.reason
    return MissReason.UNAVAILABLE


class WriteAccount:
    """The bytes in flight, the writes running and their counts (see the module doc)."""

    def __init__(self, block_bytes: int, max_in_flight_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.in_flight_bytes = 0
        self.cascades = InFlight()  # the writes running: what closing waits for
        self.started = self.succeeded = self.skipped = self.cancelled = 0
        self.failures: dict[str, int] = {}
        self.task_group: anyio.abc.TaskGroup | None = None  # the manager's, while open
        self.closing = False  # deferred writes then ignore latency: close_timeout bounds them

    def room(self) -> int:
        """How many more blocks the global in-flight limit takes now."""
        return (self.max_in_flight_bytes - self.in_flight_bytes) // self.block_bytes

    def take(self, count: int = 1) -> None:
        """``count`` writes start: their bytes are in flight, they run until ``finished``."""
        self.in_flight_bytes += self.block_bytes * count
        self.started += count
        for _ in range(count):
            self.cascades.started()
