"""The slot table and eviction policies: synchronous state machines, tested without a loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import ARCPolicy, LookupResult, LRUPolicy, SlotState
from kvtier.pools._slots import SlotTable


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def ready_table(n: int, policy: str = "lru") -> SlotTable:
    table = SlotTable(n, LRUPolicy(n) if policy == "lru" else ARCPolicy(n))
    for i in range(n):
        slot = table.try_reserve(k(i))
        assert slot is not None
        table.commit(slot)
    return table


def writing_table() -> tuple[SlotTable, int]:
    """A one-slot LRU table whose slot is WRITING the block of ``k(1)``."""
    table = SlotTable(1, LRUPolicy(1))
    slot = table.try_reserve(k(1))
    assert slot is not None
    return table, slot


def test_slot_life_free_writing_ready() -> None:
    table = SlotTable(2, LRUPolicy(2))
    assert table.lookup(k(1)) is LookupResult.MISS
    slot = table.try_reserve(k(1))
    assert slot is not None
    assert table.slot_state(slot) is SlotState.WRITING
    assert table.lookup(k(1)) is LookupResult.HIT_PENDING
    assert table.pin(k(1)) is None  # cannot pin what is still being written
    table.commit(slot)
    assert table.lookup(k(1)) is LookupResult.HIT
    table.check_invariants()


def test_abort_frees_the_slot() -> None:
    table, slot = writing_table()
    table.abort(slot)
    assert table.lookup(k(1)) is LookupResult.MISS
    assert table.statistics(1).free == 1
    table.check_invariants()


def test_eviction_takes_the_least_recently_used_unpinned_block() -> None:
    table = ready_table(3)
    table.lookup(k(0))  # touch 0: 1 is now the oldest
    slot = table.try_reserve(k(10))
    assert slot is not None
    assert table.lookup(k(1)) is LookupResult.MISS
    assert table.statistics(1).evictions == 1
    table.check_invariants()


def test_pinned_and_writing_slots_are_never_evicted() -> None:
    table = ready_table(2)
    pinned = table.pin(k(0))
    assert pinned is not None
    writing = table.try_reserve(k(5))  # evicts 1, the only unpinned READY block
    assert writing is not None
    assert table.try_reserve(k(6)) is None  # 0 pinned, 5 writing: full
    assert table.statistics(1).reservation_failures == 1
    table.unpin(pinned)
    assert table.try_reserve(k(6)) is not None
    table.check_invariants()


def test_pins_are_reference_counted() -> None:
    table = ready_table(1)
    a = table.pin(k(0))
    b = table.pin(k(0))
    assert a == b and a is not None and b is not None
    table.unpin(a)
    assert table.try_reserve(k(9)) is None  # still pinned once
    table.unpin(b)
    assert table.try_reserve(k(9)) is not None


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_failed_reservation_does_not_walk_the_pinned_pool(policy: str) -> None:
    """Every slot pinned: each failed reservation costs O(1), not a walk over the pool
    (issue 11: a 1,000-key scan over a 10,000-block pinned pool took seconds)."""
    n = 500
    table = ready_table(n, policy)
    for i in range(n):
        assert table.pin(k(i)) is not None
    asked = 0
    victim = table.policy.victim

    def counting_victim(incoming: bytes, can_evict: Callable[[bytes], bool]) -> bytes | None:
        def counting(key: bytes) -> bool:
            nonlocal asked
            asked += 1
            return can_evict(key)

        return victim(incoming, counting)

    table.policy.victim = counting_victim  # type: ignore[method-assign]
    for i in range(n, 2 * n):
        assert table.try_reserve(k(i)) is None
    assert asked <= n, f"{asked} evictability checks for {n} failed reservations"
    assert table.statistics(1).reservation_failures == n
    table.unpin(table.ready[k(7)])  # k(7) is evictable now
    slot = table.try_reserve(k(n))
    assert slot is not None and table.key_of(slot) == k(n)
    table.check_invariants()


def test_ready_prefix_counts_and_touches() -> None:
    table = ready_table(4)
    assert table.ready_prefix([k(0), k(1), k(7), k(2)]) == 2
    assert table.ready_prefix([]) == 0
    # 0 and 1 were touched: 2 is now least recently used
    assert table.try_reserve(k(9)) is not None
    assert table.lookup(k(2)) is LookupResult.MISS


def test_arc_resists_a_scan() -> None:
    """Blocks used twice survive a one-off scan longer under ARC than under LRU."""

    def survivors(policy: str) -> int:
        table = ready_table(8, policy)
        for i in range(4):  # 0..3 become frequent
            table.lookup(k(i))
        for i in range(100, 120):  # a scan of one-off blocks
            slot = table.try_reserve(k(i))
            assert slot is not None
            table.commit(slot)
        table.check_invariants()
        return sum(table.state_of(k(i)) is SlotState.READY for i in range(4))

    assert survivors("arc") == 4
    assert survivors("lru") == 0


def test_repr_and_statistics_show_state() -> None:
    from kvtier import HostPool

    pool = HostPool(4, 64)
    slot = pool.try_reserve(k(1))
    assert slot is not None
    assert "writing=1" in repr(pool) and "free=3" in repr(pool)
    stats = pool.statistics()
    assert (stats.free, stats.writing, stats.ready) == (3, 1, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_pool_sizes_are_validated(bad: object) -> None:
    from kvtier import HostPool

    with pytest.raises(ValueError, match="must be a positive int"):
        HostPool(bad, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a positive int"):
        HostPool(4, bad)  # type: ignore[arg-type]


def test_unknown_policy_says_what_to_use() -> None:
    from kvtier import HostPool

    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        HostPool(4, 64, policy="mru")


class SlotTableMachine(RuleBasedStateMachine):
    """Random reserve/commit/abort/pin/unpin/lookup sequences keep the table consistent and
    agree with a plain model of what each key's state should be."""

    def __init__(self) -> None:
        super().__init__()
        self.table: SlotTable | None = None
        self.writing: dict[bytes, int] = {}
        self.pins: list[int] = []

    @rule(policy=st.sampled_from(["lru", "arc"]), n=st.integers(1, 6))
    @precondition(lambda self: self.table is None)
    def create(self, policy: str, n: int) -> None:
        self.table = SlotTable(n, LRUPolicy(n) if policy == "lru" else ARCPolicy(n))

    @rule(i=st.integers(0, 12))
    @precondition(lambda self: self.table is not None)
    def reserve(self, i: int) -> None:
        assert self.table is not None
        if self.table.state_of(k(i)) is not SlotState.FREE:
            return
        before = self.table.statistics(1)
        slot = self.table.try_reserve(k(i))
        if slot is None:
            # full means: no free slot and every READY slot is pinned
            assert before.free == 0 and before.ready == before.pinned
        else:
            self.writing[k(i)] = slot

    @rule(data=st.data())
    @precondition(lambda self: bool(self.writing))
    def commit_or_abort(self, data: st.DataObject) -> None:
        assert self.table is not None
        key = data.draw(st.sampled_from(sorted(self.writing)))
        slot = self.writing.pop(key)
        if data.draw(st.booleans()):
            self.table.commit(slot)
            assert self.table.lookup(key) is LookupResult.HIT
        else:
            self.table.abort(slot)
            assert self.table.lookup(key) is LookupResult.MISS

    @rule(i=st.integers(0, 12))
    @precondition(lambda self: self.table is not None)
    def pin(self, i: int) -> None:
        assert self.table is not None
        slot = self.table.pin(k(i))
        if slot is not None:
            self.pins.append(slot)
            assert self.table.key_of(slot) == k(i)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.pins))
    def unpin(self, data: st.DataObject) -> None:
        assert self.table is not None
        slot = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.table.unpin(slot)

    @rule(i=st.integers(0, 12))
    @precondition(lambda self: self.table is not None)
    def lookup(self, i: int) -> None:
        assert self.table is not None
        result = self.table.lookup(k(i))
        expected = {
            SlotState.FREE: LookupResult.MISS,
            SlotState.WRITING: LookupResult.HIT_PENDING,
            SlotState.READY: LookupResult.HIT,
        }[self.table.state_of(k(i))]
        assert result is expected

    @invariant()
    def consistent(self) -> None:
        if self.table is None:
            return
        self.table.check_invariants()
        stats = self.table.statistics(1)
        assert stats.free + stats.writing + stats.ready == stats.num_blocks
        assert stats.writing == len(self.writing)
        assert stats.pins == len(self.pins)
        for key, slot in self.writing.items():
            assert self.table.slot_state(slot) is SlotState.WRITING
            assert self.table.key_of(slot) == key
        for slot in self.pins:  # a pinned slot is never evicted or reused
            assert self.table.slot_state(slot) is SlotState.READY


TestSlotTableMachine = SlotTableMachine.TestCase
TestSlotTableMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_lent_slot_aborted_is_reused_only_once_given_back() -> None:
    table, slot = writing_table()
    table.lend(slot)
    table.abort(slot)  # the writer gave up; something may still write into the slot
    assert table.lookup(k(1)) is LookupResult.MISS
    assert table.lent == 1 and table.statistics(1).free == 0
    assert table.try_reserve(k(2)) is None
    table.check_invariants()
    table.give_back(slot)
    assert table.lent == 0 and table.statistics(1).free == 1
    assert table.try_reserve(k(2)) == slot
    table.check_invariants()


def test_a_lent_slot_given_back_before_its_abort_is_freed_by_the_abort() -> None:
    table, slot = writing_table()
    table.lend(slot)
    table.give_back(slot)  # the read returned before its writer was settled
    assert table.lookup(k(1)) is LookupResult.HIT_PENDING
    table.abort(slot)
    assert table.statistics(1).free == 1 and table.lent == 0
    table.check_invariants()


def test_a_lent_slot_is_never_committed() -> None:
    table, slot = writing_table()
    table.lend(slot)
    with pytest.raises(AssertionError, match="lent"):
        table.commit(slot)
