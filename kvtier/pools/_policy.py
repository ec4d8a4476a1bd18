"""Eviction policies for the primary pool: which READY block to give up when a slot is needed.

A policy only orders keys; the slot table decides which keys are evictable (READY and not
pinned) and passes that test in, so a policy never has to know about pins.

Both shipped policies are chain-aware through the order the slot table hands them keys: a
prefix hit stops at the first missing block, so evicting the head of a request's chain makes
every later block of it useless. The table touches a request's hits tail first (``touch_many``
gets them in that order) and, once a store has placed the rest of a request's chain, hands
the whole chain to ``reorder`` tail first: within one request the tail is the older, so it
leaves before the head, as vLLM's block pool frees a request's blocks and a radix cache
evicts its leaves.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from itertools import islice, takewhile
from operator import not_
from typing import Protocol, runtime_checkable

from kvtier.common._arguments import check_type
from kvtier.common._errors import InvalidArgumentError

__all__ = [
    "POLICY_NAMES",
    "ARCPolicy",
    "Demotes",
    "EvictionPolicy",
    "LRUPolicy",
    "make_policy",
]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the slot table asks of a policy. Every method is synchronous and cheap."""

    name: str

    def insert(self, key: bytes) -> None:
        """``key`` became READY."""

    def touch(self, key: bytes) -> None:
        """``key`` was used (a hit or a load)."""

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """``keys`` were used, the last given most recently; lets the prefix fast path skip
        a Python loop (the slot table gives a request's hits tail first)."""

    def reorder(self, keys: Iterable[bytes]) -> None:
        """``keys`` (all in the pool) are one request's chain, tail first: place them as the
        most recently used, the last given the youngest, without counting a use (a policy
        that counts uses must not see a second one here)."""

    def remove(self, key: bytes, *, evicted: bool) -> None:
        """``key`` left the pool; ``evicted`` says the policy itself chose it."""

    def victim(self, incoming: bytes, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The key to evict to make room for ``incoming``, or None if nothing may go."""


@runtime_checkable
class Demotes(Protocol):
    """An optional capability of a policy (both shipped ones have it): place keys as the
    next to go. The pool demotes blocks fetched for a guess that did not come true, so a
    wrong guess gives its slots back before anything a request used; a policy without it
    lets those blocks age like any other."""

    def demote(self, keys: Iterable[bytes]) -> None:
        """``keys`` (all in the pool) become the least recently used, the last given the
        oldest, without counting a use."""

    def demoted(self) -> list[bytes]:
        """The demoted keys that are still the next to go (neither used nor evicted since),
        the next first: what a guess may replace without evicting a block anyone used
        since it was demoted."""


def _cold_run(order: OrderedDict[bytes, None], cold: set[bytes]) -> tuple[list[bytes], set[bytes]]:
    """The demoted keys at the front of ``order``, and the demoted set pruned to them.

    A demoted key that is used again moves away from the front; the hit path touches keys
    with a bare C call, so the set learns it here, not there: what is not at the front any
    more is dropped from the set at each call. Between two calls a used key would have to
    age through the whole pool to reach the front again, so the run is exact enough."""
    run = list(takewhile(cold.__contains__, order))
    return run, set(run) if len(run) < len(cold) else cold


def _first_evictable(
    order: OrderedDict[bytes, None], can_evict: Callable[[bytes], bool]
) -> bytes | None:
    """The oldest evictable key of ``order``. Pinned keys met on the way move to the young
    end: a pinned block is in use, and the next search need not walk past it again, so a
    burst of pins (write-through in flight) costs O(1) per eviction instead of O(pins). The
    walk and the moves run at C speed (no Python frame per key): in a small pool under load
    the pins of requests in flight sit in runs of hundreds at the old end."""
    for oldest in order:  # the common case, without building the walk below
        if can_evict(oldest):
            return oldest
        break
    pinned = len(list(takewhile(not_, map(can_evict, order))))
    if pinned == len(order):
        return None
    deque(map(order.move_to_end, list(islice(order, pinned))), maxlen=0)
    return next(iter(order))


class LRUPolicy:
    """Least recently used: evict the READY block untouched for longest."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()
        # The hit path calls this once per key: bind the C method directly, no Python frame.
        self.touch: Callable[[bytes], None] = self._order.move_to_end
        self._cold: set[bytes] = set()  # demoted; pruned by ``demoted`` (see _cold_run)

    def insert(self, key: bytes) -> None:
        self._order[key] = None

    def touch_many(self, keys: Iterable[bytes]) -> None:
        deque(map(self._order.move_to_end, keys), maxlen=0)

    reorder = touch_many  # a use and a reorder are the same move here

    def demote(self, keys: Iterable[bytes]) -> None:
        move, cold = self._order.move_to_end, self._cold
        for key in keys:
            move(key, last=False)
            cold.add(key)

    def demoted(self) -> list[bytes]:
        run, self._cold = _cold_run(self._order, self._cold)
        return run

    def remove(self, key: bytes, *, evicted: bool) -> None:
        self._order.pop(key, None)
        self._cold.discard(key)

    def victim(self, incoming: bytes, can_evict: Callable[[bytes], bool]) -> bytes | None:
        return _first_evictable(self._order, can_evict)

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive replacement (Megiddo and Modha, FAST '03), adapted to a slot pool.

    T1 holds blocks seen once, T2 blocks seen again; the ghost lists B1 and B2 remember keys
    recently evicted from each, and a hit on a ghost moves the target size ``p`` of T1. This
    keeps a burst of one-off prefixes (a scan) from flushing the shared system prompts.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self._c = capacity
        self._p = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._cold: set[bytes] = set()  # demoted, and not used since

    @property
    def target_t1(self) -> float:
        return self._p

    def insert(self, key: bytes) -> None:
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: bytes) -> None:
        self._cold.discard(key)
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        t1, t2, cold = self._t1, self._t2, self._cold
        for key in keys:
            cold.discard(key)
            if key in t1:
                del t1[key]
                t2[key] = None
            else:
                t2.move_to_end(key)

    def reorder(self, keys: Iterable[bytes]) -> None:
        t1, t2, cold = self._t1, self._t2, self._cold
        for key in keys:
            cold.discard(key)
            (t1 if key in t1 else t2).move_to_end(key)

    def demote(self, keys: Iterable[bytes]) -> None:
        t1, t2, cold = self._t1, self._t2, self._cold
        for key in keys:
            (t1 if key in t1 else t2).move_to_end(key, last=False)
            cold.add(key)

    def demoted(self) -> list[bytes]:
        cold = self._cold.__contains__
        return [*takewhile(cold, self._t1), *takewhile(cold, self._t2)]

    def remove(self, key: bytes, *, evicted: bool) -> None:
        self._cold.discard(key)
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
        self._trim_ghosts()

    def victim(self, incoming: bytes, can_evict: Callable[[bytes], bool]) -> bytes | None:
        t1_first = bool(self._t1) and (
            len(self._t1) > self._p or (incoming in self._b2 and len(self._t1) == int(self._p))
        )
        for lst in (self._t1, self._t2) if t1_first else (self._t2, self._t1):
            key = _first_evictable(lst, can_evict)
            if key is not None:
                return key
        return None

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while (
            self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * self._c
        ):
            self._b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


_POLICIES: dict[str, type[LRUPolicy] | type[ARCPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
POLICY_NAMES = tuple(_POLICIES)
"""The policies a pool builds by name (a pool's ``policy`` setting)."""


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """Build a policy from its name, or take a ready-made one (a custom policy)."""
    if isinstance(policy, str):
        try:
            return _POLICIES[policy](capacity)
        except KeyError:
            raise InvalidArgumentError(
                f"unknown eviction policy {policy!r}; use one of {sorted(_POLICIES)} "
                "or pass an object implementing kvtier.EvictionPolicy"
            ) from None
    check_type(policy, EvictionPolicy, "policy must be a name or an EvictionPolicy")
    return policy
