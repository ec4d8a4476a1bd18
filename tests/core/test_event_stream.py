"""``EventStream``: tier events as an async iterator that waits for them instead of polling."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

import kvtier
from kvtier import EventBuffer, EventKind, TierEvent

WAKE_S = 10  # a failsafe: a wakeup that should come never takes this long


async def test_a_burst_queued_before_the_consumer_asks_is_one_batch() -> None:
    buffer = EventBuffer("fs", capacity=100)
    stream = kvtier.EventStream(buffer)
    for i in range(10):
        buffer.emit(EventKind.STORED, [bytes([i])])
    batch = await anext(stream)
    assert [event.keys for event in batch] == [(bytes([i]),) for i in range(10)]
    assert (stream.batches, stream.events) == (1, 10)


async def test_a_waiting_consumer_wakes_for_an_event_from_another_thread() -> None:
    first, second = EventBuffer("fs", capacity=100), EventBuffer("s3", capacity=100)
    got: list[list[TierEvent]] = []
    async with anyio.create_task_group() as tg, kvtier.EventStream(first, second) as stream:

        async def consume() -> None:
            got.append(await anext(stream))

        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()  # the consumer waits: nothing is queued yet
        assert got == []
        await anyio.to_thread.run_sync(
            lambda: second.emit(EventKind.REMOVED, [b"k"], reason="evicted")
        )
    assert got == [[TierEvent(EventKind.REMOVED, (b"k",), "s3", reason="evicted")]]


async def test_events_from_many_threads_all_arrive_in_each_threads_order() -> None:
    buffer = EventBuffer("fs", capacity=1_000_000)
    threads, per_thread = 4, 500
    received: list[TierEvent] = []
    async with kvtier.EventStream(buffer) as stream:

        def emit(worker: int) -> None:
            for i in range(per_thread):
                buffer.emit(EventKind.STORED, [f"{worker}:{i}".encode()])

        workers = [threading.Thread(target=emit, args=(w,)) for w in range(threads)]
        for worker in workers:
            worker.start()
        async for batch in stream:
            received.extend(batch)
            if len(received) == threads * per_thread:
                break
        for worker in workers:
            worker.join()
    for w in range(threads):
        mine = [e.keys[0] for e in received if e.keys[0].startswith(f"{w}:".encode())]
        assert mine == [f"{w}:{i}".encode() for i in range(per_thread)]
    assert buffer.dropped == 0


async def test_close_ends_a_waiting_iteration_and_lets_go_of_the_buffers() -> None:
    buffer = EventBuffer("fs", capacity=10)
    stream = kvtier.EventStream(buffer)
    batches: list[list[TierEvent]] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            batches.extend([batch async for batch in stream])

        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        stream.close()
    assert batches == []
    buffer.emit(EventKind.STORED, [b"k"])  # no listener any more: only queued
    assert len(buffer) == 1
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_closing_an_older_stream_leaves_a_newer_one_listening() -> None:
    buffer = EventBuffer("fs", capacity=10)
    older = kvtier.EventStream(buffer)
    got: list[list[TierEvent]] = []
    arrived = anyio.Event()
    async with kvtier.EventStream(buffer) as newer, anyio.create_task_group() as tg:

        async def consume() -> None:
            got.append(await anext(newer))
            arrived.set()

        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()  # the newer stream waits for an event
        older.close()
        await anyio.to_thread.run_sync(lambda: buffer.emit(EventKind.STORED, [b"k"]))
        with anyio.fail_after(WAKE_S):  # the newer stream wakes, or this fails
            await arrived.wait()
    assert got == [[TierEvent(EventKind.STORED, (b"k",), "fs")]]


def test_close_from_another_thread_after_the_consumers_loop_ended_is_quiet() -> None:
    buffer = EventBuffer("fs", capacity=10)
    stream = kvtier.EventStream(buffer)

    async def wait_then_leave() -> None:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                await anext(stream)

            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()  # the stream waits on this loop
            tg.cancel_scope.cancel()

    anyio.run(wait_then_leave)  # the consumer's loop ends (and closes) here
    errors: list[BaseException] = []

    def close() -> None:
        try:
            stream.close()
        except BaseException as exc:  # what a caller's shutdown would see
            errors.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(WAKE_S)
    assert not closer.is_alive()
    assert errors == []
    assert "closed" in repr(stream)
    buffer.emit(EventKind.STORED, [b"k"])  # the stream let go: the event is only queued
    assert len(buffer) == 1


def test_a_stream_refuses_what_cannot_give_events() -> None:
    with pytest.raises(ValueError, match="at least one"):
        kvtier.EventStream()
    with pytest.raises(ValueError, match="capacity 0"):
        kvtier.EventStream(EventBuffer("fs", capacity=0))
    with pytest.raises(TypeError, match="got MemoryTier"):
        kvtier.EventStream(kvtier.MemoryTier())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="none of these tiers"):
        kvtier.EventStream.from_tiers([kvtier.MemoryTier()])


async def test_a_file_tiers_stores_and_deletes_come_through_from_tiers(tmp_path: Path) -> None:
    pool = kvtier.HostPool(num_blocks=4, block_bytes=64)
    tiers = [kvtier.MemoryTier(), kvtier.FSTier(tmp_path)]
    async with (
        kvtier.TieringManager(pool, tiers) as manager,
        kvtier.EventStream.from_tiers(manager.tiers) as stream,
    ):
        fs = tiers[1]
        await fs.store(b"key-1", memoryview(bytearray(range(64))))
        stored = await anext(stream)
        await fs.delete(b"key-1")
        removed = await anext(stream)
    assert [(e.kind, e.keys, e.tier, e.locality) for e in stored] == [
        (EventKind.STORED, (b"key-1",), fs.name, "LOCAL")
    ]
    assert [(e.kind, e.keys, e.reason) for e in removed] == [
        (EventKind.REMOVED, (b"key-1",), "deleted")
    ]
