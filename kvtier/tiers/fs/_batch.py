"""The batch half of ``FSTier``: ``load_many`` and ``store_many`` (design §3-4).

Why its own module: a batch is a job of its own beside the tier's single-block operations.
It cuts a batch into at most ``max_concurrency`` (``max_write_concurrency``) runs, each one
worker-thread call that handles its blocks in turn, keeps capacity in waves (a block only
evicts what is already published), and settles each block's bookkeeping as ``load`` and
``store`` do for one, including what an abandoned run leaves behind. ``FSTier`` checks the
arguments and owns the state; these functions work on that state through the tier.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import anyio

from kvtier._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    InvalidArgumentError,
    TierError,
    TierNoSpaceError,
    TierTimeoutError,
)
from kvtier._format import header_size
from kvtier._lookup import MissReason
from kvtier.tiers._base import BatchResults, run_each
from kvtier.tiers.fs import _blocks
from kvtier.tiers.fs import _io as io
from kvtier.tiers.fs import _layout as layout
from kvtier.tiers.fs._calls import Handoff, Stuck

if TYPE_CHECKING:
    from kvtier.tiers.fs._tier import FSTier

__all__ = ["load_many", "store_many"]

# What a worker thread leaves for an item of a batch it did not finish (see ``load_many``).
_NOT_STARTED = "not-started"  # never touched the file system
_RUNNING = "running"  # may have touched it: a store's victims may be gone


async def load_many(
    tier: FSTier, keys: list[bytes], views: list[memoryview], deadline: float, pinned: bool
) -> BatchResults:
    """``FSTier.load_many`` once its arguments are checked."""
    tier._calls.drain_late()
    names = [layout.name_of(k) for k in keys]
    results: BatchResults = [None] * len(keys)
    wrong: list[str] = []
    since = tier._watch()
    try:
        with anyio.CancelScope(deadline=deadline):
            async with anyio.create_task_group() as tg:
                for run in _runs(len(keys), tier.max_concurrency):
                    tg.start_soon(
                        _load_run, tier, run, keys, names, views, results, wrong, since, pinned
                    )
    finally:
        tier._unwatch()
    if wrong:
        raise InvalidArgumentError(wrong[0])
    return results


async def _load_run(
    tier: FSTier,
    run: range,
    keys: list[bytes],
    names: list[str],
    views: list[memoryview],
    results: BatchResults,
    wrong: list[str],
    since: int,
    pinned: bool,
) -> None:
    stop_at = _stop_at()
    local: list[object] = [_NOT_STARTED] * len(run)

    def read(call: Handoff) -> None:
        for j, i in enumerate(run):
            if time.monotonic() > stop_at:
                return
            outcome: object
            try:
                outcome = _blocks.read_block(
                    tier, call, keys[i], names[i], views[i], private=not pinned
                )
            except (io.Corrupt, io.WrongSize, OSError) as exc:
                outcome = exc
            with call.holding():
                local[j] = outcome

    call = Handoff()
    started = time.perf_counter()
    try:
        await tier._calls.run(read, limiter=tier._limiter, handoff=call, abandon=not pinned)
    except Stuck as exc:
        local = [exc] * len(run)
    finally:
        with call.holding():  # an abandoned thread may still be running: take a snapshot
            got = list(local)
        each = (time.perf_counter() - started) / len(run)
        for j, i in enumerate(run):
            results[i] = _loaded(tier, keys[i], names[i], views[i], got[j], since, wrong, each)


def _loaded(
    tier: FSTier,
    key: bytes,
    name: str,
    view: memoryview,
    outcome: object,
    since: int,
    wrong: list[str],
    seconds: float,
) -> TierError | None:
    """The bookkeeping of one block of a batch load, as ``load`` does it for one."""
    if outcome is io.ReadOutcome.LOADED:
        if name in tier._index:
            tier._index.move_to_end(name)
        else:
            tier._add(name, header_size(len(key), integrity_key=tier.integrity_key) + view.nbytes)
        tier._meter.read(view.nbytes, seconds)
        return None
    if outcome is io.ReadOutcome.MISSING:
        tier._drop_unless_newer(name, since)
        tier._fail(key, MissReason.NOT_FOUND, "load", None)
        return BlockNotFoundError("no such block", tier=tier.name, operation="load", key=key)
    if isinstance(outcome, io.Corrupt):
        tier._drop_unless_newer(name, since)
        tier._fail(key, MissReason.CORRUPT, "load", str(outcome))
        return CorruptBlockError(str(outcome), tier=tier.name, operation="load", key=key)
    if isinstance(outcome, io.WrongSize):
        wrong.append(
            f"dst holds {view.nbytes} bytes but block {key.hex()} is {outcome.stored} bytes"
        )
        return None
    if isinstance(outcome, OSError | Stuck):
        error = tier._error(outcome, "load", key)
        tier._lookups.record(key, False, error.reason)
        return error
    return _timed_out(tier, key, "load")  # not started (or abandoned) by the deadline


async def store_many(
    tier: FSTier, keys: list[bytes], payloads: list[memoryview], deadline: float, pinned: bool
) -> BatchResults:
    """``FSTier.store_many`` once its arguments are checked."""
    names = [layout.name_of(k) for k in keys]
    results: BatchResults = [None] * len(keys)
    mine: list[int] = []
    later: list[int] = []  # keys being stored already (or twice here): store() waits
    for i, key in enumerate(keys):
        if key in tier._storing:
            later.append(i)
        else:
            tier._storing[key] = anyio.Event()
            mine.append(i)
    try:
        await _store_mine(tier, mine, keys, names, payloads, results, deadline, pinned)
    finally:
        for i in mine:
            tier._storing.pop(keys[i]).set()
        tier._stored([keys[i] for i in mine])
    if later:
        calls = [functools.partial(tier.store, keys[i], payloads[i]) for i in later]
        for i, error in zip(
            later,
            await run_each([keys[i] for i in later], calls, deadline, tier.name, "store"),
            strict=True,
        ):
            results[i] = error
    return results


async def _store_mine(
    tier: FSTier,
    mine: list[int],
    keys: list[bytes],
    names: list[str],
    payloads: list[memoryview],
    results: BatchResults,
    deadline: float,
    pinned: bool,
) -> None:
    tier._calls.drain_late()
    if not tier._ready:
        try:
            await tier._prepare(raise_unavailable=True)
        except TierError as exc:
            for i in mine:
                results[i] = exc
            return
    todo = list(mine)
    with anyio.CancelScope(deadline=deadline):
        while todo:  # in waves: a block can only evict blocks already published
            plan = _plan_wave(tier, todo, keys, names, payloads, results)
            async with anyio.create_task_group() as tg:
                for run in _runs(len(plan), tier.max_write_concurrency):
                    part = [plan[j] for j in run]
                    tg.start_soon(_store_run, tier, part, keys, names, payloads, results, pinned)
    for i in todo:  # the deadline passed before their wave
        results[i] = _timed_out(tier, keys[i], "store")


def _plan_wave(
    tier: FSTier,
    todo: list[int],
    keys: list[bytes],
    names: list[str],
    payloads: list[memoryview],
    results: BatchResults,
) -> list[tuple[int, list[tuple[str, int]], int]]:
    """Take from ``todo`` the blocks that fit now, choosing their victims and reserving
    their room; a block that needs room only earlier blocks of the batch can give (once
    they are published and evictable) waits for the next wave, as it would in a loop of
    ``store`` calls."""
    plan: list[tuple[int, list[tuple[str, int]], int]] = []
    while todo:
        i = todo[0]
        size = header_size(len(keys[i]), integrity_key=tier.integrity_key) + payloads[i].nbytes
        cap = tier.capacity_bytes
        if plan and cap is not None and tier._reserved + size > cap:
            break
        del todo[0]
        try:
            victims = tier._choose_victims(keys[i], names[i], size)
        except TierNoSpaceError as exc:
            results[i] = exc
            continue
        tier._reserved += size
        plan.append((i, victims, size))
    return plan


async def _store_run(
    tier: FSTier,
    part: list[tuple[int, list[tuple[str, int]], int]],
    keys: list[bytes],
    names: list[str],
    payloads: list[memoryview],
    results: BatchResults,
    pinned: bool,
) -> None:
    stop_at = _stop_at()
    local: list[object] = [_NOT_STARTED] * len(part)

    def write(call: Handoff) -> None:
        for j, (i, victims, _) in enumerate(part):
            if time.monotonic() > stop_at:
                return
            outcome: object
            try:
                outcome = _blocks.write_block(
                    tier,
                    call,
                    keys[i],
                    names[i],
                    payloads[i],
                    [v for v, _ in victims],
                    private=not pinned,
                    started=functools.partial(local.__setitem__, j, _RUNNING),
                )
            except OSError as exc:
                outcome = exc
            with call.holding():
                local[j] = outcome

    def late(result: object, error: BaseException | None) -> None:
        """The run was abandoned and has now finished: settle what it left running."""
        for j, was in enumerate(got):
            if was is _RUNNING:
                _stored(tier, part[j], keys, names, payloads, local[j], 0.0)

    call = Handoff()
    started = time.perf_counter()
    got: list[object] = local
    try:
        await tier._calls.run(
            write, limiter=tier._write_limiter, on_late=late, handoff=call, abandon=not pinned
        )
    except Stuck as exc:
        local[:] = [exc] * len(part)
    finally:
        with call.holding():
            got = list(local)
        each = (time.perf_counter() - started) / len(part)
        for j, item in enumerate(part):
            if got[j] is _RUNNING and call.left_running:
                # ``late`` settles its account when the thread returns.
                results[item[0]] = _timed_out(tier, keys[item[0]], "store")
                continue
            results[item[0]] = _stored(tier, item, keys, names, payloads, got[j], each)


def _stored(
    tier: FSTier,
    item: tuple[int, list[tuple[str, int]], int],
    keys: list[bytes],
    names: list[str],
    payloads: list[memoryview],
    outcome: object,
    seconds: float,
) -> TierError | None:
    """The bookkeeping of one block of a batch store, as ``_store`` does it for one."""
    i, victims, size = item
    key, name = keys[i], names[i]
    tier._reserved -= size
    if isinstance(outcome, tuple):
        tier._settle(key, name, victims, outcome, touched=True)
        if outcome[0] is io.WriteOutcome.WRITTEN:
            tier._meter.wrote(payloads[i].nbytes, seconds)
        return None
    tier._settle(key, name, victims, None, touched=outcome is not _NOT_STARTED)
    if isinstance(outcome, OSError | Stuck):
        return tier._error(outcome, "store", key)
    return _timed_out(tier, key, "store")


def _timed_out(tier: FSTier, key: bytes, operation: str) -> TierError:
    tier._meter.failed(MissReason.TIMEOUT)
    if operation == "load":
        tier._lookups.record(key, False, MissReason.TIMEOUT)
    return TierTimeoutError(
        "the batch's timeout passed first", tier=tier.name, operation=operation, key=key
    )


def _runs(n: int, most: int) -> list[range]:
    """``range(n)`` cut into at most ``most`` contiguous runs of near-equal length."""
    k = min(n, most)
    return [range(r * n // k, (r + 1) * n // k) for r in range(k)]


def _stop_at() -> float:
    """The current cancel scope's deadline on ``time.monotonic()``'s clock, for a thread."""
    left = anyio.current_effective_deadline() - anyio.current_time()
    return time.monotonic() + left
