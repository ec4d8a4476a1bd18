"""The safety core of a CudaPool's copies: lanes, pinned staging, fences and operations in flight.

``CopyCore`` holds what every copy needs and the rules that keep a DMA from ever touching memory
someone else owns (see ``_cuda_copies``, whose ``SlotCopies`` builds the copies on it): every
enqueue re-checks that the pool is open (``_submit``); ``aclose`` frees nothing while an
operation is in flight (``operation``); once anything was enqueued, buffers go back only when
the copy is known to have finished or never to run (``_settle``); a copy that outlives
``settle_timeout`` is abandoned behind fence events (``_abandon``), its buffers kept until it
lands.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import numpy as np

from kvtier.common._buffers import LOOP_COPY_BYTES
from kvtier.common._errors import InvalidArgumentError, LifecycleError
from kvtier.common._threads import run_sync
from kvtier.pools._cuda_caller import CudaCaller
from kvtier.pools._cuda_stream import (
    Completion,
    Lane,
    StagingBuffer,
    StagingPool,
    loop_scheduler,
)
from kvtier.pools._cupy import CudaRuntime, use_device

__all__ = ["CopyCore", "CopyLimits", "SlotSpan", "TransferStatistics"]

logger = logging.getLogger("kvtier.pools._cuda_copies")


@dataclass(frozen=True, slots=True)
class TransferStatistics:
    """What CudaPool moved and how often it had to wait (``CudaPool.transfer_statistics``)."""

    device: int
    staging_buffers: int
    upload_staging_free: int
    download_staging_free: int
    engine_staging_free: int
    staging_waits: int
    bytes_to_device: int
    bytes_to_host: int
    bytes_device_to_device: int
    abandoned_copies: int
    operations_in_flight: int


def _memcpy_pairs(pairs: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in pairs:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class SlotSpan(NamedTuple):
    """Where a pool's slots are: the device, the address of slot 0, how many, how large."""

    device: int
    base: int
    num_blocks: int
    block_bytes: int


class CopyLimits(NamedTuple):
    """Pinned staging buffers per set, and how long a copy may take: ``settle_timeout`` before
    a cancelled or failed one is abandoned behind fences, ``copy_timeout`` before one fails."""

    staging_buffers: int
    settle_timeout: float
    copy_timeout: float


