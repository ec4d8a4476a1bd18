"""The secondary tier interface (docs/design.md, "Tiers, writes and cost") and the counters every
tier keeps."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self, TypeVar

import anyio
from anyio.abc import AsyncResource

from kvtier.common._describe import describe
from kvtier.common._errors import (
    InvalidArgumentError,
    TierContractError,
    TierError,
    TierTimeoutError,
)
from kvtier.common._freeze import snapshot
from kvtier.common._lending import Lender
from kvtier.common._logging import BurstLogger
from kvtier.common._lookup import MISS, LookupResult, MissReason

__all__ = [
    "BatchResults",
    "CountedLookups",
    "LookupStatistics",
    "SecondaryTier",
    "TierMeter",
    "TierStatistics",
    "one_per_key",
    "settled_lookup",
]

Listener = Callable[[bytes], None]
_Result = TypeVar("_Result")
# What a batch call returns: one entry per key, None where the block made it, else the error.
BatchResults = list[TierError | None]

_log = BurstLogger(logging.getLogger(__name__))


@dataclass(frozen=True, slots=True)
class LookupStatistics:
    """What a tier's ``lookup()`` answered and what its existence checks are doing."""

    hits: int = 0
    misses: int = 0
    retries: int = 0
    misses_by_reason: Mapping[str, int] = field(default_factory=dict)
    cached_verdicts: int = 0
    pending: int = 0
    in_flight: int = 0
    batches: int = 0
    keys_checked: int = 0


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """What one tier has done and holds: lookups, loads, stores, deletes, bytes and seconds
    each way, failures by reason, and its size; a snapshot from ``tier.statistics()``."""

    name: str
    lookups: LookupStatistics
    loads: int = 0
    stores: int = 0
    deletes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    failures_by_reason: Mapping[str, int] = field(default_factory=dict)
    evictions: int = 0
    blocks: int = 0
    bytes_stored: int = 0
    # Requests sent to the storage because ``lookup()`` was asked about a key the tier's own
    # index does not hold (a remote tier answering from an existence index keeps this at 0).
    request_path_requests: int = 0
    # Of ``loads``, those read on the event loop from the page cache, with no worker thread
    # (a file tier's ``loop_read_bytes``).
    loads_on_loop: int = 0


class CountedLookups(ABC):
    """The answers of a lookup helper (``AsyncLookupManager``, the FS index), counted, and
    the reason of its latest miss: a helper answers every ``MISS`` through ``_miss``, so
    ``lookup_with_reason`` has the reason at hand with the answer, at no cost to a hit."""

    def __init__(self) -> None:
        self._hits = 0
        self._misses = 0
        self._miss_reasons: dict[str, int] = {}
        self._last_miss = MissReason.NOT_FOUND

    @abstractmethod
    def lookup(self, key: bytes) -> LookupResult:
        """HIT, MISS or RETRY, without waiting; every MISS through ``_miss``."""

    def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, MissReason | None]:
        """``lookup(key)`` and, for a ``MISS``, the reason it was counted under."""
        result = self.lookup(key)
        return result, (self._last_miss if result is MISS else None)

    def _miss(self, reason: MissReason) -> LookupResult:
        self._misses += 1
        self._miss_reasons[reason.value] = self._miss_reasons.get(reason.value, 0) + 1
        self._last_miss = reason
        return MISS


@dataclass(slots=True)
class TierMeter:
    """Mutable counters behind ``TierStatistics``; tiers bump them, ``snapshot`` freezes them."""

    loads: int = 0
    stores: int = 0
    deletes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    evictions: int = 0
    loads_on_loop: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def read(self, nbytes: int, seconds: float) -> None:
        self.loads += 1
        self.bytes_read += nbytes
        self.read_seconds += seconds

    def wrote(self, nbytes: int, seconds: float) -> None:
        self.stores += 1
        self.bytes_written += nbytes
        self.write_seconds += seconds

    def failed(self, reason: MissReason | str) -> None:
        key = reason.value if isinstance(reason, MissReason) else reason
        self.failures[key] = self.failures.get(key, 0) + 1

    def snapshot(
        self,
        name: str,
        lookups: LookupStatistics,
        *,
        blocks: int = 0,
        bytes_stored: int = 0,
        request_path_requests: int = 0,
    ) -> TierStatistics:
        return snapshot(
            TierStatistics,
            self,
            name=name,
            lookups=lookups,
            failures_by_reason=dict(self.failures),
            blocks=blocks,
            bytes_stored=bytes_stored,
            request_path_requests=request_path_requests,
        )


