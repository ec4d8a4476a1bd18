"""The batch half of ``FSTier``: ``load_many`` and ``store_many`` (docs/design.md, "Data at rest").

Why its own module: a batch is a job of its own beside the tier's single-block operations.
It cuts a batch into at most ``max_concurrency`` (``max_write_concurrency``) runs, each one
worker-thread call that handles its blocks in turn, keeps capacity in waves (a block only
evicts what is already published), and settles each block's bookkeeping as ``load`` and
``store`` do for one, including what an abandoned run leaves behind. ``FSTier`` checks the
arguments; these functions run the file work through its ``BlockFiles`` and book every
outcome through its ``Ledger`` (and so its ``Catalog``), as ``load`` and ``store`` do.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio

from kvtier.common._errors import InvalidArgumentError, TierError, TierNoSpaceError
from kvtier.common._lending import Lender, Release
from kvtier.tiers._base import BatchResults, run_each
from kvtier.tiers.fs import _blocks
from kvtier.tiers.fs._blocks import BlockFiles
from kvtier.tiers.fs._calls import Handoff, Stuck
from kvtier.tiers.fs._catalog import Reservation
from kvtier.tiers.fs._layout import name_of
from kvtier.tiers.fs._ledger import Ledger
from kvtier.tiers.fs._read import Corrupt, ReadOutcome, WrongSize

__all__ = ["Batch", "load_many", "store_many"]

# What a worker thread leaves for an item of a batch it did not finish (see ``load_many``).
_NOT_STARTED = "not-started"  # never touched the file system
_RUNNING = "running"  # may have touched it: a store's victims may be gone


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch: its keys, their file names, their buffers, and how it runs."""

    files: BlockFiles
    ledger: Ledger
    keys: list[bytes]
    names: list[str]
    views: list[memoryview]
    results: BatchResults
    pinned: bool
    lender: Lender | None = None  # lent views: read straight into, kept when left running

    @classmethod
    def of(
        cls,
        files: BlockFiles,
        ledger: Ledger,
        keys: list[bytes],
        views: list[memoryview],
        pinned: bool,
        lender: Lender | None = None,
    ) -> Batch:
        names = [name_of(k) for k in keys]
        return cls(files, ledger, keys, names, views, [None] * len(keys), pinned, lender)


async def load_many(batch: Batch, deadline: float) -> BatchResults:
    """``FSTier.load_many`` once its arguments are checked."""
    batch.files.calls.drain_late()
    wrong: list[str] = []
    with batch.ledger.catalog.watching() as since:
        todo = _read_cached(batch, since)
        if todo:  # what the page cache did not give the loop: in worker threads
            with anyio.CancelScope(deadline=deadline):
                runs = [[todo[i] for i in r] for r in _runs(len(todo), batch.files.max_concurrency)]
                await _together(
                    [functools.partial(_load_run, batch, r, wrong, since) for r in runs]
                )
    if wrong:
        raise InvalidArgumentError(wrong[0])
    return batch.results


def _read_cached(batch: Batch, since: int) -> list[int]:
    """Read the batch on the loop if the page cache holds it (``CachedReads``) and it fits
    the tier's budget; the positions left for the worker threads. All or nothing: a batch
    that needs a thread anyway is no sooner done for a block read on the loop, which would
    only cost the loop more. The first block the cache refuses sends the rest to a thread:
    a batch from the device costs the loop one refused try."""
    files, cached = batch.files, batch.files.cached
    n = len(batch.keys)
    if files.keeper.refused or not cached.on:  # a refused folder: the threads say why
        return list(range(n))
    if sum(view.nbytes for view in batch.views) > cached.budget:
        return list(range(n))
    # The root's held descriptor when it was checked lately (never a wait on the loop),
    # else one from the caches only.
    root = held = files.held.fresh()
    if root < 0 and (root := cached.open_root()) < 0:
        return list(range(n))
    try:
        for i, (key, name, view) in enumerate(
            zip(batch.keys, batch.names, batch.views, strict=True)
        ):
            region = files.cached_region(key, view)
            started = time.perf_counter()
            if region is None or not cached.read(root, name, key, view, region):
                return list(range(i, n))
            seconds = time.perf_counter() - started
            batch.results[i] = _loaded(batch, i, ReadOutcome.LOADED, since, [], seconds)
            batch.ledger.meter.loads_on_loop += 1
    finally:
        if root != held:
            os.close(root)
    return []


