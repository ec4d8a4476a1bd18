"""The engine-neutral bridge under the vLLM adapter: a kvtier tier on its own loop thread,
called from a plain thread that must never wait. These tests need no vLLM."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvtier
from kvtier import MissReason
from kvtier.integrations.bridge import TierBridge
from kvtier.integrations.bridge._bridge import JobOutcome
from kvtier.testing import StallingTier
from kvtier.tiers.fs import _root as _fs_root
from tests.support import Hang

BLOCK = 4096
WAIT = 30.0  # generous bound on a promised deadline, not a timing assertion


def test_import_kvtier_never_imports_an_engine() -> None:
    code = (
        "import sys, kvtier, kvtier.integrations, kvtier.integrations.bridge._bridge\n"
        "assert not {'vllm', 'sglang', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def bridges() -> Iterator[list[TierBridge]]:
    made: list[TierBridge] = []
    yield made
    for bridge in made:
        bridge.close()


def resolve(bridge: TierBridge, key: bytes) -> kvtier.LookupResult:
    """Ask until the answer is not RETRY, waiting on the bridge's changes in between."""
    give_up = time.monotonic() + WAIT
    while time.monotonic() < give_up:
        seen = bridge.generation
        result = bridge.lookup(key)
        if result is not kvtier.LookupResult.RETRY:
            return result
        bridge.wait_for_change(seen, give_up - time.monotonic())
    raise AssertionError("the lookup never resolved")


def finish(bridge: TierBridge, job_id: int) -> JobOutcome:
    return outcomes(bridge, {job_id})[job_id]


def returns(call: Callable[[], object]) -> bool:
    """Whether ``call()`` returns within ``WAIT``. It runs in a daemon thread, so a call that
    blocks for good fails the test instead of hanging the run."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(WAIT)
    return not thread.is_alive()


def test_store_then_lookup_and_load_round_trip(bridges: list[TierBridge]) -> None:
    bridge = TierBridge(kvtier.MemoryTier())
    bridges.append(bridge)
    keys = kvtier.block_keys(list(range(8)), 4)
    data = bytearray(b"a" * BLOCK + b"b" * BLOCK)
    view = memoryview(data)
    bridge.submit(1, "store", keys, [view[:BLOCK], view[BLOCK:]])
    stored = finish(bridge, 1)
    assert stored.success and stored.nbytes == 2 * BLOCK
    assert [resolve(bridge, k) for k in keys] == [kvtier.LookupResult.HIT] * 2

    out = bytearray(2 * BLOCK)
    dst = memoryview(out)
    bridge.submit(2, "load", keys, [dst[:BLOCK], dst[BLOCK:]])
    assert finish(bridge, 2).success
    assert out == data
    assert bridge.statistics().hits == 2


def test_retry_while_the_existence_check_is_in_flight(bridges: list[TierBridge]) -> None:
    inner = kvtier.MemoryTier()
    tier = StallingTier(inner)
    bridge = TierBridge(tier)
    bridges.append(bridge)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    bridge.submit(1, "store", [key], [memoryview(bytearray(BLOCK))])
    assert finish(bridge, 1).success

    async def stall() -> None:
        tier.stall("contains")

    (other,) = kvtier.block_keys(list(range(4, 8)), 4)
    bridge.run(stall)
    assert bridge.lookup(other) is kvtier.LookupResult.RETRY
    bridge.run(tier.wait_stalled, "contains")  # the check is now held in the tier
    assert bridge.lookup(other) is kvtier.LookupResult.RETRY
    assert bridge.has_pending_work()

    async def release() -> None:
        tier.release("contains")

    bridge.run(release)
    assert resolve(bridge, other) is kvtier.LookupResult.MISS
    assert bridge.statistics().misses_by_reason == {"not_found": 1}


class _RaisingTier(kvtier.MemoryTier):
    def lookup(self, key: bytes) -> kvtier.LookupResult:
        raise RuntimeError("a bug in a third-party tier")


class _SilentTier(kvtier.MemoryTier):
    """Answers RETRY and never notifies: the bridge's own deadline must end the wait."""

    def lookup(self, key: bytes) -> kvtier.LookupResult:
        return kvtier.LookupResult.RETRY


