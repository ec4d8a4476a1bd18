"""Answering ``lookup()`` for a tier whose existence checks are slow (docs/design.md, "The lookup
contract").

An unknown key is queued for the next batched ``contains_many`` and answered ``RETRY``; the
verdict lands in a bounded cache and listeners are told so waiting schedulers wake. Misses
expire after ``miss_ttl`` because another process may write the key to a shared tier; a check
that fails or times out becomes a miss with that reason. The bookkeeping (cache, pending,
in-flight) is synchronous; only the batch runner awaits.

Two details matter at scale:

- A verdict recorded from outside (a store landed, a load failed, the key was deleted) while a
  check of that key is in flight is newer than the check's answer, so the check's answer for
  that key is dropped instead of overwriting it (a stale MISS over a fresh HIT would hide the
  block for ``miss_ttl``).
- The cache is a ``VerdictStore``: one plain ``int`` per key, never a tuple or an enum member,
  so 100,000 cached verdicts add no work to the garbage collector's passes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Self

import anyio
import anyio.abc
from anyio.abc import AsyncResource

from kvtier.common._arguments import positive_int, positive_number
from kvtier.common._background import cancel_task_group, enter_task_group
from kvtier.common._errors import TierError
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import HIT, RETRY, LookupResult, MissReason
from kvtier.common._verdicts import PRESENT, VerdictStore, code_of, reason_of_code
from kvtier.tiers._base import CountedLookups, LookupStatistics

__all__ = ["AsyncLookupManager"]

logger = logging.getLogger(__name__)

ContainsMany = Callable[[list[bytes]], Awaitable[list[bool]]]


class AsyncLookupManager(CountedLookups, AsyncResource):
    """Batched, coalesced, cached existence checks behind a synchronous ``lookup()``."""

    def __init__(
        self,
        contains_many: ContainsMany,
        *,
        name: str = "tier",
        batch_size: int = 256,
        max_concurrency: int = 4,
        timeout: float = 5.0,
        miss_ttl: float = 2.0,
        hit_ttl: float | None = None,
        max_entries: int = 100_000,
        max_pending: int = 100_000,
        on_verdict: Callable[[list[bytes]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for count, label in (
            (batch_size, "batch_size"),
            (max_concurrency, "max_concurrency"),
            (max_entries, "max_entries"),
            (max_pending, "max_pending"),
        ):
            positive_int(count, label)
        for seconds, label in ((timeout, "timeout"), (miss_ttl, "miss_ttl")):
            positive_number(seconds, label)
        if hit_ttl is not None:
            positive_number(hit_ttl, "hit_ttl")
        super().__init__()
        self._contains_many = contains_many
        self.name = name
        self._batch_size = int(batch_size)
        self._max_concurrency = int(max_concurrency)
        self._timeout = float(timeout)
        self._miss_ttl = float(miss_ttl)
        self._hit_ttl = math.inf if hit_ttl is None else float(hit_ttl)
        self._max_entries = int(max_entries)
        self._max_pending = int(max_pending)
        self._on_verdict = on_verdict
        self._verdicts = VerdictStore(self._max_entries, clock=clock)
        self._pending: dict[bytes, None] = {}
        self._in_flight: set[bytes] = set()
        # Keys recorded or forgotten from outside while their check was in flight: that
        # check's answer is older than what we know now, so it is dropped for them.
        self._superseded: set[bytes] = set()
        self._wake = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._log = BurstLogger(logger)
        self._retries = 0
        self._batches = 0
        self._keys_checked = 0

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._task_group is not None

    async def __aenter__(self) -> Self:
        if self._task_group is not None:
            raise RuntimeError("AsyncLookupManager is already open")
        self._task_group = tg = await enter_task_group()
        tg.start_soon(self._run, tg)
        return self

    async def aclose(self) -> None:
        """Cancel the checks in flight; keys that were waiting become misses (unavailable)."""
        tg, self._task_group = self._task_group, None
        if tg is None:
            return
        await cancel_task_group(tg)
        dropped = list(self._pending)
        self._pending.clear()
        self._in_flight.clear()
        self._superseded.clear()
        self._emit(dropped)

    # -- synchronous answers ---------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        code = self._verdicts.get(key)
        if code is not None:
            if code == PRESENT:
                self._hits += 1
                return HIT
            return self._miss(reason_of_code(code))
        if key in self._pending or key in self._in_flight:
            self._retries += 1
            return RETRY
        if self._task_group is None:
            return self._miss(MissReason.UNAVAILABLE)
        if len(self._pending) + len(self._in_flight) >= self._max_pending:
            self._log.warning("overload", "%s: too many existence checks pending", self.name)
            return self._miss(MissReason.UNAVAILABLE)
        self._pending[key] = None
        self._wake.set()
        self._retries += 1
        return RETRY

    def record(self, key: bytes, present: bool, reason: MissReason = MissReason.NOT_FOUND) -> None:
        """Set the verdict for ``key`` from outside (a store landed, a load found it bad).

        It wins over a check of ``key`` in flight: that check's answer is ignored for this
        key. (A check still queued runs later, after this, so its answer is not stale.)
        """
        if key in self._in_flight:
            self._superseded.add(key)
        self._set(key, present, reason)

    def _set(self, key: bytes, present: bool, reason: MissReason) -> None:
        if present:
            self._verdicts.set(key, PRESENT, self._hit_ttl)
        else:
            self._verdicts.set(key, code_of(reason), self._miss_ttl)

    def holds(self, key: bytes) -> bool:
        """Whether the answer for ``key`` is a HIT now (not counted as a lookup)."""
        return self._verdicts.get(key) == PRESENT

    def forget(self, key: bytes) -> None:
        """Drop what is known about ``key`` (it was deleted); a check in flight for it is
        ignored too, since it may have looked before the delete."""
        self._verdicts.forget(key)
        if key in self._in_flight:
            self._superseded.add(key)

    def statistics(self) -> LookupStatistics:
        return LookupStatistics(
            hits=self._hits,
            misses=self._misses,
            retries=self._retries,
            misses_by_reason=dict(self._miss_reasons),
            cached_verdicts=len(self._verdicts),
            pending=len(self._pending),
            in_flight=len(self._in_flight),
            batches=self._batches,
            keys_checked=self._keys_checked,
        )

    def __repr__(self) -> str:
        return (
            f"<AsyncLookupManager {self.name!r} open={self.is_open} cached={len(self._verdicts)} "
            f"pending={len(self._pending)} in_flight={len(self._in_flight)}>"
        )

    # -- background ------------------------------------------------------------------------

    async def _run(self, tg: anyio.abc.TaskGroup) -> None:
        limiter = anyio.Semaphore(self._max_concurrency)
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._pending:
                await limiter.acquire()
                batch = []
                for key in self._pending:
                    batch.append(key)
                    if len(batch) == self._batch_size:
                        break
                for key in batch:
                    del self._pending[key]
                self._in_flight.update(batch)
                tg.start_soon(self._check, batch, limiter)

    async def _check(self, batch: list[bytes], limiter: anyio.Semaphore) -> None:
        try:
            reason: MissReason | None = None
            found: list[bool] = []
            try:
                with anyio.fail_after(self._timeout):
                    found = await self._contains_many(batch)
            except TimeoutError:
                reason = MissReason.TIMEOUT
            except TierError as exc:
                reason = exc.reason
            except Exception as exc:
                reason = MissReason.UNAVAILABLE
                self._log.warning("error", "%s: existence check failed: %r", self.name, exc)
            if reason is None and len(found) != len(batch):
                reason = MissReason.TIER_ERROR
                self._log.warning("answers", "%s: contains_many gave a wrong count", self.name)
            superseded = self._superseded
            if reason is not None:
                self._log.warning(
                    reason.value, "%s: existence checks resolve to miss (%s)", self.name, reason
                )
                for key in batch:
                    if key not in superseded:
                        self._set(key, False, reason)
            else:
                for key, present in zip(batch, found, strict=True):
                    if key not in superseded:
                        self._set(key, present, MissReason.NOT_FOUND)
            self._batches += 1
            self._keys_checked += len(batch)
        finally:
            limiter.release()
            self._in_flight.difference_update(batch)
            if self._superseded:
                self._superseded.difference_update(batch)
            self._emit(batch)

    def _emit(self, keys: list[bytes]) -> None:
        if keys and self._on_verdict is not None:
            self._on_verdict(keys)