async def _load_run(batch: Batch, run: list[int], wrong: list[str], since: int) -> None:
    stop_at = _stop_at()
    local: list[object] = [_NOT_STARTED] * len(run)
    files, keys, names, views = batch.files, batch.keys, batch.names, batch.views
    lender = batch.lender
    # Lent views a thread left running still writes: their release, once it is done.
    kept: dict[int, Release] = {}

    def read(call: Handoff) -> None:
        for j, i in enumerate(run):
            if time.monotonic() > stop_at:
                return
            with call.holding():
                if lender is not None and call.abandoned:
                    return  # a lent view is never touched once its caller has gone
                local[j] = _RUNNING
            outcome: object = _RUNNING
            try:
                outcome = _blocks.read_into_slot(
                    files, call, keys[i], names[i], views[i], private=_private(batch)
                )
            except (Corrupt, WrongSize, OSError) as exc:
                outcome = exc
            finally:
                with call.holding():
                    local[j] = outcome
                    release = kept.pop(j, None)
                if release is not None:
                    release()
            if release is not None:
                return

    call = Handoff()
    started = time.perf_counter()
    try:
        await files.calls.run(read, limiter=files.reads, handoff=call, abandon=not batch.pinned)
    except Stuck as exc:
        local = [exc] * len(run)
    finally:
        with call.holding():  # an abandoned thread may still be running: take a snapshot
            got = list(local)
            if lender is not None and call.left_running:
                kept.update((j, lender.keep(i)) for j, i in enumerate(run) if got[j] is _RUNNING)
        each = (time.perf_counter() - started) / len(run)
        for j, i in enumerate(run):
            batch.results[i] = _loaded(batch, i, got[j], since, wrong, each)


def _private(batch: Batch) -> bool:
    """Whether a batch's reads go through the tier's own buffers (see ``_blocks``)."""
    return not batch.pinned and batch.lender is None


def _loaded(
    batch: Batch, i: int, outcome: object, since: int, wrong: list[str], seconds: float
) -> TierError | None:
    """The bookkeeping of one block of a batch load, as ``load`` does it for one."""
    ledger, key, name, view = batch.ledger, batch.keys[i], batch.names[i], batch.views[i]
    if outcome is ReadOutcome.LOADED:
        ledger.loaded(key, name, view.nbytes, seconds)
        return None
    if outcome is ReadOutcome.MISSING:
        return ledger.missing(key, name, since)
    if isinstance(outcome, Corrupt):
        return ledger.corrupt(key, name, since, str(outcome))
    if isinstance(outcome, WrongSize):
        wrong.append(
            f"dst holds {view.nbytes} bytes but block {key.hex()} is {outcome.stored} bytes"
        )
        return None
    if isinstance(outcome, OSError | Stuck):
        return ledger.load_failed(outcome, key)
    return ledger.timed_out(key, "load")  # not started (or abandoned) by the deadline


async def store_many(
    batch: Batch,
    deadline: float,
    prepare: Callable[[], Awaitable[None]],
    store: Callable[[bytes, memoryview], Awaitable[None]],
    again: Callable[[bytes, memoryview], Awaitable[None]],
) -> BatchResults:
    """``FSTier.store_many`` once its arguments are checked. ``prepare`` readies a root that
    is not (raising the error to report); ``store`` is the tier's own, for keys that are
    being stored already: it waits for that store. ``again`` stores one block of the batch
    that found the disk full, alone, making room as ``store`` does."""
    catalog, keys = batch.ledger.catalog, batch.keys
    mine: list[int] = []
    later: list[int] = []  # keys being stored already (or twice here): store() waits
    for i, key in enumerate(keys):
        if key in catalog.storing:
            later.append(i)
        else:
            catalog.begin_store(key, anyio.Event())
            mine.append(i)
    try:
        await _store_mine(batch, mine, deadline, prepare, again)
    finally:
        for i in mine:
            catalog.end_store(keys[i]).set()
        batch.ledger.stores_ended([keys[i] for i in mine])
    if later:
        calls = [functools.partial(store, keys[i], batch.views[i]) for i in later]
        errors = await run_each(
            [keys[i] for i in later], calls, deadline, batch.ledger.name, "store"
        )
        for i, error in zip(later, errors, strict=True):
            batch.results[i] = error
    return batch.results


