"""What every write from the pool to the secondary tiers counts against and reports to.

Three kinds of writes share one account: the write-through of a stored or promoted block
(``_cascade``), the write-backs, and the deferred copies (``_copydown``). Each
takes its bytes in flight against one global ``max_in_flight_bytes`` before its task starts
and gives them back when it ends, counts itself in the counters the manager's statistics
show, and runs in the manager's task group (``task_group``, None while closed) as one of the
``cascades`` that closing waits for. The manager opens and closes the account through its
methods (``opened``, ``finish``, ``stopped``), so the fields they set stay the account's own.
``WriteThrough`` is this account, with the routing of each block on top.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.abc

from kvtier.common._background import Background, InFlight
from kvtier.common._errors import TierError
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import MissReason
from kvtier.pools._base import PrimaryPool
from kvtier.writes._admission import AdmissionPolicy

__all__ = ["WriteAccount", "bump", "reason_of_failure"]


def bump(counter: dict[str, int], reason: MissReason) -> None:
    counter[reason.value] = counter.get(reason.value, 0) + 1


def reason_of_failure(exc: BaseException) -> MissReason:
    """The miss reason a failed tier operation is counted and remembered under."""
    if isinstance(exc, TimeoutError):
        return MissReason.TIMEOUT
    if isinstance(exc, TierError):
        return exc.reason
    return MissReason.UNAVAILABLE


class WriteAccount:
    """What the writes share: the pool they read, the admission they report to, their
    deadline, the bytes in flight and the counters (see the module doc).

    ``background`` starts and counts every background task of the manager; ``callback``
    calls a tier's hook with its exceptions contained (the manager's ``_callback``).
    """

    def __init__(
        self,
        pool: PrimaryPool,
        admission: AdmissionPolicy,
        *,
        max_in_flight_bytes: int,
        store_timeout: float,
        background: Background,
        callback: Callable[..., None],
        log: BurstLogger,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.block_bytes = pool.block_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.store_timeout = store_timeout
        self.background = background
        self.callback = callback
        self.burst_log = log
        self.in_flight_bytes = 0
        self.cascades = InFlight()  # the writes running: what closing waits for
        self.started = self.succeeded = self.skipped = self.cancelled = 0
        self.failures: dict[str, int] = {}
        # The manager's task group, while open; None once it is stopped.
        self.task_group: anyio.abc.TaskGroup | None = None
        # Set while the manager closes: deferred writes then ignore latency, and
        # close_timeout bounds them.
        self.shutting_down = False

    def opened(self, task_group: anyio.abc.TaskGroup) -> None:
        """The manager is open: writes start in ``task_group`` until ``stopped``."""
        self.task_group = task_group

    async def finish(self, grace: float) -> None:
        """Let the writes in flight end for up to ``grace`` seconds (the manager's
        ``close_timeout``), shielded so that a cancelled ``aclose`` still gives them that
        time; those still running are counted as cancelled, since the manager cancels them
        next."""
        with anyio.move_on_after(grace, shield=True):
            await self.cascades.wait_zero()
        self.cancelled += self.cascades.count

    def stopped(self) -> None:
        """The manager's task group is about to be cancelled: a write that ends from now on
        starts nothing more in it."""
        self.task_group = None

    def room(self) -> int:
        """How many more blocks the global in-flight limit takes now."""
        return (self.max_in_flight_bytes - self.in_flight_bytes) // self.block_bytes

    def take(self, count: int = 1) -> None:
        """``count`` writes start: their bytes are in flight, they run until they end."""
        self.in_flight_bytes += self.block_bytes * count
        self.started += count
        for _ in range(count):
            self.cascades.started()

    def room_again(self) -> None:
        """A write ended (called before it stops counting, so that closing waits for what
        this starts): start what now fits. ``WriteThrough`` starts the write-backs and
        deferred copies; the bare account has nothing to start."""
