"""Session hints against a real pool and tiers: a returning turn finds its prefix resident or
in flight, a guess costs at most its share and never evicts a pinned block, ``end()`` and
stale guesses give everything back (and what was fetched goes first), and hints leak nothing
under cancellation or close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from kvtier import (
    CostModel,
    FSTier,
    HostPool,
    MemoryTier,
    OffloadScheduler,
    PrefetchHandle,
    PrefetchState,
    SecondaryTier,
    Session,
    SessionSettings,
    SlotState,
    TieringManager,
)
from kvtier.testing import StallingTier
from tests.support import BB, ManualClock, assert_idle, fill, fresh_keys, random_blocks

SOON = 1e-3
"""An expected return so close that the bring-back is due at once (any lead is longer)."""


@asynccontextmanager
async def hinted(
    tier: SecondaryTier, blocks: int = 16, **settings: float
) -> AsyncIterator[tuple[TieringManager, OffloadScheduler]]:
    async with TieringManager(HostPool(blocks, BB), [tier]) as manager:
        yield manager, OffloadScheduler(manager, sessions=SessionSettings(**settings))  # type: ignore[arg-type]


async def running(session: Session) -> PrefetchHandle:
    """The session's bring-back, once the driver has started it."""
    await anyio.wait_all_tasks_blocked()
    handle = session.bring_back
    assert handle is not None
    return handle


def ready(manager: TieringManager, keys: list[bytes]) -> list[bool]:
    return [manager.pool.state_of(k) is SlotState.READY for k in keys]


