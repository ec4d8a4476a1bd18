"""The verdict store: expiry, bounds, order and codes, with a manual clock and no event loop."""

from __future__ import annotations

import gc
import math

import pytest

import kvtier
from kvtier import MissReason
from kvtier.common._verdicts import MAX_CODE, PRESENT, VerdictStore, code_of, reason_of_code
from kvtier.integrations.bridge import TierBridge
from kvtier.integrations.bridge._shared import CLOSED
from tests.support import ManualClock


def test_a_verdict_holds_until_its_ttl_and_then_is_gone(clock: ManualClock) -> None:
    store = VerdictStore(10, clock=clock)
    store.set(b"a", PRESENT, 2.0)
    store.set(b"b", code_of(MissReason.TIMEOUT), 1.0)
    clock.now = 0.999
    assert store.get(b"a") == PRESENT
    assert store.get(b"b") == code_of(MissReason.TIMEOUT)
    clock.now = 1.0  # exactly at its expiry: gone, and dropped on the way
    assert store.get(b"b") is None
    assert len(store) == 1
    clock.now = 2.0
    assert store.get(b"a") is None
    assert len(store) == 0
    assert store.get(b"never") is None


def test_an_infinite_ttl_never_expires(clock: ManualClock) -> None:
    store = VerdictStore(4, clock=clock)
    store.set(b"a", PRESENT, math.inf)
    clock.now = 1e12
    assert store.get(b"a") == PRESENT


def test_the_oldest_goes_first_past_the_bound(clock: ManualClock) -> None:
    store = VerdictStore(3, clock=clock)
    for key in (b"a", b"b", b"c", b"d"):
        store.set(key, PRESENT, 10.0)
    assert len(store) == 3
    assert store.get(b"a") is None
    assert [store.get(k) for k in (b"b", b"c", b"d")] == [PRESENT] * 3


def test_setting_again_moves_the_key_to_the_end_with_its_new_verdict(clock: ManualClock) -> None:
    store = VerdictStore(3, clock=clock)
    for key in (b"a", b"b", b"c"):
        store.set(key, PRESENT, 10.0)
    store.set(b"a", code_of(MissReason.CORRUPT), 10.0)  # now the newest
    store.set(b"d", PRESENT, 10.0)  # pushes out b, the oldest now
    assert store.get(b"b") is None
    assert store.get(b"a") == code_of(MissReason.CORRUPT)
    assert len(store) == 3


def test_a_reading_does_not_change_the_order(clock: ManualClock) -> None:
    store = VerdictStore(2, clock=clock)
    store.set(b"a", PRESENT, 10.0)
    store.set(b"b", PRESENT, 10.0)
    assert store.get(b"a") == PRESENT
    store.set(b"c", PRESENT, 10.0)
    assert store.get(b"a") is None and store.get(b"b") == PRESENT


def test_forget_drops_a_verdict_and_says_whether_there_was_one(clock: ManualClock) -> None:
    store = VerdictStore(4, clock=clock)
    store.set(b"a", PRESENT, 1.0)
    store.set(b"b", PRESENT, 5.0)
    clock.now = 2.0  # a has expired but was never read: forget still finds it
    assert store.forget(b"a") is True
    assert store.forget(b"a") is False
    assert store.forget(b"b") is True
    assert store.get(b"b") is None and len(store) == 0


def test_expire_drops_expired_entries_from_the_front_up_to_a_live_one(clock: ManualClock) -> None:
    store = VerdictStore(10, clock=clock)
    store.set(b"a", PRESENT, 1.0)
    store.set(b"b", PRESENT, 1.0)
    store.set(b"forever", PRESENT, math.inf)
    store.set(b"c", PRESENT, 1.0)
    clock.now = 5.0
    assert store.expire() == 2  # stops at the first live entry
    assert len(store) == 2
    assert store.get(b"c") is None and store.get(b"forever") == PRESENT
    assert VerdictStore(1, clock=clock).expire() == 0  # empty


