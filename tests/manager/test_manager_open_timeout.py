"""With ``require_all_tiers``, entering a TieringManager is bounded: a tier whose open() hangs
(a hung mount, an S3 endpoint that never answers) fails the entry after ``open_timeout`` with
an error naming the tier, and leaves no tier open behind. (Without it the manager opens with
the other tiers: tests/manager/test_manager_late_tiers.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from kvtier import (
    FSTier,
    HostPool,
    InvalidArgumentError,
    MemoryTier,
    TieringManager,
    TierTimeoutError,
)

BB = 4096


class RecordingTier(MemoryTier):
    """A MemoryTier that records its opens and closes; its open can hang on an event."""

    def __init__(self, name: str, *, hang: bool = False) -> None:
        super().__init__(name)
        self.hang = hang
        self.opened = self.closed = 0
        self.open_cancelled = False
        self.never = anyio.Event()  # never set: the hung mount

    async def open(self) -> None:
        if self.hang:
            try:
                await self.never.wait()
            except anyio.get_cancelled_exc_class():
                self.open_cancelled = True
                raise
        self.opened += 1

    async def aclose(self) -> None:
        self.closed += 1
        await super().aclose()


async def test_a_hung_open_fails_entry_naming_the_tier_and_closes_the_others() -> None:
    first = RecordingTier("local")
    hung = RecordingTier("remote", hang=True)
    last = RecordingTier("never-reached")
    manager = TieringManager(
        HostPool(4, BB), [first, hung, last], open_timeout=0.2, require_all_tiers=True
    )
    with anyio.fail_after(30), pytest.raises(TierTimeoutError) as caught:  # generous bound
        async with manager:
            pytest.fail("entered although a tier never opened")
    error = caught.value
    assert error.tier == "remote" and error.operation == "open"
    assert "open_timeout" in str(error) and "remote" in str(error)
    assert hung.open_cancelled, "the hung open was left running"
    assert first.opened == 1 and first.closed == 1, "the tier opened before it was left open"
    assert last.opened == 0
    assert first._listeners == [], "the manager still listens to a tier it closed"
    # the manager was never entered: it can be entered again once the tier answers
    hung.hang = False
    async with manager:
        assert hung.opened == 1
    assert hung.closed >= 1


async def test_without_a_bound_entry_waits_for_the_tier() -> None:
    hung = RecordingTier("slow", hang=True)
    manager = TieringManager(HostPool(4, BB), [hung], open_timeout=None, require_all_tiers=True)
    entered = anyio.Event()

    async def enter() -> None:
        async with manager:
            entered.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(enter)
        await anyio.wait_all_tasks_blocked()
        assert not entered.is_set()
        hung.never.set()
    assert entered.is_set()


@pytest.mark.parametrize("bad", [0, -1.0, "5", True])
def test_open_timeout_is_validated(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="open_timeout"):
        TieringManager(HostPool(4, BB), [MemoryTier()], open_timeout=bad)  # type: ignore[arg-type]


async def test_a_tier_with_its_own_task_group_before_the_hung_one_is_closed(
    tmp_path: Path,
) -> None:
    """An FS tier enters a task group while opening; timing out the next tier must unwind
    it in order and leave no task of it running."""
    fs = FSTier(tmp_path / "fs")
    hung = RecordingTier("remote", hang=True)
    manager = TieringManager(HostPool(4, BB), [fs, hung], open_timeout=0.2, require_all_tiers=True)
    with anyio.fail_after(30), pytest.raises(TierTimeoutError, match="remote"):
        await manager.__aenter__()
    others = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    assert not others, f"tasks left running: {others}"
    hung.hang = False
    async with manager:  # and it opens cleanly once the tier answers
        pass