class SecondaryTier(AsyncResource):
    """A store of whole blocks by key, below the primary pool.

    ``lookup`` is synchronous and must not do I/O: a tier whose existence checks are slow
    answers ``RETRY`` and resolves them in the background (compose an ``AsyncLookupManager``),
    then calls ``notify`` so waiting schedulers wake. The async methods raise ``TierError``
    subclasses; the manager turns those into misses with the error's reason.

    ``lookup_with_reason`` is ``lookup`` that also says why a ``MISS`` is one (the
    ``MissReason`` it is counted under; None with any other answer), for callers that report
    reasons (the engine bridge) without reading the statistics around each call. The default
    asks ``lookup`` and says ``not_found`` for a miss; a tier that knows more overrides it,
    answering and counting exactly as ``lookup`` would. A subclass that overrides ``lookup``
    alone gets that default again, so the two never disagree.

    A tier is an async context manager; ``aclose`` is idempotent and a closed tier can be
    opened again (a ``TieringManager`` re-entered re-opens its tiers).
    """

    #: How many blocks this tier would rather be given at once: a tier that packs stores
    #: arriving together into one object (S3) sets it to its pack size, and the manager
    #: then starts its deferred writes in groups of that many. 1: no preference.
    write_batch: int = 1
    #: Whether this tier's open says when its backend first answered (``_answer``; the S3
    #: tier does): a manager then waits only ``tier_answer_wait`` for a backend that says
    #: nothing, and up to ``tier_open_wait`` for an open that has answered. False: the whole
    #: open is waited for up to ``tier_open_wait``, as one that answered.
    tells_answer: bool = False

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: list[Listener] = []
        self.listener_failures = 0  # listeners that raised (contained: see notify)

    # -- lifecycle -----------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create folders, start background checks. The default needs nothing."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop background work and release resources; safe to call more than once."""

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    # -- the contract ------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "lookup" in vars(cls) and "lookup_with_reason" not in vars(cls):
            # An inherited lookup_with_reason answers for the parent's lookup, not this one.
            cls.lookup_with_reason = SecondaryTier.lookup_with_reason  # type: ignore[method-assign]

    @abstractmethod
    def lookup(self, key: bytes) -> LookupResult:
        """HIT, MISS or RETRY, without waiting."""

    def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, MissReason | None]:
        """``lookup(key)`` and, for a ``MISS``, its reason (None for any other answer); one
        lookup, counted once. The default cannot tell more than ``not_found``."""
        result = self.lookup(key)
        return result, (MissReason.NOT_FOUND if result is LookupResult.MISS else None)

    @abstractmethod
    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Which of ``keys`` the tier holds, asked of the storage itself."""

    @abstractmethod
    async def load(self, key: bytes, dst: memoryview) -> None:
        """Fill ``dst`` (exactly one block) with the verified bytes of ``key``."""

    @abstractmethod
    async def store(self, key: bytes, src: memoryview) -> None:
        """Store one block; storing a key that exists already is harmless."""

    @abstractmethod
    async def delete(self, key: bytes) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    @abstractmethod
    def statistics(self) -> TierStatistics: ...

    # -- batches -------------------------------------------------------------------------------

    async def load_many(
        self,
        keys: Sequence[bytes],
        dsts: Sequence[memoryview],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-batch bound with partial results
        pinned: bool = False,
        lender: Lender | None = None,
    ) -> BatchResults:
        """Load ``keys[i]`` into ``dsts[i]``; return, per key, None or the ``TierError``.

        A failed block does not fail the others: the result says which keys made it. Blocks
        not done when ``timeout`` seconds pass fail with ``TierTimeoutError`` and the call
        returns. Bad arguments raise ``InvalidArgumentError``; a cancelled call raises.

        ``pinned=True`` is the caller's promise that the buffers stay valid and unused until
        this call returns, even when it is cancelled or times out: a tier may then read
        straight into them and wait for I/O in flight instead of walking away from it (on a
        hung file system the call then returns when the I/O does). Engines that wait for
        their transfers (vLLM's ``drain_jobs``) can promise it; ``TieringManager``, whose
        deadlines must hold, does not. The default runs ``load`` for every key concurrently;
        a tier overrides it (or ``_load_batch``) to save per-block overhead.

        ``lender`` (``kvtier.common._lending``): the buffers are lent, so a tier may read straight
        into them and still return at the deadline, keeping through the lender each buffer
        a read it left running may still write (``TieringManager`` lends a host pool's
        slots this way). A tier that does not use it (``_load_lent``) loads as without it.
        """
        check_batch(keys, dsts, "dsts")
        deadline = batch_deadline(timeout)
        if lender is not None and not pinned:
            return await self._load_lent(keys, dsts, deadline, lender)
        return await self._load_batch(keys, dsts, deadline, pinned)

    async def store_many(
        self,
        keys: Sequence[bytes],
        srcs: Sequence[memoryview],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-batch bound with partial results
        pinned: bool = False,
    ) -> BatchResults:
        """Store ``srcs[i]`` under ``keys[i]``; per key, None or the ``TierError``.

        ``timeout`` and ``pinned`` as in ``load_many``: with ``pinned`` the tier may write
        straight from the caller's buffers instead of copying them first.
        """
        check_batch(keys, srcs, "srcs")
        return await self._store_batch(keys, srcs, batch_deadline(timeout), pinned)

    async def _load_batch(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        """``load_many`` once its arguments pair up and its deadline is known: ``load`` for
        every key concurrently."""
        calls = [functools.partial(self.load, k, d) for k, d in zip(keys, dsts, strict=True)]
        return await run_each(keys, calls, deadline, self.name, "load")

    async def _load_lent(
        self, keys: Sequence[bytes], dsts: Sequence[memoryview], deadline: float, lender: Lender
    ) -> BatchResults:
        """``load_many`` into lent buffers; by default as into buffers that are not."""
        return await self._load_batch(keys, dsts, deadline, False)

    async def _store_batch(
        self, keys: Sequence[bytes], srcs: Sequence[memoryview], deadline: float, pinned: bool
    ) -> BatchResults:
        """``store_many`` once its arguments pair up and its deadline is known: ``store`` for
        every key concurrently."""
        calls = [functools.partial(self.store, k, v) for k, v in zip(keys, srcs, strict=True)]
        return await run_each(keys, calls, deadline, self.name, "store")

    # -- feedback from the manager -----------------------------------------------------------

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        """A load of ``key`` failed for ``reason``: stop answering HIT for it for a while."""

    def record_hit(self, key: bytes) -> None:
        """``key`` was just stored here: answer HIT without asking the storage."""

    def demote(self, keys: Sequence[bytes]) -> int:
        """Let ``keys`` (a prefix's, head first) go first, the tail first, when this tier must
        evict (a session that ended no longer needs its own blocks); how many it holds and
        demoted. A tier that evicts nothing, or keeps no order, ignores it."""
        return 0

    # -- change notification -----------------------------------------------------------------

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(key)`` whenever the lookup answer for ``key`` may have changed."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def notify(self, keys: Iterable[bytes]) -> None:
        """Tell every listener about ``keys``. A listener that raises is logged (once per
        burst) and counted in ``listener_failures``, and the others still hear: notify runs
        inside background tasks whose task groups live in the engine's own task."""
        for key in keys:
            for listener in self._listeners:
                try:
                    listener(key)
                except Exception as exc:
                    self.listener_failures += 1
                    _log.warning(
                        "listener:" + self.name, "a listener of tier %s raised: %r", self.name, exc
                    )

    def __repr__(self) -> str:
        shown = "blocks bytes_stored lookups.hits lookups.misses lookups.pending lookups.in_flight"
        return describe(type(self).__name__, repr(self.name), stats=self.statistics(), shown=shown)


def check_batch(keys: Sequence[bytes], views: Sequence[memoryview], what: str) -> None:
    if len(keys) != len(views):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} {what}; pass one per key")


def one_per_key(
    results: Sequence[_Result], keys: Sequence[bytes], tier: str, operation: str
) -> Sequence[_Result]:
    """``results`` of a batch call, checked to hold one answer per key: a tier's answer is
    zipped with the keys it was asked about, and a short or long one must fail its own
    blocks rather than the task that settles them."""
    if len(results) != len(keys):
        raise TierContractError(
            f"answered {len(results)} results for {len(keys)} keys; a batch call returns one "
            "per key",
            tier=tier,
            operation=operation,
        )
    return results


def batch_deadline(timeout: float | None) -> float:
    """The ``anyio.current_time()`` deadline of a batch bounded by ``timeout`` seconds (the
    loop's own clock, which anyio's is on asyncio, read without asking which loop runs)."""
    if timeout is None:
        return math.inf
    if not isinstance(timeout, int | float) or not timeout > 0:
        raise InvalidArgumentError(
            f"timeout must be a positive number of seconds or None, got {timeout!r}"
        )
    return asyncio.get_running_loop().time() + timeout


async def run_each(
    keys: Sequence[bytes],
    calls: Sequence[Callable[[], Awaitable[None]]],
    deadline: float,
    tier: str,
    operation: str,
) -> BatchResults:
    """Run every call concurrently; collect each one's ``TierError`` (or None)."""
    results: list[TierError | None] = [None] * len(calls)
    finished = [False] * len(calls)

    async def one(i: int) -> None:
        try:
            await calls[i]()
        except TierError as exc:
            results[i] = exc
        finished[i] = True

    with anyio.CancelScope(deadline=deadline):
        async with anyio.create_task_group() as tg:
            for i in range(len(calls)):
                tg.start_soon(one, i)
    for i, done in enumerate(finished):
        if not done:
            results[i] = TierTimeoutError(
                "the batch's timeout passed first", tier=tier, operation=operation, key=keys[i]
            )
    return results


async def settled_lookup(tier: SecondaryTier, key: bytes) -> LookupResult:
    """``tier.lookup(key)`` once it answers something other than RETRY (its existence check
    or its write of ``key`` has ended), woken by the tier's notifications rather than a
    timer. It does not bound the wait: the caller does (tiers bound their checks)."""
    while True:
        changed = anyio.Event()

        def wake(k: bytes, changed: anyio.Event = changed) -> None:
            if k == key:
                changed.set()

        remove = tier.add_listener(wake)
        try:
            result = tier.lookup(key)
            if result is not LookupResult.RETRY:
                return result
            await changed.wait()
        finally:
            remove()
