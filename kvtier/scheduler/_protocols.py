"""What the OffloadScheduler needs of a manager, as typed protocols (``TieringManager`` offers
them all): a plain ``lookup`` for the synchronous scans, watches, pins and the cost model for
the async lookup, and a task group and the pool's size for prefetch. A manager offering less
gets what it can: the scheduler checks which protocol it meets, never probes attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvtier.common._lookup import LookupResult
from kvtier.manager._cost import CostModel, ScanBudget
from kvtier.manager._watch import KeyWatch
from kvtier.pools._base import PrimaryPool

__all__ = ["Demotes", "SupportsLookup", "SupportsPrefetch", "SupportsScheduling"]


class Demotes(Protocol):
    """A tier that can let a prefix's blocks go first (``SecondaryTier.demote``)."""

    def demote(self, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class SupportsLookup(Protocol):
    """What every scan needs of a manager (docs/design.md, "The lookup contract"): ``lookup(key,
    ctx=None)``."""

    def lookup(self, key: bytes, ctx: ScanBudget | None = None) -> LookupResult: ...


@runtime_checkable
class SupportsScheduling(SupportsLookup, Protocol):
    """What the async lookup needs beyond ``lookup`` (``TieringManager`` has it all):

    - ``watch``/``unwatch``: sleep until a key the scan waits on changes state;
    - ``primary_hit_prefix``: count the leading primary hits in one call;
    - ``pin_ready``/``unpin_slots``: hold the hits a waiting scan has counted, so that its
      own promotions, or another request's, never evict them (without that a prefix larger
      than the free pool evicts itself and promotes the same blocks again);
    - ``cost``: each scan of the async lookup asks through a ``ScanBudget`` (lazy
      promotion, and the "never slower than recompute" rule).

    A manager without them still gets the synchronous scans, key by key.
    """

    @property
    def cost(self) -> CostModel: ...

    def primary_hit_prefix(self, keys: Sequence[bytes]) -> int: ...

    def pin_ready(self, keys: Sequence[bytes]) -> list[int]: ...

    def unpin_slots(self, slots: Sequence[int]) -> None: ...

    def watch(self, keys: Iterable[bytes], watch: KeyWatch | None = None) -> KeyWatch: ...

    def unwatch(self, keys: Iterable[bytes], watch: KeyWatch) -> None: ...


@runtime_checkable
class SupportsPrefetch(SupportsScheduling, Protocol):
    """What ``prefetch`` needs beyond a scan (``TieringManager`` has it): the ``pool`` (its
    size bounds the share prefetches may hold), ``run_soon`` (a prefetch is a task in the
    manager's task group, ended when the manager closes), ``last_miss_reason`` (where a
    prefetched prefix ended, and why) and ``tiers`` (an ended session's own blocks are
    demoted in those that evict)."""

    @property
    def pool(self) -> PrimaryPool: ...

    @property
    def last_miss_reason(self) -> str: ...

    @property
    def tiers(self) -> Sequence[Demotes]: ...

    def run_soon(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None: ...
