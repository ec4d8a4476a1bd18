"""An async scheduler lookup keeps its scan's progress between wakes.

Promoting a long prefix block by block wakes the waiting scan once per block; rescanning and
re-pinning the whole prefix at every wake made the work quadratic. These tests count the
manager's lookups, pins and fast-path keys instead of timing anything."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import HostPool, LookupResult, MemoryTier, OffloadScheduler, TieringManager
from kvtier.manager import _promotions
from kvtier.manager._cost import ScanBudget
from kvtier.scheduler._progress import PrefixProgress, WindowProgress
from tests.support import H, M, P, R

BB = 256
N = 200


class CountingPool(HostPool):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, BB, prefault=False)
        self.pins = 0
        self.prefix_keys = 0

    def pin(self, key: bytes) -> int | None:
        self.pins += 1
        return super().pin(key)

    def ready_prefix(self, keys: list[bytes]) -> int:  # type: ignore[override]
        n = super().ready_prefix(keys)
        self.prefix_keys += n + 1
        return n


class CountingManager(TieringManager):
    lookups = 0

    def lookup(self, key: bytes, ctx: ScanBudget | None = None) -> LookupResult:
        self.lookups += 1
        return super().lookup(key, ctx)


class StaggeredTier(MemoryTier):
    """Loads finish one scheduling round apart, in a chosen order: a promotion lands, the
    waiting scan wakes, the next one lands, and so on, block by block."""

    def __init__(self, rounds: dict[bytes, int]) -> None:
        super().__init__("staggered")
        self.rounds = rounds

    async def load(self, key: bytes, dst: memoryview) -> None:
        for _ in range(self.rounds[key]):
            await anyio.lowlevel.checkpoint()
        await super().load(key, dst)


@pytest.mark.parametrize("window", [None, N // 2])
@pytest.mark.parametrize("order", ["forward", "backward"])
async def test_block_by_block_promotion_costs_linear_work(
    window: int | None, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One promotion per batch, so that blocks land one by one (a batch lands all at once).
    monkeypatch.setattr(_promotions, "MAX_BATCH", 1)
    keys = kvtier.block_keys(list(range(N)), 1, namespace=b"scan-progress")
    ranks = range(N) if order == "forward" else range(N - 1, -1, -1)
    tier = StaggeredTier({key: 2 * rank for key, rank in zip(keys, ranks, strict=True)})
    for key in keys:
        await tier.store(key, memoryview(bytes(BB)))
    pool = CountingPool(N + 16)
    async with CountingManager(pool, [tier]) as manager:
        scheduler = OffloadScheduler(manager)
        with anyio.fail_after(30):
            assert await scheduler.lookup(keys, sliding_window_size=window) == N
        waits = scheduler.statistics().waits
        assert waits > N // 4, "the test must wake the scan block by block"
        work = manager.lookups + pool.pins + pool.prefix_keys
        # each key is asked a bounded number of times (first sight, its promotion starting,
        # its promotion landing) and pinned once; the final answer may ask once more
        assert work <= 8 * N, f"{work} operations for {N} blocks over {waits} wakes"
        assert pool.statistics().pinned == 0


class Scripted:
    """Answers a settable result per key; a HIT the scan has seen stays a HIT (it is pinned)."""

    def __init__(self, results: list[LookupResult]) -> None:
        self.keys = [i.to_bytes(16, "big") for i in range(len(results))]
        self.results = dict(zip(self.keys, results, strict=True))
        self.pinned: set[bytes] = set()

    def lookup(self, key: bytes, ctx: ScanBudget | None = None) -> LookupResult:
        return self.results[key]

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        self.pinned.update(keys)
        return [0] * len(keys)


results_st = st.sampled_from([H, P, R, M])


@settings(max_examples=300, deadline=None)
@given(
    initial=st.lists(results_st, min_size=1, max_size=12),
    window=st.none() | st.integers(1, 4),
    changes=st.lists(st.tuples(st.integers(0, 11), results_st), max_size=30),
)
def test_a_resumed_scan_answers_what_a_fresh_scan_answers(
    initial: list[LookupResult], window: int | None, changes: list[tuple[int, LookupResult]]
) -> None:
    """After any change of the keys' answers (the changed key fires if the scan watches it,
    except RETRY -> HIT_PENDING, which the manager does not announce), the resumed scan
    answers exactly what a fresh synchronous scan answers."""
    manager = Scripted(initial)
    fresh = OffloadScheduler(manager)

    def expected() -> int | None:
        if window is None:
            return fresh.maximal_prefix_lookup(manager.keys)
        return fresh.sliding_window_lookup(manager.keys, window)

    def new_scan() -> tuple[PrefixProgress | WindowProgress, int | None]:
        scan: PrefixProgress | WindowProgress
        if window is None:
            scan = PrefixProgress(manager.keys, manager.lookup, manager.pin, None)
        else:
            scan = WindowProgress(manager.keys, manager.lookup, manager.pin, window)
        return scan, scan.start()

    scan, answer = new_scan()
    assert answer == expected()
    for index, result in changes:
        key = manager.keys[index % len(manager.keys)]
        if key in manager.pinned:
            continue  # a pinned hit cannot change
        # a promotion the scan started turns its RETRY into HIT_PENDING without a notification
        silent = manager.results[key] is R and result is P
        manager.results[key] = result
        if answer is not None:  # answered: a new request scans afresh
            manager.pinned.clear()
            scan, answer = new_scan()
        else:
            scan.take_watches()
            answer = scan.resume([key] if key in scan.watched and not silent else [])
        assert answer == expected()


@pytest.mark.parametrize("window", [None, 2])
def test_a_key_that_occurs_twice_is_asked_again_at_both_places(window: int | None) -> None:
    """The scan indexes each key's first position, and every position of a key that occurs
    more than once: a wake of that key asks it again wherever it stands."""
    manager = Scripted([H, R, H, H])
    a, b, c, _ = manager.keys
    manager.keys = [a, b, c, b]
    scan: PrefixProgress | WindowProgress
    if window is None:
        scan = PrefixProgress(manager.keys, manager.lookup, manager.pin, None)
    else:
        scan = WindowProgress(manager.keys, manager.lookup, manager.pin, window)
    assert scan.start() is None
    scan.take_watches()
    manager.results[b] = H
    assert scan.resume([b]) == 4
