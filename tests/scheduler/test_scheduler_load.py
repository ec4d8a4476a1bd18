"""Thousands of concurrent scheduler lookups over a shared key space, with slow tiers: no
errors, every lookup answers, and the bounded structures stay within their limits.
(The event loop's lag under this load is measured by benchmarks/bench_load.py.)"""

from __future__ import annotations

import random

import anyio
import numpy as np

import kvtier
from kvtier.testing import SlowTier

BB = 128


async def test_many_concurrent_lookups_stay_bounded() -> None:
    rng = random.Random(7)
    keys = kvtier.block_keys(list(range(3_000)), 1, namespace=b"load-test")
    slow_a = SlowTier(delay=0.001, name="a", max_pending=300, max_entries=1_000)
    slow_b = SlowTier(delay=0.002, name="b", max_pending=300, max_entries=1_000)
    for key in keys[::2]:
        await slow_b.inner.store(key, memoryview(bytes(BB)))
    limit = 16 * BB
    manager = kvtier.TieringManager(
        kvtier.HostPool(500, BB), [slow_a, slow_b], max_in_flight_bytes=limit
    )
    peaks = {"cached": 0, "pending": 0, "in_flight": 0}
    answers: list[int] = []

    def sample() -> None:
        for tier in (slow_a, slow_b):
            stats = tier.lookups.statistics()
            peaks["cached"] = max(peaks["cached"], stats.cached_verdicts)
            peaks["pending"] = max(peaks["pending"], stats.pending + stats.in_flight)
        peaks["in_flight"] = max(peaks["in_flight"], manager.statistics().writes.in_flight_bytes)

    async with manager:
        scheduler = kvtier.OffloadScheduler(manager)

        async def request() -> None:
            start = rng.randrange(0, len(keys) - 16)
            prefix = keys[start : start + rng.randrange(1, 16)]
            n = await scheduler.lookup(prefix, timeout=10)
            answers.append(n)
            sample()
            await manager.store(prefix[n:], np.zeros((len(prefix) - n, BB), np.uint8))
            sample()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(3_000):
                    tg.start_soon(request)
                    if i % 64 == 63:
                        await anyio.lowlevel.checkpoint()
    stats = manager.statistics()
    assert len(answers) == 3_000
    assert peaks["cached"] <= 1_000
    assert peaks["pending"] <= 300
    assert peaks["in_flight"] <= limit
    assert stats.background.tasks == 0 and stats.pool.pinned == 0
    assert stats.lookups.hit > 0 and stats.promotions.succeeded > 0
    assert scheduler.statistics().timeouts == 0