def test_codes_name_every_miss_reason_and_reject_anything_else(clock: ManualClock) -> None:
    codes = {code_of(reason) for reason in MissReason}
    assert len(codes) == len(MissReason) and PRESENT not in codes
    for reason in MissReason:
        assert reason_of_code(code_of(reason)) is reason
        assert code_of(reason.value) == code_of(reason)
    with pytest.raises(ValueError, match="not a miss reason"):
        code_of("nope")
    store = VerdictStore(2, clock=clock)
    store.set(b"top", MAX_CODE, 1.0)
    assert store.get(b"top") == MAX_CODE
    for bad in (-1, MAX_CODE + 1):
        with pytest.raises(ValueError, match="verdict code"):
            store.set(b"a", bad, 1.0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_the_bound_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_entries"):
        VerdictStore(bad)  # type: ignore[arg-type]


def test_entries_add_nothing_for_the_garbage_collector(clock: ManualClock) -> None:
    store = VerdictStore(10_000, clock=clock)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(10_000):
        store.set(i.to_bytes(16, "big"), i % 3, 2.0)
    assert len(gc.get_objects()) - before < 10  # the map itself, not one object per key


def test_a_full_store_is_not_walked_by_the_collector(clock: ManualClock) -> None:
    """No container the collector tracks holds the entries (an ``OrderedDict`` is always
    tracked, and a full pass visited each of its entries), evictions included."""
    store = VerdictStore(20_000, clock=clock)
    for i in range(30_000):
        store.set(i.to_bytes(16, "big"), i % 3, 2.0)
    store.forget((29_999).to_bytes(16, "big"))
    assert len(store) == 20_000 - 1
    containers = [*store._shards, *store._fronts]
    assert not any(map(gc.is_tracked, containers))


def test_evictions_follow_the_order_of_setting_through_resets_and_forgets(
    clock: ManualClock,
) -> None:
    store = VerdictStore(40, clock=clock)
    keys = [bytes([i]) * 16 for i in range(60)]
    for key in keys[:40]:
        store.set(key, PRESENT, 5.0)
    store.set(keys[0], PRESENT, 5.0)  # set again: now the newest
    store.forget(keys[1])
    for key in keys[40:55]:
        store.set(key, PRESENT, 5.0)
    held = [key for key in keys if store.get(key) is not None]
    assert held == [keys[0], *keys[16:55]]


def test_repr_shows_fill_and_bound(clock: ManualClock) -> None:
    store = VerdictStore(5, clock=clock)
    store.set(b"a", PRESENT, 1.0)
    assert repr(store) == "<VerdictStore 1/5>"


def test_a_large_store_is_sharded_and_keeps_its_bound_and_newest_entries(
    clock: ManualClock,
) -> None:
    """A large map is split into shards, so that no insert rebuilds one big hash table; the
    bound holds over all of them and the newest entries stay (the oldest of a shard goes)."""
    store = VerdictStore(100_000, clock=clock)
    assert repr(store) == "<VerdictStore 0/100000 in 16 shards>"
    keys = [i.to_bytes(16, "big") for i in range(250_000)]
    for key in keys:
        store.set(key, PRESENT, 10.0)
    assert 99_000 < len(store) <= 100_000
    newest = keys[-50_000:]
    assert all(store.get(key) == PRESENT for key in newest)
    assert sum(store.get(key) is not None for key in keys[:100_000]) == 0
    held = len(store)
    clock.advance(10.0)
    assert store.expire() == held and len(store) == 0


def test_the_bridge_keeps_each_miss_verdicts_reason_by_name() -> None:
    """The bridge's verdicts are codes too: its own reasons and a tier's other names come
    back as they went in, and past the codes there are, a name counts as ``not_found``."""
    bridge = TierBridge(kvtier.MemoryTier())
    try:
        names = [MissReason.TIMEOUT.value, CLOSED, "a_tier_of_its_own"]
        names += [f"reason_{i}" for i in range(MAX_CODE)]
        for i, name in enumerate(names):
            bridge._snapshot.verdict(i.to_bytes(4, "big"), False, name)
        bridge._snapshot.verdict(b"hit", True, "")
        assert bridge.lookup(b"hit") is kvtier.LookupResult.HIT
        for i in range(len(names)):
            assert bridge.lookup(i.to_bytes(4, "big")) is kvtier.LookupResult.MISS
        counted = bridge.statistics().misses_by_reason
        assert counted[MissReason.TIMEOUT.value] == 1 and counted[CLOSED] == 1
        assert counted["a_tier_of_its_own"] == 1
        numbered = [name for name in counted if name.startswith("reason_")]
        assert numbered and counted["not_found"] == MAX_CODE - len(numbered)
    finally:
        bridge.close()
