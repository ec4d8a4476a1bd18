"""Eviction order on chains: a request's tail leaves the pool before its head, under every
policy kvtier ships (a prefix hit stops at the first missing block, so a chain without its
head is worth nothing)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier import ARCPolicy, LRUPolicy
from kvtier.pools._slots import SlotTable

POLICIES: dict[str, type[LRUPolicy] | type[ARCPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def chain(prefix: str, n: int) -> list[bytes]:
    return [key(f"{prefix}{i}") for i in range(n)]


def table_of(policy: str, n: int) -> SlotTable:
    return SlotTable(n, POLICIES[policy](n))


def store(table: SlotTable, keys: Sequence[bytes]) -> None:
    """What a store does: reserve and commit each new key head first, then place the chain."""
    slots = [table.try_reserve(k) for k in keys if k not in table.ready]
    for slot in slots:
        assert slot is not None
        table.commit(slot)
    table.place_chain(keys)


def evictions(table: SlotTable, count: int) -> list[bytes]:
    """The next ``count`` keys the table evicts, in order: each slot taken by a fresh key
    held WRITING (not evictable) until all are known, then freed."""
    gone: list[bytes] = []
    slots: list[int] = []
    for i in range(count):
        before = set(table.ready)
        slot = table.try_reserve(key(f"new{i}"))
        assert slot is not None
        slots.append(slot)
        (victim,) = before - set(table.ready)
        gone.append(victim)
    for slot in slots:
        table.abort(slot)
    return gone


@pytest.mark.parametrize("policy", POLICIES)
def test_a_stored_chain_leaves_tail_first(policy: str) -> None:
    table = table_of(policy, 4)
    a = chain("a", 4)
    store(table, a)
    assert evictions(table, 4) == a[::-1]
    table.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_hit_orders_the_chain_tail_first(policy: str) -> None:
    table = table_of(policy, 6)
    a, b = chain("a", 3), chain("b", 3)
    store(table, a)
    store(table, b)
    assert table.ready_prefix(a) == 3  # a is used again: it becomes the youngest, tail first
    assert evictions(table, 6) == [*b[::-1], *a[::-1]]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_store_continuing_a_scan_orders_the_whole_chain(policy: str) -> None:
    table = table_of(policy, 6)
    a = chain("a", 2)
    store(table, a)
    other = chain("o", 1)
    store(table, other)
    request = [*a, *chain("x", 3)]
    assert table.ready_prefix(request) == 2  # the scan stops at x0 ...
    store(table, request[2:])  # ... and the store that continues it places the whole chain
    assert evictions(table, 6) == [*other, *request[::-1]]


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_blocks_of_a_chain_are_skipped_not_reordered(policy: str) -> None:
    table = table_of(policy, 3)
    a = chain("a", 3)
    store(table, a)
    pinned = table.pin(a[2])  # the tail is in use: the next tail-most block goes instead
    assert pinned is not None
    assert evictions(table, 2) == [a[1], a[0]]
    table.unpin(pinned)
    table.check_invariants()


def test_a_store_of_an_evicted_chain_leaves_out_what_is_gone() -> None:
    table = table_of("lru", 3)
    a = chain("a", 3)
    store(table, a)
    request = [*a, key("x")]
    assert table.ready_prefix(request) == 3
    assert table.discard(a[0])  # gone before the store: the reorder skips it
    store(table, request[3:])
    assert evictions(table, 3) == [key("x"), a[2], a[1]]


def test_arc_reorder_is_not_a_second_use() -> None:
    """Placing a chain is not a hit: blocks seen once stay in ARC's T1 and leave before a
    block seen twice."""
    table = table_of("arc", 4)
    twice = key("twice")
    store(table, [twice])
    assert table.lookup(twice).name == "HIT"  # a real second use: T2
    a = chain("a", 3)
    store(table, a)
    assert evictions(table, 4) == [*a[::-1], twice]


@pytest.mark.parametrize("policy", [LRUPolicy, ARCPolicy])
def test_demoted_blocks_are_the_next_to_go_tail_first(policy: type[LRUPolicy | ARCPolicy]) -> None:
    table = SlotTable(4, policy(4))
    keys = [bytes([i]) * 16 for i in range(6)]
    for key in keys[:4]:
        slot = table.try_reserve(key)
        assert slot is not None
        table.commit(slot)
    pinned = table.pin(keys[2])
    assert pinned is not None
    # a guess fetched keys[1:4]; nobody used them: the pinned one stays, the rest go first
    assert table.demote(keys[1:4]) == 2
    evicted = []
    table.on_leave = lambda key, slot, was_evicted: evicted.append(key)
    for key in keys[4:]:
        assert table.try_reserve(key) is not None
    assert evicted == [keys[3], keys[1]]  # the tail of the guess before its head
    table.unpin(pinned)


@pytest.mark.parametrize("policy", [LRUPolicy, ARCPolicy])
def test_spare_slots_are_free_ones_and_demoted_blocks_nobody_used_since(
    policy: type[LRUPolicy | ARCPolicy],
) -> None:
    table = SlotTable(6, policy(6))
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys:
        slot = table.try_reserve(k)
        assert slot is not None
        table.commit(slot)
    assert table.spare() == 1  # one free slot, nothing demoted
    table.demote(keys[:3])
    assert table.spare() == 4
    assert set(table.policy.demoted()) == set(keys[:3])  # type: ignore[attr-defined]
    table.ready_prefix(keys[:1])  # used again: not spare any more
    pinned = table.pin(keys[1])  # pinned: not spare either
    assert pinned is not None
    assert table.spare() == 2
    table.unpin(pinned)
    assert table.spare() == 3
    for k in (b"x" * 16, b"y" * 16):  # a free slot, then a demoted block
        assert table.try_reserve(k) is not None
    assert table.spare() == 1