class _ReasoningTier(kvtier.MemoryTier):
    """Says why each miss is one, and counts who reads its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.statistics_read = 0

    def lookup_with_reason(self, key: bytes) -> tuple[kvtier.LookupResult, MissReason | None]:
        return kvtier.LookupResult.MISS, MissReason.CORRUPT

    def statistics(self) -> kvtier.TierStatistics:
        self.statistics_read += 1
        return super().statistics()


def test_a_miss_verdict_keeps_the_reason_the_tier_gave_with_it(
    bridges: list[TierBridge],
) -> None:
    """The reason comes from the tier's answer itself, not from its statistics."""
    tier = _ReasoningTier()
    bridge = TierBridge(tier)
    bridges.append(bridge)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    assert resolve(bridge, key) is kvtier.LookupResult.MISS
    assert tier.statistics_read == 0
    assert bridge.statistics().misses_by_reason == {"corrupt": 1}


def test_a_raising_tier_is_a_counted_miss(bridges: list[TierBridge]) -> None:
    bridge = TierBridge(_RaisingTier())
    bridges.append(bridge)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    assert resolve(bridge, key) is kvtier.LookupResult.MISS
    assert bridge.statistics().misses_by_reason == {"tier_error": 1}


def test_a_check_that_never_lands_becomes_a_timeout_miss(bridges: list[TierBridge]) -> None:
    bridge = TierBridge(_SilentTier(), check_timeout=0.2)
    bridges.append(bridge)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    assert resolve(bridge, key) is kvtier.LookupResult.MISS
    assert bridge.statistics().misses_by_reason == {"timeout": 1}
    assert not bridge.has_pending_work()


def test_after_close_everything_is_refused_at_once() -> None:
    bridge = TierBridge(kvtier.MemoryTier())
    (key,) = kvtier.block_keys(list(range(4)), 4)
    bridge.close()
    bridge.close()  # idempotent
    assert bridge.lookup(key) is kvtier.LookupResult.MISS
    bridge.submit(7, "store", [key], [memoryview(bytearray(BLOCK))])
    (outcome,) = bridge.take_finished()
    assert outcome.job_id == 7 and not outcome.success
    assert outcome.failures_by_reason == {"closed": 1}
    assert not bridge._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        bridge.run(_noop)


def test_bad_arguments_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match="SecondaryTier"):
        TierBridge(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="miss_ttl"):
        TierBridge(kvtier.MemoryTier(), miss_ttl=0)


async def _noop() -> None:
    return None


class _CountingTier(kvtier.MemoryTier):
    """Records the size of every batch call; raises from one when told to (a tier bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int, bool]] = []
        self.broken = False

    async def load_many(self, keys: Any, dsts: Any, **kwargs: Any) -> Any:
        self.batches.append(("load", len(keys), kwargs.get("pinned", False)))
        if self.broken:
            raise RuntimeError("a bug in the tier")
        return await super().load_many(keys, dsts, **kwargs)


def outcomes(bridge: TierBridge, ids: set[int]) -> dict[int, JobOutcome]:
    taken: dict[int, JobOutcome] = {}
    give_up = time.monotonic() + WAIT
    while time.monotonic() < give_up:
        seen = bridge.generation
        taken.update((o.job_id, o) for o in bridge.take_finished())
        if ids <= set(taken):
            return taken
        bridge.wait_for_change(seen, give_up - time.monotonic())
    raise AssertionError("the jobs never finished")


def _submit_together(bridge: TierBridge, jobs: list[tuple[int, list[bytes], list[Any]]]) -> None:
    """Submit ``jobs`` while the loop thread is held, so they land in one turn of it."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(WAIT)

    assert bridge._thread.call_soon(hold)
    assert held.wait(WAIT)
    for job_id, keys, views in jobs:
        bridge.submit(job_id, "load", keys, views)
    release.set()


