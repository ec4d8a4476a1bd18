"""The bookkeeping of a primary pool, as a synchronous state machine.

Every pool (host or CUDA) owns one ``SlotTable`` and does its copies around it. Nothing here
awaits, so a cancelled task can never leave the table half updated, and the table can be
tested without an event loop.

Slot life: FREE -> WRITING (reserved for a key) -> READY (readable) -> FREE (evicted or
dropped); WRITING -> FREE when the write fails. Readers pin READY slots; only unpinned READY
slots are evictable. A WRITING slot may be *lent* (``lend``): something outside the table
(a worker thread a deadline walked away from) may still write into it, so when its write is
aborted the key leaves at once but the slot is reused only once it is given back.

The table tells its policy which keys form one request's chain, so that the tail of a chain
leaves before its head (see ``kvtier.pools._policy``): the prefix scan touches a request's
hits tail first and remembers where that prefix ended; a store that continues it (its first
key is the one the scan stopped at) reorders the whole chain, prefix and stored blocks, tail
first, once they are placed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from enum import IntEnum
from itertools import takewhile

from kvtier.common._freeze import snapshot
from kvtier.common._lookup import LookupResult
from kvtier.pools._policy import Demotes, EvictionPolicy

__all__ = ["PoolStatistics", "SlotState", "SlotTable"]


class SlotState(IntEnum):
    """Where a slot is in its life: free, being written, or ready to read."""

    FREE = 0
    WRITING = 1
    READY = 2


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A pool's slots by state, its size, and what it counted since it opened."""

    num_blocks: int
    block_bytes: int
    free: int
    writing: int
    ready: int
    pinned: int
    pins: int
    reservations: int
    reservation_failures: int
    commits: int
    aborts: int
    evictions: int
    policy: str


# Prefix scans remembered for the store that may continue them: a few per request in flight.
_CHAINS_KEPT = 1024


