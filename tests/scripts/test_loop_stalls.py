"""The demo's stall probe names what held the loop, and the collector when it was that."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from examples.loop_stalls import StallProbe

pytestmark = pytest.mark.asyncio


def hold_the_loop(seconds: float) -> None:
    """A synchronous step that keeps the loop from running anything else."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_blocking_step_is_recorded_with_its_frame() -> None:
    async with StallProbe(threshold=0.02) as probe:
        await asyncio.sleep(0.01)  # the heartbeat runs
        hold_the_loop(0.2)
        await asyncio.sleep(0.01)  # the heartbeat sees the loop again: the stall ends
    summary = probe.summary()
    assert summary["stalls"] >= 1
    longest = max(probe.stalls, key=lambda s: s.seconds)
    assert longest.seconds >= 0.2
    assert "hold_the_loop" in longest.culprit()
    assert summary["culprits"][0]["where"] == longest.culprit()


async def test_a_quiet_loop_has_no_stalls() -> None:
    async with StallProbe(threshold=0.5) as probe:
        for _ in range(10):
            await asyncio.sleep(0.005)
    assert probe.stalls == []


async def test_a_collection_that_fills_the_stall_is_named() -> None:
    # No automatic collection until the one asked for: otherwise one the allocations below
    # set off (when depends on what earlier tests left on the heap) may free the cycles
    # before the probe watches, and the collection it sees finds nothing to do.
    gc.disable()
    try:
        garbage: list[list[object]] = [[i] for i in range(300_000)]
        for item in garbage:
            item.append(item)  # cycles: only the collector frees them
        del garbage
        async with StallProbe(threshold=0.005) as probe:
            await asyncio.sleep(0.01)
            gc.collect()
            await asyncio.sleep(0.01)
    finally:
        gc.enable()
    collections = [s for s in probe.stalls if s.gc_seconds > 0]
    assert collections, "the full collection of 300,000 cycles made no stall"
    assert max(collections, key=lambda s: s.gc_seconds).culprit() == "gc collection"


async def test_the_beat_must_be_shorter_than_the_threshold() -> None:
    with pytest.raises(ValueError, match="beat"):
        StallProbe(threshold=0.01, beat=0.02)
