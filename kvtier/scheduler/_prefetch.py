"""Prefetch: fetch a queued request's prefix while it waits for the engine.

An engine under backlog keeps a request queued before it gets a slot. ``prefetch`` starts, as
soon as the request is queued, what its ``lookup`` would do once scheduled: existence checks,
and promotions of the prefix up to its first miss, in the background. When the request is
scheduled its ``lookup`` finds those blocks as hits, or still in flight (HIT_PENDING: it
waits for them; nothing is promoted twice, the pool reserves one slot per key).

A prefetch is a resumable prefix scan (``kvtier.scheduler._progress``) run by a task in the
manager's task group, asking through a ``ScanBudget`` like an async lookup, so the cost model
("never promote from a tier slower than recompute") and lazy promotion hold for it. What it adds:

- a share of the pool: all prefetches together hold (pin, or are promoting) at most
  ``share`` of the pool's slots. A prefetch pins the hits it counts, head first, while the
  share has room (past it they are only touched: the youngest in the pool, not held); once
  the share is full it starts no promotion and waits until a prefetch gives its share back
  (claimed, cancelled or expired), then scans again; at its deadline its prefix ends where
  the share stopped it. Pinned blocks are never evicted, so a prefetch never evicts what a
  running request has pinned, and the rest of the pool stays for the running requests.
- a deadline (seconds): the prefetch stops waiting and promoting then;
- a TTL (seconds from the call): the blocks it holds and nobody claimed are let go then, and
  become ordinary cache entries;
- ``cancel()``, for a request aborted before it runs.

A *guess* (a session's bring-back before a predicted return, ``guess=True``) is held to
less, because it may not come true: it pins only the blocks it promoted itself (a block
still in the pool is left to the pool's order: holding it for a guess would shrink the pool
for everyone), it promotes only into the pool's spare slots (free ones, or blocks demoted as
unwanted: ``SlotTable.spare``), so it never evicts a block in use, and it scans again
whenever a prefetch gives back room or spare slots appear (its blocks may have left the pool
since its last scan).

The request's ``lookup`` (async, or a synchronous scan's answer) claims every prefetch of a
prefix of its keys: the prefetch stops, and its pins are given back once the lookup has its
answer (and has pinned what it counted).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import TYPE_CHECKING

import anyio

from kvtier.common._describe import describe
from kvtier.common._errors import LifecycleError
from kvtier.common._freeze import snapshot
from kvtier.common._lookup import MISS, RETRY, LookupResult, MissReason
from kvtier.manager._cost import ScanBudget
from kvtier.manager._watch import KeyWatch
from kvtier.pools._slots import SlotState
from kvtier.scheduler._progress import PrefixProgress

if TYPE_CHECKING:
    from kvtier.scheduler._protocols import SupportsPrefetch

__all__ = ["PrefetchHandle", "PrefetchState", "PrefetchStatistics", "Prefetches"]


@dataclass(frozen=True, slots=True)
class PrefetchStatistics:
    """What a scheduler's prefetches did, and hold now."""

    started: int
    """Prefetches started."""
    blocks_prefetched: int
    """Promotions prefetches started."""
    blocks_claimed: int
    """Prefetched blocks in the pool when their request's lookup claimed the prefetch."""
    blocks_expired: int
    """Prefetched blocks still unclaimed at the TTL (ordinary cache entries from then on)."""
    cancelled: int
    """Prefetches cancelled (their request was aborted)."""
    bytes_prefetched: int
    capped: int
    """Prefetches whose prefix ended at the share of the pool prefetches may hold."""
    held: int
    """Slots held now by all prefetches: pinned blocks and promotions in flight."""


class PrefetchState(enum.Enum):
    """Where a prefetch is: scanning (``RUNNING``), holding what it fetched (``HOLDING``),
    or ended: ``CLAIMED`` by its request's lookup, ``EXPIRED`` at its TTL, ``CANCELLED``."""

    RUNNING = "running"
    HOLDING = "holding"
    CLAIMED = "claimed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