def test_jobs_submitted_together_share_one_pinned_batch(bridges: list[TierBridge]) -> None:
    tier = _CountingTier()
    bridge = TierBridge(tier)
    bridges.append(bridge)
    keys = kvtier.block_keys(list(range(16)), 4)
    missing = kvtier.block_keys(list(range(100, 104)), 4)[0]
    blocks = [bytes([i]) * BLOCK for i in range(4)]
    bridge.submit(1, "store", keys, [memoryview(b) for b in blocks])
    assert outcomes(bridge, {1})[1].success
    out = [bytearray(BLOCK) for _ in range(5)]
    _submit_together(
        bridge,
        [
            (10, [keys[0]], [memoryview(out[0])]),
            (11, [keys[1], missing], [memoryview(out[1]), memoryview(out[2])]),
            (12, [keys[2], keys[3]], [memoryview(out[3]), memoryview(out[4])]),
        ],
    )
    got = outcomes(bridge, {10, 11, 12})
    assert tier.batches == [("load", 5, True)], "three jobs should have been one batch call"
    assert got[10].success and got[12].success
    assert got[11].done == (0,) and got[11].failures_by_reason == {"not_found": 1}
    assert got[11].nbytes == BLOCK
    assert out[:2] + out[3:] == [blocks[0], blocks[1], blocks[2], blocks[3]]
    assert resolve(bridge, missing) is kvtier.LookupResult.MISS


def test_a_batch_that_raises_fails_every_job_in_it(bridges: list[TierBridge]) -> None:
    tier = _CountingTier()
    bridge = TierBridge(tier)
    bridges.append(bridge)
    keys = kvtier.block_keys(list(range(8)), 4)
    bridge.submit(1, "store", keys, [memoryview(bytes(BLOCK)) for _ in keys])
    assert outcomes(bridge, {1})[1].success
    tier.broken = True
    _submit_together(
        bridge,
        [
            (2, [keys[0]], [memoryview(bytearray(BLOCK))]),
            (3, [keys[1]], [memoryview(bytearray(BLOCK))]),
        ],
    )
    got = outcomes(bridge, {2, 3})
    assert [got[i].failures_by_reason for i in (2, 3)] == [{"tier_error": 1}] * 2
    assert bridge.statistics().loads_failed == 2


def test_an_unknown_operation_is_refused_and_nothing_is_stored(bridges: list[TierBridge]) -> None:
    bridge = TierBridge(kvtier.MemoryTier())
    bridges.append(bridge)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    out = bytearray(b"x" * BLOCK)
    with pytest.raises(ValueError, match=r"'load', 'store', got 'read'"):
        bridge.submit(1, "read", [key], [memoryview(out)])  # type: ignore[arg-type]
    assert not bridge.has_pending_work() and bridge.take_finished() == []
    assert resolve(bridge, key) is kvtier.LookupResult.MISS, "the buffer was stored"