async def _store_mine(
    batch: Batch,
    mine: list[int],
    deadline: float,
    prepare: Callable[[], Awaitable[None]],
    again: Callable[[bytes, memoryview], Awaitable[None]],
) -> None:
    batch.files.calls.drain_late()
    if not batch.ledger.catalog.ready:
        try:
            await prepare()
        except TierError as exc:
            for i in mine:
                batch.results[i] = exc
            return
    todo = list(mine)
    full: list[int] = []  # blocks that found the disk full: stored again alone
    with anyio.CancelScope(deadline=deadline):
        while todo:  # in waves: a block can only evict blocks already published
            plan = _plan_wave(batch, todo)
            runs = _runs(len(plan), batch.files.max_write_concurrency)
            await _together(
                [functools.partial(_store_run, batch, [plan[j] for j in r], full) for r in runs]
            )
        while full:
            try:
                await again(batch.keys[full[0]], batch.views[full[0]])
            except TierError as exc:
                batch.results[full[0]] = exc
            del full[0]
    for i in todo + full:  # the deadline passed before their wave
        batch.results[i] = batch.ledger.timed_out(batch.keys[i], "store")


def _plan_wave(batch: Batch, todo: list[int]) -> list[tuple[int, Reservation]]:
    """Take from ``todo`` the blocks that fit now, choosing their victims and reserving
    their room; a block that needs room only earlier blocks of the batch can give (once
    they are published and evictable) waits for the next wave, as it would in a loop of
    ``store`` calls."""
    ledger = batch.ledger
    plan: list[tuple[int, Reservation]] = []
    while todo:
        i = todo[0]
        key, nbytes = batch.keys[i], batch.views[i].nbytes
        if plan and not ledger.catalog.fits(ledger.file_size(key, nbytes)):
            break
        del todo[0]
        try:
            plan.append((i, ledger.reserve(key, batch.names[i], nbytes)))
        except TierNoSpaceError as exc:
            batch.results[i] = exc
    return plan


async def _store_run(batch: Batch, part: list[tuple[int, Reservation]], full: list[int]) -> None:
    stop_at = _stop_at()
    local: list[object] = [_NOT_STARTED] * len(part)
    files, views = batch.files, batch.views

    def write(call: Handoff) -> None:
        for j, (i, res) in enumerate(part):
            if time.monotonic() > stop_at:
                return
            outcome: object
            try:
                outcome = _blocks.write_from_slot(
                    files,
                    call,
                    res.key,
                    res.name,
                    views[i],
                    res.victim_names,
                    private=not batch.pinned,
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
                _stored(batch, part[j], local[j], 0.0)

    call = Handoff()
    started = time.perf_counter()
    got: list[object] = local
    try:
        await files.calls.run(
            write, limiter=files.writes, on_late=late, handoff=call, abandon=not batch.pinned
        )
    except Stuck as exc:
        local[:] = [exc] * len(part)
    finally:
        with call.holding():
            got = list(local)
        each = (time.perf_counter() - started) / len(part)
        for j, (i, res) in enumerate(part):
            if got[j] is _RUNNING and call.left_running:
                # ``late`` settles its account when the thread returns.
                batch.results[i] = batch.ledger.timed_out(res.key, "store")
                continue
            batch.results[i] = _stored(batch, part[j], got[j], each, full)


def _stored(
    batch: Batch,
    item: tuple[int, Reservation],
    outcome: object,
    seconds: float,
    full: list[int] | None = None,
) -> TierError | None:
    """The bookkeeping of one block of a batch store, as ``store`` does it for one; a block
    that found the disk full while there are blocks to evict goes to ``full``."""
    i, res = item
    ledger = batch.ledger
    if isinstance(outcome, tuple):
        ledger.stored(res, outcome, batch.views[i].nbytes, seconds)
        return None
    ledger.settle(res, None, touched=outcome is not _NOT_STARTED)
    if full is not None and isinstance(outcome, OSError) and ledger.disk_full(outcome):
        full.append(i)
        return None
    if isinstance(outcome, OSError | Stuck):
        return ledger.error(outcome, "store", res.key)
    return ledger.timed_out(res.key, "store")


async def _together(calls: list[Callable[[], Coroutine[Any, Any, None]]]) -> None:
    """Await the calls concurrently; one alone in the caller's task (a task of its own costs
    more loop time than a one-block job's own bookkeeping)."""
    if len(calls) == 1:
        await calls[0]()
        return
    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(call)


def _runs(n: int, most: int) -> list[range]:
    """``range(n)`` cut into at most ``most`` contiguous runs of near-equal length."""
    k = min(n, most)
    return [range(r * n // k, (r + 1) * n // k) for r in range(k)]


def _stop_at() -> float:
    """The current cancel scope's deadline on ``time.monotonic()``'s clock, for a thread."""
    left = anyio.current_effective_deadline() - anyio.current_time()
    return time.monotonic() + left
