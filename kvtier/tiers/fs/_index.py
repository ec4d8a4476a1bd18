"""``lookup()`` answered from an ``FSTier``'s own index: the exclusive-folder mode.

When only this process writes a folder, the tier's index (built from the files at open, then
kept by every store, load, delete and eviction) is the truth, so an existence check needs no
``stat``: a key the index holds is a ``HIT`` and any other is a ``MISS`` (``not_found``) at
once, never ``RETRY`` (``FSTier`` itself answers ``RETRY`` for a key it is still writing:
that is not a miss). A shared folder cannot do this (another process may have written the
key since) and keeps the batched checks of ``AsyncLookupManager``.

A file removed behind the owner's back (by hand, by a tool that ignored the folder's lock)
still answers ``HIT`` until a load of it finds it gone, which makes it a miss and a
``not_found`` removed event, or until the next open rescans the folder (which removes every
file held before and gone since). That is the staleness bound: nothing checks the folder
periodically, because a ``stat`` per block per period would cost what the index saves, and the
manager only loads a block it is about to use, so the stale answer costs one failed read.

Failures still count: a key whose load failed (timeout, unavailable, corrupt) is remembered as
a miss with that reason for ``miss_ttl`` seconds, so the manager does not promote it again at
every lookup. The interface is ``AsyncLookupManager``'s, so the tier composes either one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Self

from anyio.abc import AsyncResource

from kvtier.common._lookup import HIT, LookupResult, MissReason
from kvtier.common._verdicts import VerdictStore, code_of, reason_of_code
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import CountedLookups, LookupStatistics

__all__ = ["IndexLookups", "IndexThenChecks"]


class IndexLookups(CountedLookups, AsyncResource):
    """Synchronous existence answers from ``holds(key)``, plus remembered failures."""

    def __init__(
        self,
        holds: Callable[[bytes], bool],
        *,
        miss_ttl: float,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._holds = holds
        self._miss_ttl = miss_ttl
        self._failed = VerdictStore(max_entries, clock=clock)  # held keys whose load failed
        self._open = False

    @property
    def is_open(self) -> bool:
        return self._open

    async def __aenter__(self) -> Self:
        self._open = True
        return self

    async def aclose(self) -> None:
        """Later lookups answer ``MISS`` (``unavailable``, or a remembered failure's reason);
        a second call does nothing."""
        self._open = False

    def lookup(self, key: bytes) -> LookupResult:
        code = self._failed.get(key)
        if code is not None:
            return self._miss(reason_of_code(code))
        if not self._open:
            return self._miss(MissReason.UNAVAILABLE)
        if self._holds(key):
            self._hits += 1
            return HIT
        return self._miss(MissReason.NOT_FOUND)

    def answers(self, key: bytes) -> bool:
        """Whether the index has an answer of its own for ``key``: it holds it, or its load
        failed lately."""
        return self._holds(key) or self._failed.get(key) is not None

    def record(self, key: bytes, present: bool, reason: MissReason = MissReason.NOT_FOUND) -> None:
        """A store landed (``present``), or ``key`` is gone or failed with ``reason``. Absence
        itself needs no memory (the index says it); failures of a held key do, and so does an
        eviction, so that its misses say ``evicted`` for ``miss_ttl``, as a shared folder's."""
        if present or reason is MissReason.NOT_FOUND:
            self._failed.forget(key)
            return
        self._failed.set(key, code_of(reason), self._miss_ttl)

    def statistics(self) -> LookupStatistics:
        return LookupStatistics(
            hits=self._hits,
            misses=self._misses,
            misses_by_reason=dict(self._miss_reasons),
            cached_verdicts=len(self._failed),
        )

    def __repr__(self) -> str:
        return f"<IndexLookups open={self._open} failed={len(self._failed)}>"


class IndexThenChecks(CountedLookups):
    """The owner's lookups while its catalog, loaded from a checkpoint, is not yet in line
    with the folder (``_reconcile``): a key the index holds is answered from it at once
    (``HIT``; the load verifies the bytes, so a stale entry costs a miss, never wrong bytes),
    any other is checked on the disk as a shared folder's are (another process may have
    stored it while this one was closed, or a kill -9 lost its log record). Verdicts go to
    both helpers."""

    def __init__(self, index: IndexLookups, checks: AsyncLookupManager) -> None:
        super().__init__()
        self._index = index
        self._checks = checks

    def lookup(self, key: bytes) -> LookupResult:
        return self.lookup_with_reason(key)[0]

    def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, MissReason | None]:
        if self._index.answers(key):
            return self._index.lookup_with_reason(key)
        return self._checks.lookup_with_reason(key)

    def record(self, key: bytes, present: bool, reason: MissReason = MissReason.NOT_FOUND) -> None:
        self._index.record(key, present, reason)
        self._checks.record(key, present, reason)

    def statistics(self) -> LookupStatistics:
        index, checks = self._index.statistics(), self._checks.statistics()
        reasons = dict(checks.misses_by_reason)
        for reason, count in index.misses_by_reason.items():
            reasons[reason] = reasons.get(reason, 0) + count
        return dataclasses.replace(
            checks,
            hits=checks.hits + index.hits,
            misses=checks.misses + index.misses,
            misses_by_reason=reasons,
            cached_verdicts=checks.cached_verdicts + index.cached_verdicts,
        )

    def __repr__(self) -> str:
        return f"<IndexThenChecks index={self._index!r} checks={self._checks!r}>"