class _MalformedTier(kvtier.MemoryTier):
    """A third-party tier whose ``load_many`` returns ``extra`` results too many (or, when
    negative, too few) while ``extra`` is not zero."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = 0

    async def load_many(self, keys: Any, dsts: Any, **kwargs: Any) -> Any:
        results = await super().load_many(keys, dsts, **kwargs)
        if self.extra < 0:
            return results[: self.extra]
        return results + [None] * self.extra


@pytest.mark.parametrize("extra", [-1, 1], ids=["too_few", "too_many"])
def test_a_malformed_batch_result_fails_only_its_batch(
    bridges: list[TierBridge], extra: int
) -> None:
    tier = _MalformedTier()
    bridge = TierBridge(tier)
    bridges.append(bridge)
    keys = kvtier.block_keys(list(range(8)), 4)
    blocks = [bytes([i + 1]) * BLOCK for i in range(2)]
    bridge.submit(1, "store", keys, [memoryview(b) for b in blocks])
    assert finish(bridge, 1).success

    tier.extra = extra
    bridge.submit(2, "load", keys, [memoryview(bytearray(BLOCK)) for _ in keys])
    failed = finish(bridge, 2)
    assert failed.done == () and failed.failures_by_reason == {"tier_error": 2}

    tier.extra = 0  # the bridge goes on: later jobs and lookups are served
    out = [bytearray(BLOCK) for _ in keys]
    bridge.submit(3, "load", keys, [memoryview(b) for b in out])
    assert finish(bridge, 3).success and out == blocks
    (other,) = kvtier.block_keys(list(range(50, 54)), 4)
    bridge.submit(4, "store", [other], [memoryview(bytes(BLOCK))])
    assert finish(bridge, 4).success
    assert resolve(bridge, other) is kvtier.LookupResult.HIT
    assert bridge.statistics().state == "open" and bridge._thread.is_alive()


@pytest.fixture
def hung_mount(hang: Hang, monkeypatch: pytest.MonkeyPatch) -> Hang:
    """Makes ``_fs_root.ready_root`` (FSTier's open) hang: a root on a dead NFS server."""
    monkeypatch.setattr(_fs_root, "ready_root", hang.wrap(_fs_root.ready_root))
    return hang


def test_deadlines_hold_from_submission_while_the_tier_opens(
    bridges: list[TierBridge], hung_mount: Hang, tmp_path: Path
) -> None:
    # op_timeout leaves a loaded machine time for the store once the tier is open
    bridge = TierBridge(kvtier.FSTier(tmp_path / "fs"), op_timeout=2.0, check_timeout=0.2)
    bridges.append(bridge)
    assert hung_mount.entered.wait(WAIT)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    assert resolve(bridge, key) is kvtier.LookupResult.MISS
    assert bridge.statistics().misses_by_reason == {"timeout": 1}
    bridge.submit(1, "store", [key], [memoryview(bytes(BLOCK))])
    failed = finish(bridge, 1)
    assert failed.done == () and failed.failures_by_reason == {"timeout": 1}
    assert returns(bridge.drain)
    assert not bridge.has_pending_work()
    assert bridge.statistics().state == "opening"
    assert not hung_mount.release.is_set(), "answered only because the mount came back"

    hung_mount.release.set()  # the mount comes back: the tier opens and serves later jobs
    give_up = time.monotonic() + WAIT
    while True:
        seen = bridge.generation
        if bridge.statistics().state != "opening":
            break
        assert bridge.wait_for_change(seen, give_up - time.monotonic()), "it never opened"
    assert bridge.statistics().state == "open"
    bridge.submit(2, "store", [key], [memoryview(b"k" * BLOCK)])
    assert finish(bridge, 2).success
    assert resolve(bridge, key) is kvtier.LookupResult.HIT
    out = bytearray(BLOCK)
    bridge.submit(3, "load", [key], [memoryview(out)])
    assert finish(bridge, 3).success and out == b"k" * BLOCK


class _NeverOpens(kvtier.MemoryTier):
    """A tier whose open waits for an event nothing sets; records how it ended."""

    def __init__(self) -> None:
        super().__init__()
        self.open_cancelled = False
        self.closes = 0

    async def open(self) -> None:
        try:
            await anyio.Event().wait()
        except anyio.get_cancelled_exc_class():
            self.open_cancelled = True
            raise

    async def aclose(self) -> None:
        self.closes += 1
        await super().aclose()


def test_shutdown_returns_while_the_tier_never_opens() -> None:
    tier = _NeverOpens()
    bridge = TierBridge(tier, op_timeout=3600.0, check_timeout=3600.0)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    assert bridge.lookup(key) is kvtier.LookupResult.RETRY
    bridge.submit(1, "load", [key], [memoryview(bytearray(BLOCK))])
    assert returns(bridge.close), "close waited for a tier that never opens"
    (outcome,) = bridge.take_finished()
    assert outcome.job_id == 1 and outcome.failures_by_reason == {"closed": 1}
    assert tier.open_cancelled and tier.closes == 1
    assert not bridge._thread.is_alive()
    assert bridge.lookup(key) is kvtier.LookupResult.MISS


def test_shutdown_returns_while_an_fs_tier_hangs_in_its_open(
    hung_mount: Hang, tmp_path: Path
) -> None:
    bridge = TierBridge(kvtier.FSTier(tmp_path / "fs"), op_timeout=3600.0)
    assert hung_mount.entered.wait(WAIT)
    (key,) = kvtier.block_keys(list(range(4)), 4)
    bridge.submit(1, "store", [key], [memoryview(bytes(BLOCK))])
    assert returns(bridge.close), "close waited for the hung mount"
    (outcome,) = bridge.take_finished()
    assert outcome.job_id == 1 and outcome.failures_by_reason == {"closed": 1}
    assert not bridge._thread.is_alive()
    assert not hung_mount.release.is_set(), "returned only because the mount came back"