class SlotTable:
    def __init__(self, num_blocks: int, policy: EvictionPolicy) -> None:
        self.num_blocks = num_blocks
        self.policy = policy
        self._state = [SlotState.FREE] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._pins = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        # WRITING and READY keys. Public (read-only) so that a lookup past the READY keys asks
        # whether a block is being written with one dict lookup.
        self.held: dict[bytes, int] = {}
        # Lent slots -> whether their write was aborted (then free once given back).
        self._lent: dict[int, bool] = {}
        # READY keys only. Public so the manager's hit path is one dict lookup; read-only.
        self.ready: dict[bytes, int] = {}
        # READY keys with no pin: what may be evicted. The policy asks about each key it
        # offers, and a set's own method answers without a Python frame.
        self._unpinned: set[bytes] = set()
        self._pinned_slots = 0
        self._reservations = 0
        self._reservation_failures = 0
        self._commits = 0
        self._aborts = 0
        self._evictions = 0
        # Called with (key, slot, evicted) when ``key`` leaves the table: evicted True when an
        # eviction is about to reuse ``slot`` (its bytes are still there: the manager copies a
        # promoted block up to a faster tier then), False when it was discarded.
        self.on_leave: Callable[[bytes, int, bool], None] | None = None
        # The first key a prefix scan could not serve -> the keys it scanned (the scan's own
        # sequence, no new object): a store starting at that key continues the chain.
        self._chains: dict[bytes, Sequence[bytes]] = {}

    # -- queries -----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if key in self.ready:
            self.policy.touch(key)
            return LookupResult.HIT
        if key in self.held:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def ready_prefix(self, keys: Sequence[bytes]) -> int:
        """Count the leading READY keys and touch them, tail first (the head of the chain
        becomes the youngest); the scheduler's fast path. Where the prefix stops short, the
        table remembers it for the store that continues the chain."""
        n = len(list(takewhile(self.ready.__contains__, keys)))  # C-speed, no Python frame
        if n == len(keys):
            self.policy.touch_many(reversed(keys))
        elif n:
            self.policy.touch_many(reversed(keys[:n]))
            chains = self._chains
            chains[keys[n]] = keys
            if len(chains) > _CHAINS_KEPT:
                del chains[next(iter(chains))]
        return n

    def place_chain(self, keys: Sequence[bytes]) -> None:
        """``keys`` (head first) were just stored for one request: reorder its chain tail
        first, with the prefix its scan served before them when that scan is remembered, so
        the policy evicts the chain from its tail. Keys no longer READY are left out."""
        if not keys:
            return
        chain: Sequence[bytes] = keys
        scanned = self._chains.pop(keys[0], None)
        if scanned is not None:
            chain = [*scanned[: scanned.index(keys[0])], *keys]
        self.policy.reorder(filter(self.ready.__contains__, reversed(chain)))

    def demote(self, keys: Sequence[bytes]) -> int:
        """Make the unpinned READY ``keys`` (head first) the next to be evicted, the tail
        first; the others are left as they are. How many were demoted (0 with a policy that
        cannot, see ``Demotes``)."""
        policy = self.policy
        if not isinstance(policy, Demotes):
            return 0
        ready, unpinned = self.ready, self._unpinned
        chosen = [k for k in keys if k in ready and k in unpinned]
        policy.demote(chosen)
        return len(chosen)

    def spare(self) -> int:
        """Slots a guess may fill without evicting a block in use: the free ones, and the
        unpinned demoted blocks still the next to go (0 of those with a policy that cannot
        demote)."""
        policy = self.policy
        cold = policy.demoted() if isinstance(policy, Demotes) else ()
        unpinned = self._unpinned
        return len(self._free) + sum(1 for key in cold if key in unpinned)

    def state_of(self, key: bytes) -> SlotState:
        slot = self.held.get(key)
        return SlotState.FREE if slot is None else self._state[slot]

    def slot_state(self, slot: int) -> SlotState:
        return self._state[slot]

    def key_of(self, slot: int) -> bytes | None:
        return self._key[slot]

    def pin_count(self, slot: int) -> int:
        return self._pins[slot]

    # -- transitions ---------------------------------------------------------------------------

    def try_reserve(self, key: bytes) -> int | None:
        """Take a slot for ``key`` (state WRITING), evicting if needed; None when full.

        The caller checks first that ``key`` is not in the table.
        """
        assert key not in self.held, "key already has a slot"
        if self._free:
            slot = self._free.pop()
        else:
            # Pins are only ever on READY slots: when every READY slot is pinned nothing can
            # go, and saying so costs O(1) instead of a policy walk over the whole pool.
            if not self._unpinned:
                self._reservation_failures += 1
                return None
            victim = self.policy.victim(key, self._unpinned.__contains__)
            if victim is None:
                self._reservation_failures += 1
                return None
            self._unpinned.remove(victim)
            slot = self.ready.pop(victim)
            del self.held[victim]
            self.policy.remove(victim, evicted=True)
            self._evictions += 1
            if self.on_leave is not None:
                self.on_leave(victim, slot, True)
        self._state[slot] = SlotState.WRITING
        self._key[slot] = key
        self.held[key] = slot
        self._reservations += 1
        return slot

    def reserve_new(self, keys: Sequence[bytes]) -> tuple[list[int], list[int], int]:
        """``try_reserve`` for each of ``keys`` not in the table yet, in one call (a store
        of a request's blocks): the positions in ``keys`` that got a slot, their slots, and
        how many keys were already present. A key given twice is reserved once."""
        positions: list[int] = []
        slots: list[int] = []
        present = 0
        slot_of = self.held
        reserve = self.try_reserve
        for i, key in enumerate(keys):
            if key in slot_of:
                present += 1
                continue
            slot = reserve(key)
            if slot is None:
                continue
            positions.append(i)
            slots.append(slot)
        return positions, slots, present

    def commit(self, slot: int) -> None:
        """The write into ``slot`` finished: its key becomes readable."""
        assert self._state[slot] is SlotState.WRITING, "commit of a slot not WRITING"
        assert slot not in self._lent, "commit of a slot still lent"
        key = self._key[slot]
        assert key is not None
        self._state[slot] = SlotState.READY
        self.ready[key] = slot
        self._unpinned.add(key)
        self.policy.insert(key)
        self._commits += 1

    def abort(self, slot: int) -> None:
        """The write into ``slot`` failed or was cancelled: free it."""
        assert self._state[slot] is SlotState.WRITING, "abort of a slot not WRITING"
        self._aborts += 1
        if slot in self._lent:  # still written into: the key goes now, the slot later
            self._lent[slot] = True
            key = self._key[slot]
            assert key is not None
            del self.held[key]
            self._state[slot] = SlotState.FREE
            self._key[slot] = None
            return
        self._release(slot)

    def lend(self, slot: int) -> None:
        """Something may still write into the WRITING ``slot`` after its writer has given up;
        until ``give_back``, the slot can be aborted but not committed nor reused."""
        assert self._state[slot] is SlotState.WRITING, "lend of a slot not WRITING"
        assert slot not in self._lent, "slot lent twice"
        self._lent[slot] = False

    def give_back(self, slot: int) -> None:
        """Nothing writes into the lent ``slot`` any more: free it if its write was aborted."""
        if self._lent.pop(slot):
            self._free.append(slot)

    @property
    def lent(self) -> int:
        """Slots lent out (their writes aborted or not)."""
        return len(self._lent)

    def pin(self, key: bytes) -> int | None:
        """Pin the READY slot of ``key`` so it cannot be evicted; None if not READY."""
        slot = self.ready.get(key)
        if slot is None:
            return None
        if self._pins[slot] == 0:
            self._pinned_slots += 1
            self._unpinned.discard(key)
        self._pins[slot] += 1
        return slot

    def unpin(self, slot: int) -> None:
        assert self._pins[slot] > 0, "unpin of a slot that is not pinned"
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._pinned_slots -= 1
            key = self._key[slot]
            assert key is not None
            self._unpinned.add(key)

    def discard(self, key: bytes) -> bool:
        """Drop an unpinned READY ``key`` (for example, its bytes are known bad)."""
        slot = self.ready.get(key)
        if slot is None or self._pins[slot]:
            return False
        del self.ready[key]
        self._unpinned.discard(key)
        self.policy.remove(key, evicted=False)
        self._release(slot)
        if self.on_leave is not None:
            self.on_leave(key, slot, False)
        return True

    def _release(self, slot: int) -> None:
        key = self._key[slot]
        assert key is not None
        del self.held[key]
        self._state[slot] = SlotState.FREE
        self._key[slot] = None
        self._free.append(slot)

    # -- observation -------------------------------------------------------------------------

    def statistics(self, block_bytes: int) -> PoolStatistics:
        ready = len(self.ready)
        free = len(self._free)
        return snapshot(
            PoolStatistics,
            self,
            "_",
            num_blocks=self.num_blocks,
            block_bytes=block_bytes,
            free=free,
            writing=self.num_blocks - free - ready,
            ready=ready,
            pinned=self._pinned_slots,
            pins=sum(self._pins),
            policy=self.policy.name,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the table contradicts itself (used by tests)."""
        assert len(self._free) == len(set(self._free))
        for slot in range(self.num_blocks):
            state, key = self._state[slot], self._key[slot]
            if state is SlotState.FREE:
                assert key is None and self._pins[slot] == 0
                assert (slot in self._free) != self._lent.get(slot, False)
            else:
                assert key is not None and self.held[key] == slot
                assert (key in self.ready) == (state is SlotState.READY)
                assert state is SlotState.READY or self._pins[slot] == 0
        lent_free = sum(self._lent.values())
        assert len(self.held) + len(self._free) + lent_free == self.num_blocks
        assert sum(1 for p in self._pins if p) == self._pinned_slots
        assert self._unpinned == {k for k, slot in self.ready.items() if not self._pins[slot]}
        if isinstance(self.policy, Sized):
            assert len(self.policy) == len(self.ready)