class CopyCore:
    """The state every copy shares, for the ``slots`` of a pool, within ``limits``. Build it
    with the slots' device current (its streams and pinned buffers are created here)."""

    def __init__(
        self, runtime: CudaRuntime, slots: SlotSpan, limits: CopyLimits, engine_stream: Any
    ) -> None:
        self._rt = runtime
        self.slots, self.limits = slots, limits
        self.device, self.block_bytes = slots.device, slots.block_bytes
        self._engine_stream = engine_stream  # the object, kept alive while the pool lives
        # slot -> (fence event, the abandoned copy's completion that retires it)
        self._fences: dict[int, tuple[int, Completion]] = {}
        self._to_device = self._to_host = self._peer_bytes = self._abandoned = 0
        self._in_flight = 0
        self._idle: anyio.Event | None = None
        self.closing = False
        # Host memcpys of big batches: our own threads, not the default limiter's.
        self._limiter = anyio.CapacityLimiter(2)
        self._lanes: list[Lane] = []
        self._staging: list[StagingPool] = []
        self._caller = CudaCaller(runtime, self.device)  # every CUDA call of a copy
        try:
            self._upload = self._lane("upload")
            self._download = self._lane("download")
            self._peer = self._lane("peer")
            self._order = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
            self._upload_staging = self._pinned(limits.staging_buffers)
            self._download_staging = self._pinned(limits.staging_buffers)
            self._engine_staging = self._pinned(limits.staging_buffers)
        except BaseException:
            self.release()
            raise

    def _lane(self, name: str) -> Lane:
        lane = Lane(self._rt, self.device, name)
        self._lanes.append(lane)
        return lane

    def _pinned(self, count: int) -> StagingPool:
        staging = StagingPool(self._rt, count, self.block_bytes)
        self._staging.append(staging)
        return staging

    # -- helpers -----------------------------------------------------------------------------

    def on_device(self) -> contextlib.AbstractContextManager[None]:
        """The pool's device current for the block (see ``use_device``: switched only when
        it is not, and back only where a context was current before)."""
        return use_device(self._rt, self.device)

    def synchronize(self) -> None:
        """Block until every copy queued on the lanes ran (a worker thread, or tools)."""
        with self.on_device():
            for lane in self._lanes:
                self._rt.streamSynchronize(lane.stream)

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        """Count an operation in flight for its whole life (``aclose`` waits for it)."""
        if self.closing:
            raise LifecycleError("this CudaPool is closed")
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    def ptr(self, slot: int) -> int:
        """The device address of ``slot``."""
        if not 0 <= slot < self.slots.num_blocks:
            raise InvalidArgumentError(f"slot {slot} is outside [0, {self.slots.num_blocks})")
        return self.slots.base + slot * self.block_bytes

    def _issue(self, lane: Lane, copies: list[tuple[int, int]], kind: int) -> None:
        """Enqueue block copies (dst, src) on ``lane``, one copy per run of blocks that are
        contiguous on both sides (slots taken in order and one engine array usually are)."""
        size = self.block_bytes
        run_dst, run_src, run_len = copies[0][0], copies[0][1], size
        for dst, src in copies[1:]:
            if dst == run_dst + run_len and src == run_src + run_len:
                run_len += size
                continue
            self._rt.memcpyAsync(run_dst, run_src, run_len, kind, lane.stream)
            run_dst, run_src, run_len = dst, src, size
        self._rt.memcpyAsync(run_dst, run_src, run_len, kind, lane.stream)

    async def _submit(
        self,
        lane: Lane,
        copies: list[tuple[int, int]],
        kind: int,
        slots: Sequence[int],
        after: Sequence[int] = (),
    ) -> Completion:
        """Enqueue ``copies`` on ``lane`` after the fences of ``slots`` and the streams
        ``after``, on the pool's CUDA thread; the completion covers whatever got enqueued,
        even when enqueueing failed partway (it then reports that error once the stream
        drained). Raises, enqueueing nothing, only when the pool is closing."""
        if self.closing:
            raise LifecycleError("this CudaPool is closed")
        fences = [self._fences[slot][0] for slot in slots if slot in self._fences]
        done, schedule = Completion(), loop_scheduler()

        def enqueue() -> None:  # the CUDA thread
            try:
                for handle in after:  # the event may be recorded again once waited on
                    self._rt.eventRecord(self._order, handle)
                    self._rt.streamWaitEvent(lane.stream, self._order, 0)
                for fence in fences:
                    self._rt.streamWaitEvent(lane.stream, fence, 0)
                self._issue(lane, copies, kind)
            except Exception as exc:
                lane.mark(done, schedule, exc)
                return
            lane.mark(done, schedule)

        await self._caller.run(enqueue)
        return done

    async def _wait(self, done: Completion) -> None:
        """Until ``done``; a copy slower than ``copy_timeout`` fails the operation (and is
        then settled or abandoned like a cancelled one)."""
        with anyio.fail_after(self.limits.copy_timeout):
            await done.wait()

    async def _settle(
        self,
        done: Completion | None,
        lane: Lane,
        slots: Sequence[int],
        staging: StagingPool | None,
        buffers: list[StagingBuffer],
        engine: Sequence[int] = (),
        keep: object = None,
    ) -> None:
        """Return staging buffers once no DMA can touch them; runs in ``finally``.

        A copy still running is waited for (shielded, at most ``settle_timeout``); one that
        outlives that is abandoned: ``slots`` (and the ``engine`` streams) are fenced on it,
        and ``buffers`` and ``keep`` (the engine's arrays) are let go only when it lands."""
        if done is not None and not done.done():
            with anyio.move_on_after(self.limits.settle_timeout, shield=True):
                await done.settled()
            if not done.done():
                await self._abandon(done, lane, slots, engine)
                if staging is not None and buffers:
                    done.add_done_callback(functools.partial(staging.release, buffers))
                if keep is not None:
                    done.add_done_callback(functools.partial(_keep_until_done, keep))
                return
        if staging is not None and buffers:
            staging.release(buffers)

    async def _abandon(
        self, done: Completion, lane: Lane, slots: Sequence[int], engine: Sequence[int]
    ) -> None:
        self._abandoned += 1
        logger.warning(
            "a CUDA copy on cuda:%d outlived settle_timeout=%.1fs; fencing %d slot(s)",
            self.device,
            self.limits.settle_timeout,
            len(slots),
        )

        def fence_it() -> tuple[int, bool]:  # the CUDA thread: (fence event, made here)
            fence, made = done.event, False
            if fence is None:  # a stream-wide completion: a fence for all queued so far
                fence = self._rt.eventCreateWithFlags(self._rt.eventDisableTiming)
                made = True
                try:
                    self._rt.eventRecord(fence, lane.stream)
                except BaseException:
                    self._rt.eventDestroy(fence)
                    raise
            for handle in engine:  # the engine must not reuse its buffers before it lands
                self._rt.streamWaitEvent(handle, fence, 0)
            return fence, made

        try:
            fence, made = await self._caller.run(fence_it)
        except Exception:  # the context is failing: nothing queued will run any more
            logger.exception("fencing an abandoned CUDA copy on cuda:%d failed", self.device)
            return
        if made:
            done.add_done_callback(functools.partial(self._destroy_event, fence))
        for slot in slots:
            self._fences[slot] = (fence, done)
        done.add_done_callback(functools.partial(self._unfence, slots, fence))

    def _destroy_event(self, event: int) -> None:
        """Destroy a fence event on the CUDA thread, after every copy already asked to wait
        on it was enqueued (a dead context takes the event with it)."""
        self._caller.post(self._rt.eventDestroy, event)

    def _unfence(self, slots: Sequence[int], fence: int) -> None:
        for slot in slots:
            current = self._fences.get(slot)
            if current is not None and current[0] == fence:
                del self._fences[slot]

    async def _host_copy(self, pairs: list[tuple[memoryview, memoryview]], nbytes: int) -> None:
        if nbytes <= LOOP_COPY_BYTES:
            _memcpy_pairs(pairs)
        else:  # not abandoned on cancel: the staging buffer is in use until it returns
            await run_sync(_memcpy_pairs, pairs, limiter=self._limiter)

    # -- closing and observation -------------------------------------------------------------

    async def drain_all(self) -> bool:
        """Refuse new work, then wait (at most ``settle_timeout``) until no operation is in flight
        and every lane ran what was queued; False when something is still running."""
        self.closing = True
        with anyio.move_on_after(self.limits.settle_timeout, shield=True):
            while self._in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
            marks = [Completion() for _ in self._lanes]
            schedule = loop_scheduler()

            def mark_all() -> None:  # the CUDA thread
                for lane, done in zip(self._lanes, marks, strict=True):
                    lane.mark(done, schedule)

            await self._caller.run(mark_all, shielded=False)  # within the bound above
            for done in marks:
                await done.settled()
            return True
        return False

    def release(self) -> bool:
        """Stop the waiters and free the streams, events and pinned memory; blocking (a
        worker thread runs it), and only after ``drain_all`` returned True. False when a
        waiter is stuck on a copy (then nothing is freed)."""
        if not self._caller.stop(self.limits.settle_timeout):
            return False
        if not all(lane.stop(self.limits.settle_timeout) for lane in self._lanes):
            return False
        with self.on_device():
            for lane in self._lanes:
                lane.destroy()
            if hasattr(self, "_order"):
                self._rt.eventDestroy(self._order)
            self._fences.clear()
            for staging in self._staging:
                staging.free()
        return True

    def statistics(self) -> TransferStatistics:
        return TransferStatistics(
            device=self.device,
            staging_buffers=self.limits.staging_buffers,
            upload_staging_free=self._upload_staging.available,
            download_staging_free=self._download_staging.available,
            engine_staging_free=self._engine_staging.available,
            staging_waits=sum(staging.waits for staging in self._staging),
            bytes_to_device=self._to_device,
            bytes_to_host=self._to_host,
            bytes_device_to_device=self._peer_bytes,
            abandoned_copies=self._abandoned,
            operations_in_flight=self._in_flight,
        )


def _keep_until_done(objects: object) -> None:
    """A completion callback whose only job is to hold ``objects`` (the engine's arrays) until
    the copy that touches them has landed."""
