"""The manager's parts on their own: the synchronous lookup decision (no event loop), the
settings it takes, its nested statistics, ``wait_settled`` and the scheduler's protocols."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvtier
from kvtier import (
    AdmissionPolicy,
    CostModel,
    HostPool,
    InvalidArgumentError,
    LifecycleError,
    LookupResult,
    MemoryTier,
    MissReason,
    TieringManager,
)
from kvtier.manager import ManagerConfig
from kvtier.manager._cost import ScanBudget
from kvtier.manager._decision import LookupDecision
from kvtier.manager._failures import RecentFailures
from kvtier.manager._watch import KeyWatch, Watchers
from kvtier.scheduler._protocols import SupportsLookup, SupportsScheduling
from kvtier.testing import StallingTier
from tests.support import H, M, P, R

BB = 4096


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Answers:
    """A tier as the decision sees it: a name and a synchronous lookup."""

    def __init__(self, name: str, answers: dict[bytes, LookupResult]) -> None:
        self.name = name
        self.answers = answers

    def lookup(self, key: bytes) -> LookupResult:
        return self.answers.get(key, M)


def decision(
    tiers: list[Answers], pool: HostPool | None = None, *, opened: bool = True
) -> tuple[LookupDecision, list[Any], Watchers, HostPool]:
    pool = pool or HostPool(2, BB)
    started: list[Any] = []
    watchers = Watchers()
    made = LookupDecision(
        pool,
        tiers,  # type: ignore[arg-type]
        failed=RecentFailures(60.0),
        cost=CostModel(clock=lambda: 10.0),
        admission=AdmissionPolicy(),
        watchers=watchers,
        landing={},
        start=lambda *args: started.append(args),
    )
    if opened:
        made.opened()
    return made, started, watchers, pool


def test_a_tier_hit_reserves_a_slot_and_hands_the_promotion_over() -> None:
    tier = Answers("t", {k(1): H})
    d, started, _, pool = decision([tier])
    assert d.decide(k(1), None) is R
    ((key, source, slot, ready_at),) = started
    assert (key, source, ready_at) == (k(1), tier, 10.0)
    assert pool.lookup(k(1)) is P  # reserved (WRITING): asked again, no second promotion
    assert d.decide(k(1), None) is P
    assert len(started) == 1
    assert d.counts(hits=0) == kvtier.manager._statistics.LookupCounts(0, 1, 1, 0, {})
    assert slot is not None and d.started == 1


def test_misses_say_why() -> None:
    tier = Answers("t", {k(1): H, k(2): H, k(3): H, k(4): R})
    d, started, _, pool = decision([tier], HostPool(1, BB))
    assert d.decide(k(9), None) is M  # in no tier
    assert d.decide(k(4), None) is R  # still being checked
    assert d.decide(k(1), None) is R  # promotion started: the pool's one slot is WRITING
    assert d.decide(k(2), None) is M  # nothing free or evictable
    d._failed.remember(tier, k(3), MissReason.CORRUPT)
    assert d.decide(k(3), None) is M  # promoting it again would fail again
    assert d.miss_reasons == {"not_found": 1, "primary_full": 1, "corrupt": 1}
    assert len(started) == 1 and pool.statistics().writing == 1


def test_closed_answers_miss_and_never_opened_is_a_usage_error() -> None:
    d, started, _, _ = decision([Answers("t", {k(1): H})])
    d.stopped()
    assert d.decide(k(1), None) is M
    assert d.miss_reasons == {"unavailable": 1} and not started
    d, _, _, _ = decision([Answers("t", {k(1): H})], opened=False)
    with pytest.raises(LifecycleError, match="async with"):
        d.decide(k(1), None)


def test_a_budgeted_scan_defers_a_hit_behind_an_unknown_key() -> None:
    tier = Answers("t", {k(1): R, k(2): H})
    d, started, watchers, _ = decision([tier])
    budget = ScanBudget(lambda key, ctx: d.decide(key, ctx), [k(1), k(2)], 10.0, None)
    assert budget.ask(k(1)) is R
    assert budget.ask(k(2)) is R  # lazy: the prefix may end at k(1)
    assert not started and d.deferred == 1
    watch = KeyWatch()
    watchers.add([k(2)], watch)
    watchers.notify(k(1))  # the blocker changed: k(2)'s waiters are woken too
    assert watch.take() == [k(2)]


def test_settings_come_from_config_and_keywords() -> None:
    config = ManagerConfig(promotion_timeout=3.0, failure_ttl=1.0)
    manager = TieringManager(HostPool(4, BB), config=config, failure_ttl=0.5)
    assert manager.config == dataclasses.replace(config, failure_ttl=0.5)
    built = TieringManager(HostPool(4, BB), [MemoryTier()], recompute_seconds_per_block=0.01)
    assert built.cost.recompute_seconds_per_block == 0.01
    with pytest.raises(TypeError, match="promotion_timout"):
        TieringManager(HostPool(4, BB), promotion_timout=1.0)  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match="ManagerConfig"):
        TieringManager(HostPool(4, BB), config={"failure_ttl": 1.0})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="recompute_seconds_per_block"):
        TieringManager(HostPool(4, BB), cost=CostModel(), recompute_seconds_per_block=0.01)
    with pytest.raises(InvalidArgumentError, match="write_back"):
        TieringManager(HostPool(4, BB), admission=AdmissionPolicy(), write_back=["s3"])


async def test_statistics_are_grouped_and_keep_their_flat_names() -> None:
    tier = MemoryTier()
    await tier.store(k(2), memoryview(bytes(BB)))
    async with TieringManager(HostPool(4, BB), [tier]) as manager:
        await manager.store([k(1)], np.zeros((1, BB), np.uint8))
        assert await manager.wait_settled(k(2)) is H
        await manager.wait_idle()
        stats = manager.statistics()
    assert stats.lookups.hit == stats.lookups.hit == 1
    assert stats.promotions.succeeded == stats.promotions.succeeded == 1
    assert stats.stores.stored == stats.stores.stored == 1
    assert stats.writes.succeeded == stats.writes.succeeded == 1
    assert stats.background.tasks == stats.background.tasks == 0
    for group in stats.groups():
        assert dataclasses.is_dataclass(group)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, dataclasses.fields(group)[0].name, 1)


async def test_wait_settled_waits_for_the_promotion_and_has_a_bound() -> None:
    slow = StallingTier()
    await slow.inner.store(k(1), memoryview(bytes(BB)))
    slow.stall("load")
    async with TieringManager(HostPool(4, BB), [slow]) as manager:
        with pytest.raises(TimeoutError):
            await manager.wait_settled(k(1), timeout=0.05)
        async with anyio.create_task_group() as tg:
            got: list[LookupResult] = []

            async def settle() -> None:
                got.append(await manager.wait_settled(k(1)))

            tg.start_soon(settle)
            await slow.wait_stalled("load")
            slow.release("load")
        assert got == [H]
    assert await manager.wait_settled(k(1)) is H  # closed: the pool still answers
    assert await manager.wait_settled(k(5)) is M  # and nothing can be promoted
    await manager.aclose()  # closing again does nothing


def test_the_scheduler_protocols() -> None:
    manager = TieringManager(HostPool(4, BB))
    assert isinstance(manager, SupportsScheduling)
    assert isinstance(MemoryTier(), SupportsLookup)
    assert not isinstance(MemoryTier(), SupportsScheduling)
    assert not isinstance(object(), SupportsLookup)


def test_watchers_fire_each_registration_once_and_remove_one_at_a_time() -> None:
    """A key's only watch is held without a list; a second (or the same one again) joins
    it, each registration fires once, and ``remove`` drops one registration."""
    fired: list[tuple[str, bytes]] = []

    class Recording(KeyWatch):
        __slots__ = ("name",)

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def fire(self, key: bytes) -> None:
            fired.append((self.name, key))

    a, b = Recording("a"), Recording("b")
    watchers = Watchers()
    watchers.add([k(1), k(2), k(3)], a)
    watchers.add([k(2), k(3)], b)
    watchers.add([k(3)], a)
    watchers.remove([k(1)], b)  # not registered there: nothing happens
    watchers.remove([k(3)], a)  # one of a's two registrations on k(3)
    watchers.notify(k(1))
    watchers.notify(k(2))
    watchers.notify(k(3))
    watchers.notify(k(3))  # spent: fires nothing
    assert fired == [("a", k(1)), ("a", k(2)), ("b", k(2)), ("b", k(3)), ("a", k(3))]
    assert len(watchers) == 0
    watchers.add([k(4)], a)
    watchers.remove([k(4)], a)
    assert len(watchers) == 0
    watchers.add([k(5)], a)
    watchers.add([k(5)], b)
    watchers.fire_all()
    assert fired[-2:] == [("a", k(5)), ("b", k(5))]


async def test_a_key_watch_wakes_for_keys_fired_before_and_during_the_wait() -> None:
    watch = KeyWatch()
    watch.fire(k(1))
    with anyio.fail_after(1):
        await watch.wait()  # fired before: at once
    assert watch.take() == [k(1)]
    assert watch.take() == []

    async def fire_later() -> None:
        await anyio.sleep(0.01)
        watch.fire(k(2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fire_later)
        with anyio.fail_after(1):
            await watch.wait()
    assert watch.take() == [k(2)]
    with anyio.move_on_after(0.02) as scope:
        await watch.wait()  # nothing fired since the take: it sleeps
    assert scope.cancelled_caught


async def test_a_key_watch_wait_ends_at_a_fire_or_at_its_timeout() -> None:
    """``wait`` says whether a key fired (True) or its time bound passed first (False), and
    returns at once, after a checkpoint, for keys fired before it was called."""
    watch = KeyWatch()
    assert await watch.wait(0.01) is False
    assert watch.take() == []

    async def fire_later() -> None:
        await anyio.lowlevel.checkpoint()
        watch.fire(k(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fire_later)
        with anyio.fail_after(10):
            assert await watch.wait(60) is True
    assert watch.take() == [k(1)]
    watch.fire(k(2))
    assert await watch.wait(0) is True
    assert watch.take() == [k(2)]
    with anyio.move_on_after(0.01) as scope:  # cancelled from outside: no answer, no leak
        await watch.wait()
    assert scope.cancelled_caught
    watch.fire(k(3))  # nothing waits now: only collected
    assert watch.take() == [k(3)]