@pytest.fixture(params=["memory", "fs"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> SecondaryTier:
    if request.param == "memory":
        return MemoryTier("mem")
    return FSTier(tmp_path / "fs", fsync="never")


async def test_a_returning_turn_finds_its_prefix_brought_back(tier: SecondaryTier) -> None:
    keys = fresh_keys(8)
    async with hinted(tier, 32) as (manager, scheduler):  # a share of 8 slots
        await manager.store(keys, random_blocks(8))
        await manager.wait_idle()  # written through to the tier
        for key in keys:  # the pool gave them up for other sessions
            assert manager.pool.discard(key)
        session = scheduler.session("agent-1")
        session.turn_done(keys, expect_back_in=SOON)
        handle = await running(session)
        with anyio.fail_after(10):
            assert await handle.wait() == 8
        assert ready(manager, keys) == [True] * 8
        with anyio.fail_after(10):  # the next turn's prompt: the prefix and new tokens
            assert await scheduler.lookup([*keys, *fresh_keys(2)]) == 8
        assert handle.state is PrefetchState.CLAIMED and session.bring_back is None
        stats = scheduler.statistics().sessions
        assert stats is not None
        assert (stats.bring_backs, stats.claimed, stats.blocks_promoted) == (1, 1, 8)
        assert stats.blocks_claimed == 8 and stats.held == 0 and stats.gaps_seen == 1
        assert manager.statistics().promotions.started == 8  # the lookup promoted none
        session.end()
        await manager.wait_idle()
        await anyio.wait_all_tasks_blocked()
        assert_idle(manager)
        assert scheduler.statistics().sessions.running == 0  # type: ignore[union-attr]


async def test_a_turn_arriving_during_the_bring_back_waits_for_it_once() -> None:
    keys = fresh_keys(5)
    tier = StallingTier(name="stalling")
    await fill(tier.inner, keys)
    tier.stall("load")
    async with hinted(tier) as (manager, scheduler):
        session = scheduler.session("s")
        session.turn_done(keys, expect_back_in=SOON)
        with anyio.fail_after(10):
            await tier.wait_stalled("load")  # promotions in flight
        answer: list[int] = []

        async def turn() -> None:
            answer.append(await scheduler.lookup(keys))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(turn)
                await anyio.wait_all_tasks_blocked()
                assert manager.statistics().lookups.hit_pending >= 1  # found in flight
                tier.release("load")
        assert answer == [5]
        assert tier.statistics().loads == 5  # promoted once
        session.end()
        await manager.wait_idle()
        assert_idle(manager)


async def pressure(manager: TieringManager, blocks: int) -> None:
    """Other sessions' stores, enough to evict every block of the pool nobody pins."""
    await manager.store(fresh_keys(blocks), random_blocks(blocks, seed=1))
    await manager.wait_idle()


async def test_a_prefix_found_whole_in_the_pool_is_held_until_its_turn() -> None:
    """A bring-back whose prefix is all still resident pins it all: the pool evicts nothing
    of it before the turn, which then promotes nothing."""
    keys = fresh_keys(6)
    async with hinted(MemoryTier("mem"), 16, share=0.5) as (manager, scheduler):
        await manager.store(keys, random_blocks(6))
        await manager.wait_idle()
        session = scheduler.session("agent-1")
        session.turn_done(keys, expect_back_in=SOON)
        handle = await running(session)
        with anyio.fail_after(10):
            assert await handle.wait() == 6
        assert handle.held == 6 and handle.prefetched == 0
        await pressure(manager, 16)
        assert ready(manager, keys) == [True] * 6
        with anyio.fail_after(10):
            assert await scheduler.lookup([*keys, *fresh_keys(1)]) == 6
        assert manager.statistics().promotions.started == 0
        session.end()
        await manager.wait_idle()
        assert_idle(manager)


async def test_a_block_two_bring_backs_hold_counts_once_against_the_share() -> None:
    """Sub-agents start with their lead's system prompt: its slots count once, so both
    sessions' prefixes fit a share that would not hold the prompt twice."""
    system = fresh_keys(4)
    first, second = [*system, *fresh_keys(2)], [*system, *fresh_keys(2)]
    async with hinted(MemoryTier("mem"), 16, share=0.5) as (manager, scheduler):  # 8 slots
        await manager.store([*first, *second[4:]], random_blocks(8))
        await manager.wait_idle()
        handles = []
        for name, keys in (("lead", first), ("sub-agent", second)):
            session = scheduler.session(name)
            session.turn_done(keys, expect_back_in=SOON)
            handles.append(await running(session))
        with anyio.fail_after(10):
            assert [await h.wait() for h in handles] == [6, 6]
        assert [h.held for h in handles] == [6, 6]
        stats = scheduler.statistics().sessions
        assert stats is not None and stats.held == 8
        await pressure(manager, 16)
        assert ready(manager, [*first, *second[4:]]) == [True] * 8
        for session_id in ("lead", "sub-agent"):
            scheduler.session(session_id).end()
        await manager.wait_idle()
        assert_idle(manager)


async def test_a_bring_back_past_the_share_holds_the_rest_once_room_comes_back() -> None:
    """Hits past the share are only touched; when another bring-back gives its share
    back, the capped one scans again and holds its whole prefix."""
    first, second = fresh_keys(3), fresh_keys(4)
    async with hinted(MemoryTier("mem"), 16, share=0.25) as (manager, scheduler):  # 4 slots
        await manager.store([*first, *second], random_blocks(7))
        await manager.wait_idle()
        early = scheduler.session("early")
        early.turn_done(first, expect_back_in=SOON)
        assert (await running(early)).held == 3
        late = scheduler.session("late")
        late.turn_done(second, expect_back_in=SOON)
        handle = await running(late)
        with anyio.fail_after(10):
            assert await handle.wait() == 4  # found, but held only as far as the share
        assert handle.held == 1
        early.end()  # gives its share back
        await anyio.wait_all_tasks_blocked()
        assert handle.held == 4 and handle.state is PrefetchState.HOLDING
        await pressure(manager, 16)
        assert ready(manager, second) == [True] * 4
        late.end()
        await manager.wait_idle()
        assert_idle(manager)


async def test_a_bring_back_its_turn_overtook_teaches_a_longer_lead() -> None:
    """The cost model's per-block estimate comes from promotions that overlap; what the
    bring-backs themselves took sets how early the next one starts."""
    keys = fresh_keys(5)
    tier = StallingTier(name="stalling")
    await fill(tier.inner, keys)
    clock = ManualClock(100.0)
    pool = HostPool(16, BB)
    async with TieringManager(pool, [tier], cost=CostModel(clock=clock)) as manager:
        scheduler = OffloadScheduler(manager, sessions=SessionSettings(lead_margin=2.0))
        bring_backs = scheduler._bring_backs
        assert bring_backs is not None and bring_backs.seconds_per_block is None
        before = bring_backs.lead(5)
        tier.stall("load")
        session = scheduler.session("s")
        session.turn_done(keys, expect_back_in=SOON)
        with anyio.fail_after(10):
            await tier.wait_stalled("load")
        handle = await running(session)
        clock.advance(0.5)  # the promotions took half a second; the turn came meanwhile
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.lookup, keys)
            await anyio.wait_all_tasks_blocked()
            tier.release("load")
        per_block = 0.5 / handle.prefetched
        assert handle.prefetched and bring_backs.seconds_per_block == pytest.approx(per_block)
        slack = SessionSettings().lead_slack
        assert bring_backs.lead(5) == pytest.approx(max(before, 2.0 * per_block * 5 + slack))
        # past the model's
        assert bring_backs.lead(50) == pytest.approx(2.0 * per_block * 50 + slack)
        session.end()
        await manager.wait_idle()
        assert_idle(manager)


async def test_a_guess_holds_at_most_its_share_and_never_evicts_a_pinned_block() -> None:
    others, mine = fresh_keys(12), fresh_keys(10)
    tier = MemoryTier("mem")
    await fill(tier, mine)
    async with hinted(tier, 16, share=0.25) as (manager, scheduler):  # 4 of 16 slots
        await manager.store(others, random_blocks(12))
        running_request = manager.pin_ready(others)  # what another request needs
        session = scheduler.session("never-back")
        session.turn_done(mine, expect_back_in=SOON)
        handle = await running(session)
        with anyio.fail_after(10):
            assert await handle.wait() == 4
        assert handle.reason == "prefetch_share"
        stats = scheduler.statistics().sessions
        assert stats is not None and stats.held == 4 and stats.blocks_promoted == 4
        assert ready(manager, others) == [True] * 12
        assert ready(manager, mine) == [True] * 4 + [False] * 6  # the head; the tail last
        manager.unpin_slots(running_request)
        session.end()  # it never came back: what was fetched for it goes first
        stats = scheduler.statistics().sessions
        assert stats is not None and stats.held == 0 and stats.blocks_demoted == 4
        await manager.store(fresh_keys(4), random_blocks(4, seed=1))
        assert ready(manager, others) == [True] * 12
        assert ready(manager, mine) == [False] * 10
        await anyio.wait_all_tasks_blocked()
        assert_idle(manager)


async def test_a_stale_guess_is_let_go_and_demoted() -> None:
    keys = fresh_keys(3)
    tier = MemoryTier("mem")
    await fill(tier, keys)
    async with hinted(tier, 16, hint_slack=0.01, min_hold=2.0) as (manager, scheduler):
        session = scheduler.session("s")
        session.turn_done(keys, expect_back_in=SOON)
        handle = await running(session)
        with anyio.fail_after(10):
            ended = await handle.wait_ended()
        assert ended in (PrefetchState.EXPIRED, PrefetchState.CANCELLED)
        await anyio.wait_all_tasks_blocked()
        stats = scheduler.statistics().sessions
        assert stats is not None
        assert stats.stale == 1 and stats.held == 0 and stats.running == 0
        assert stats.blocks_demoted == 3 and session.bring_back is None
        assert_idle(manager)


async def test_no_bring_back_before_it_is_due() -> None:
    keys = fresh_keys(4)
    tier = MemoryTier("mem")
    await fill(tier, keys)
    async with hinted(tier) as (manager, scheduler):
        session = scheduler.session("s")
        session.turn_done(keys)  # no hint: the prior's return is far off
        await anyio.wait_all_tasks_blocked()
        assert session.bring_back is None
        assert manager.statistics().promotions.started == 0
        session.end()
        session.end()  # idempotent
        await anyio.wait_all_tasks_blocked()
        stats = scheduler.statistics().sessions
        assert stats is not None and (stats.sessions, stats.running, stats.ended) == (0, 0, 1)
        assert_idle(manager)


async def test_a_new_turn_replaces_the_bring_back() -> None:
    keys = fresh_keys(6)
    tier = StallingTier(name="stalling")
    await fill(tier.inner, keys)
    tier.stall("load")
    async with hinted(tier) as (manager, scheduler):
        session = scheduler.session("s")
        session.turn_done(keys[:3], expect_back_in=SOON)
        first = await running(session)
        session.turn_done(keys, expect_back_in=1e6)  # the turn came with no lookup seen
        assert first.state is PrefetchState.CANCELLED and session.bring_back is None
        tier.release("load")
        session.end()
        with anyio.fail_after(10):
            await manager.wait_idle()
        await anyio.wait_all_tasks_blocked()
        assert_idle(manager)


async def test_a_cancelled_returning_turn_leaks_nothing() -> None:
    keys = fresh_keys(4)
    tier = StallingTier(name="stalling")
    await fill(tier.inner, keys)
    tier.stall("load")
    async with hinted(tier) as (manager, scheduler):
        session = scheduler.session("s")
        session.turn_done(keys, expect_back_in=SOON)
        with anyio.fail_after(10):
            await tier.wait_stalled("load")
        with anyio.move_on_after(10) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(scheduler.lookup, keys)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()  # the engine aborts the request while it waits
        assert scope.cancelled_caught
        tier.release("load")
        with anyio.fail_after(10):
            await manager.wait_idle()
        session.end()
        await anyio.wait_all_tasks_blocked()
        assert_idle(manager)
        stats = scheduler.statistics().sessions
        assert stats is not None and stats.held == 0 and stats.running == 0


async def test_closing_the_manager_ends_hints_and_later_hints_do_nothing() -> None:
    keys = fresh_keys(4)
    tier = StallingTier(name="stalling")
    await fill(tier.inner, keys)
    tier.stall("contains", "load")
    async with hinted(tier) as (manager, scheduler):
        session = scheduler.session("s")
        session.turn_done(keys, expect_back_in=SOON)
        with anyio.fail_after(10):
            await tier.wait_stalled("contains")
    tier.release("contains", "load")
    assert manager.statistics().pool.pinned == 0
    stats = scheduler.statistics().sessions
    assert stats is not None and stats.held == 0
    session.turn_done(keys, expect_back_in=SOON)  # an engine racing its shutdown
    assert session.bring_back is None
    stats = scheduler.statistics().sessions
    assert stats is not None and stats.running == 0
    session.end()
    assert_idle(manager)


async def test_hint_arguments_are_checked() -> None:
    async with hinted(MemoryTier("mem")) as (_, scheduler):
        session = scheduler.session("s")
        with pytest.raises(ValueError, match="expect_back_in must be a positive number"):
            session.turn_done(fresh_keys(2), expect_back_in=0)
        with pytest.raises(ValueError, match="share"):
            SessionSettings(share=2.0)
        assert repr(session) == "<Session 's'>" and session.id == "s"