SHARE_REASON = "prefetch_share"
"""The ``reason`` of a prefetch whose prefix ended because prefetches held their share."""
SPARE_REASON = "no_spare_slot"
"""The ``reason`` of a guess whose prefix ended because the pool had no spare slot."""


class PrefetchHandle:
    """One request's prefetch: ``cancel()`` it when the request is aborted; ``await
    wait()`` for the prefix it reached and ``await wait_ended()`` for its end (tests, or an
    engine that wants to know).

    ``prefix`` is the number of leading blocks the prefetch found or fetched (None while it
    runs, or when it stopped before an answer); ``reason``, when the prefix ends before the
    last key, says why (a ``kvtier.MissReason`` value, ``"prefetch_share"``, or for a guess
    ``"no_spare_slot"``). ``guess`` is True for a session's bring-back before a predicted
    return (see the module).
    """

    def __init__(
        self,
        owner: Prefetches,
        keys: Sequence[bytes],
        deadline: float,
        ttl: float,
        *,
        guess: bool = False,
    ) -> None:
        self.keys = keys
        self.guess = guess
        self.state = PrefetchState.RUNNING
        self.prefix: int | None = None
        self.reason: str | None = None
        self.prefetched = 0  # promotions this prefetch started
        self._owner = owner
        self._deadline = deadline
        self._ttl = ttl
        self._lease: list[int] = []  # the slots it pinned
        self._started: set[bytes] = set()  # the keys whose promotions it started
        self._reasons: dict[bytes, str] = {}  # why a key was a miss for this prefetch
        self._claiming = False  # a lookup claimed it: its pins go back with that answer
        # its latest scan stopped at the share (or, a guess, the spare), or counted hits
        # past the share that it could not pin (a bring-back)
        self._capped = False
        self._spare = 0  # a guess: spare slots it may still fill in this scan
        self._pinned: set[bytes] = set()  # a guess: its promoted blocks it pins, kept across scans
        self._held_now: int | None = None  # the share's use in this scan step (None: not taken)
        self._scope: anyio.CancelScope | None = None
        self._scanned = anyio.Event()  # the scan is over (answer, deadline, claim, cancel)
        self._ended = anyio.Event()  # claimed, expired or cancelled

    @property
    def held(self) -> int:
        """Slots this prefetch holds: its pins and its promotions in flight."""
        return len(self._lease) + self.in_flight()

    def in_flight(self) -> int:
        """Its promotions still in flight (each started by this prefetch alone: a key
        another prefetch is promoting is not fresh to it)."""
        state_of = self._owner.manager.pool.state_of
        writing = SlotState.WRITING
        return sum(1 for k in self._started if state_of(k) is writing)

    def fetched(self) -> int:
        """Blocks it promoted that are in the pool now."""
        ready = self._owner.manager.pool.table.ready
        return sum(1 for k in self._started if k in ready)

    @property
    def done(self) -> bool:
        return self._ended.is_set()

    async def wait(self) -> int | None:
        """Wait for the scan's first answer (or its end without one); the prefix reached
        (None without an answer)."""
        await self._scanned.wait()
        return self.prefix

    async def wait_ended(self) -> PrefetchState:
        """Wait until it is claimed, expired or cancelled; that end state."""
        await self._ended.wait()
        return self.state

    def cancel(self) -> None:
        """Stop the prefetch and give back everything it holds (its request was aborted).
        Promotions already in flight land as ordinary cache entries. Idempotent; a no-op
        once it has ended."""
        if self._end(PrefetchState.CANCELLED):
            self._owner.cancelled += 1

    # -- the owner's side --------------------------------------------------------------------

    def _end(self, state: PrefetchState, *, demote: bool = False) -> bool:
        """Move to an end ``state``, stop the task, release the pins; with ``demote``, the
        blocks it promoted become the next to be evicted (nobody used them). False if
        already ended."""
        if self._ended.is_set():
            return False
        self.state = state
        self._ended.set()
        self._scanned.set()
        if self._scope is not None:
            self._scope.cancel()
        self._owner.forget(self)
        self._unpin()
        if demote and self._started:
            started = self._started
            table = self._owner.manager.pool.table
            self._owner.blocks_demoted += table.demote([k for k in self.keys if k in started])
        self._owner.freed()
        return True

    def _pin(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the hits the scan counts, head first, as far as the share has room: past it
        they are only touched (the fast prefix made them the youngest), not held. A
        bring-back (``hold_found``) then scans again once the share has room: by its turn
        they may have left the pool, and the turn would wait for them on its request path."""
        owner = self._owner
        self._held_now = None  # pins change it: taken afresh at the next ask
        if self._ended.is_set():  # ended as its scan woke: nothing to hold for
            return []
        if owner.hold_found and not self.guess:
            return self._pin_found(keys)
        room = owner.limit - owner.held()
        if room <= 0:
            return []
        if self.guess:
            started, pinned = self._started, self._pinned
            ready = owner.manager.pool.table.ready
            keys = [k for k in keys if k in started and k not in pinned and k in ready][:room]
            pinned.update(keys)
        return owner.manager.pin_ready(keys[:room])

    def _pin_found(self, keys: Sequence[bytes]) -> list[int]:
        """A bring-back's pins: as far as the share has room, a block another bring-back
        holds already (a system prompt several sessions start with) taking none of it;
        capped (to scan again) when some are left unpinned."""
        owner = self._owner
        held, in_flight = owner.holding()
        room = owner.limit - len(held) - in_flight
        ready = owner.manager.pool.table.ready
        taken = 0
        for key in keys:
            slot = ready.get(key)
            if slot is not None and slot not in held:
                if room <= 0:
                    break
                room -= 1
            taken += 1
        if taken < len(keys):
            self._capped = True
        return owner.manager.pin_ready(keys[:taken])

    def _unpin(self) -> None:
        self._pinned.clear()
        lease, self._lease = self._lease, []
        if lease:
            self._owner.manager.unpin_slots(lease)

    def _ask(self, key: bytes, budget: ScanBudget) -> LookupResult:
        """The scan's ask: the budget's, but no promotion past the share, and the promotions
        it starts counted as this prefetch's.

        The share's use is taken once per scan step and counted on from there: within a
        step only this scan changes it (one more slot per promotion it starts), and taking
        it afresh for each key would cost a walk of every prefetch's keys per key."""
        owner = self._owner
        pool = owner.manager.pool
        fresh = key not in pool.table.ready and pool.state_of(key) is SlotState.FREE
        if fresh:
            if self._held_now is None:
                self._held_now = owner.held()
            if self._held_now >= owner.limit or (self.guess and self._spare <= 0):
                owner.capped_now(self)
                self._capped = True
                full = self._held_now >= owner.limit
                self._reasons[key] = SHARE_REASON if full else SPARE_REASON
                return MISS
        result = budget.ask(key)
        if result is MISS:
            self._reasons[key] = owner.manager.last_miss_reason
        elif fresh and result is RETRY and pool.state_of(key) is SlotState.WRITING:
            self._started.add(key)
            self._spare -= 1
            self.prefetched += 1
            owner.blocks_prefetched += 1
            if self._held_now is not None:
                self._held_now += 1
        return result

    async def run(self) -> None:
        """The prefetch's task: scan until an answer or the deadline, then hold what it
        counted until it is claimed, cancelled or its TTL passes."""
        owner = self._owner
        try:
            with anyio.CancelScope() as self._scope:
                if self._ended.is_set():
                    return  # ended before it ran
                ttl_at = anyio.current_time() + self._ttl
                with anyio.move_on_after(min(self._deadline, self._ttl)):
                    self._answered(await self._scan())
                    # scan again once a prefetch gives back its share; a guess, whenever
                    # the pool has spare slots again (its blocks may have left since)
                    while self._capped or self.guess:
                        await owner.wait_freed()
                        if not self._capped and owner.manager.pool.table.spare() <= 0:
                            continue
                        if not self.guess:  # a guess keeps its pins: a rescan adds to them
                            self._unpin()
                        self._answered(await self._scan())
                if self._ended.is_set():  # ended while its last scan step ran: stays ended
                    return
                self.state = PrefetchState.HOLDING
                self._scanned.set()
                with anyio.move_on_after(ttl_at - anyio.current_time()):
                    await self._ended.wait()
                    return
                owner.blocks_expired += self.fetched()
                self._end(PrefetchState.EXPIRED, demote=owner.demote_unused)
        finally:
            self._scanned.set()
            self._reasons.clear()
            if not self._ended.is_set() and not self._claiming:  # the manager closed
                self._end(PrefetchState.CANCELLED)

    def _answered(self, prefix: int) -> None:
        """A scan's answer: the prefix so far, and why it ends there (``wait`` returns at
        the first answer; a prefix the share cut grows when a later scan gets further)."""
        self.prefix = prefix
        keys = self.keys
        self.reason = self._reasons.get(keys[prefix]) if prefix < len(keys) else None
        self._scanned.set()

    async def _scan(self) -> int:
        owner = self._owner
        manager = owner.manager
        cost = manager.cost
        budget = ScanBudget(
            manager.lookup, self.keys, cost.clock(), cost.recompute_seconds_per_block
        )

        def ask(key: bytes, ctx: ScanBudget | None) -> LookupResult:
            return self._ask(key, budget)

        self._capped = False
        hit_prefix: Callable[[Sequence[bytes]], int] = manager.primary_hit_prefix
        if self.guess:  # a guess neither counts nor touches the blocks it finds as a use
            self._spare = manager.pool.table.spare()
            hit_prefix = _resident_prefix(manager.pool.table.ready)
        scan = PrefixProgress(self.keys, ask, self._pin, hit_prefix, holds=owner.hold_found)
        scan.lease = self._lease  # pins go straight to the handle: released by _end
        changes = KeyWatch()
        try:
            self._held_now = None
            result = scan.start()
            while result is None:
                manager.watch(scan.take_watches(), changes)
                await changes.wait()
                self._held_now = None  # others' prefetches moved on while this one waited
                result = scan.resume(changes.take())
            return result
        finally:
            manager.unwatch(scan.watched, changes)


def _resident_prefix(ready: Mapping[bytes, int]) -> Callable[[Sequence[bytes]], int]:
    """A count of the leading keys in ``ready`` that touches nothing (C-speed)."""

    def count(keys: Sequence[bytes]) -> int:
        return len(list(takewhile(ready.__contains__, keys)))

    return count


class Prefetches:
    """A scheduler's prefetches: starting them, claiming them at lookup, their counters."""

    def __init__(
        self,
        manager: SupportsPrefetch,
        *,
        share: float,
        ttl: float,
        demote_unused: bool = False,
        hold_found: bool = False,
        on_freed: Callable[[], None] | None = None,
    ) -> None:
        self.manager = manager
        self.share = share
        self.ttl = ttl
        # Guesses (session bring-backs) demote what nobody claimed; queued requests' blocks
        # stay as ordinary cache entries.
        self.demote_unused = demote_unused
        # Bring-backs hold what they find across a lead while other sessions' turns run:
        # a prefix found whole in the pool, and hits past the share once it has room (each
        # slot counted once). A queued request's prefetch holds the head it found before
        # what it waits for; one found whole is only touched (its request is next in line).
        self.hold_found = hold_found
        self._on_freed = on_freed
        self.blocks_demoted = 0
        self.limit = max(int(manager.pool.num_blocks * share), 0)
        self._active: set[PrefetchHandle] = set()
        self._by_last: dict[bytes, list[PrefetchHandle]] = {}  # keyed by each one's last key
        self.started = self.blocks_prefetched = self.blocks_claimed = 0
        self.blocks_expired = self.cancelled = self.capped = 0
        self._capped: set[PrefetchHandle] = set()
        self._freed = anyio.Event()

    def start(
        self, keys: list[bytes], deadline: float, ttl: float, *, guess: bool = False
    ) -> PrefetchHandle:
        handle = PrefetchHandle(self, keys, deadline, ttl, guess=guess)
        self.started += 1
        if keys:
            try:
                self.manager.run_soon(handle.run)
            except LifecycleError:  # a hint to a closed manager (an engine racing its
                handle.reason = MissReason.UNAVAILABLE.value  # shutdown): it ends at once
                handle.cancel()
                return handle
            self._active.add(handle)
            self._by_last.setdefault(keys[-1], []).append(handle)
        else:
            handle.prefix = 0
            handle._end(PrefetchState.EXPIRED)
        return handle

    def held(self) -> int:
        """Slots all prefetches hold against the share: their pins and their promotions in
        flight; with ``hold_found``, a slot several of them pinned counts once."""
        if not self.hold_found:
            return sum(h.held for h in self._active)
        pinned, in_flight = self.holding()
        return len(pinned) + in_flight

    def holding(self) -> tuple[set[int], int]:
        """The slots prefetches have pinned, each once, and their promotions in flight."""
        pinned: set[int] = set()
        in_flight = 0
        for handle in self._active:
            pinned.update(handle._lease)
            in_flight += handle.in_flight()
        return pinned, in_flight

    def freed(self) -> None:
        """A prefetch gave back what it held: wake the ones waiting for the share."""
        self._freed.set()
        self._freed = anyio.Event()
        if self._on_freed is not None:
            self._on_freed()

    def let_go(self, handle: PrefetchHandle) -> None:
        """End ``handle`` as cancelled, its unclaimed blocks demoted (the guess it was made
        for will not come true)."""
        if handle._end(PrefetchState.CANCELLED, demote=self.demote_unused):
            self.cancelled += 1

    async def wait_freed(self) -> None:
        await self._freed.wait()

    def capped_now(self, handle: PrefetchHandle) -> None:
        if handle not in self._capped:
            self._capped.add(handle)
            self.capped += 1

    def forget(self, handle: PrefetchHandle) -> None:
        self._active.discard(handle)
        self._capped.discard(handle)
        handles = self._by_last.get(handle.keys[-1]) if handle.keys else None
        if handles is not None and handle in handles:
            handles.remove(handle)
            if not handles:
                del self._by_last[handle.keys[-1]]

    def claim(self, keys: Sequence[bytes]) -> list[PrefetchHandle]:
        """The prefetches of a prefix of ``keys``, stopped (they keep their pins until
        ``release`` once the lookup has its answer)."""
        by_last = self._by_last
        if not by_last:
            return []
        claimed: list[PrefetchHandle] = []
        for key in keys:
            handles = by_last.pop(key, None)
            if handles is not None:
                claimed += handles
        for handle in claimed:
            handle._claiming = True
            if handle._scope is not None:
                handle._scope.cancel()
        return claimed

    def release(self, claimed: list[PrefetchHandle]) -> None:
        """The lookup that claimed these has its answer: count what they fetched for it and
        give back their pins."""
        for handle in claimed:
            self.blocks_claimed += handle.fetched()
            handle._end(PrefetchState.CLAIMED)

    def statistics(self) -> PrefetchStatistics:
        return snapshot(
            PrefetchStatistics,
            self,
            bytes_prefetched=self.blocks_prefetched * self.manager.pool.block_bytes,
            held=self.held(),
        )

    def __repr__(self) -> str:
        return describe("Prefetches", stats=self.statistics(), shown="started held capped")
