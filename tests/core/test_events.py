"""``EventBuffer``: bounded, drained oldest first, dropped events counted, safe across threads."""

from __future__ import annotations

import threading

import pytest

from kvtier import EventBuffer, EventKind, TierEvent


def test_drain_gives_every_event_in_order_then_nothing() -> None:
    buffer = EventBuffer("t", capacity=10)
    buffer.emit(EventKind.STORED, [b"a", b"b"])
    buffer.emit(EventKind.REMOVED, [b"a"], reason="evicted")
    buffer.emit(EventKind.CLEARED)
    buffer.emit(EventKind.STORED, [])  # no keys: nothing happened
    assert buffer.drain() == [
        TierEvent(EventKind.STORED, (b"a", b"b"), "t"),
        TierEvent(EventKind.REMOVED, (b"a",), "t", reason="evicted"),
        TierEvent(EventKind.CLEARED, (), "t"),
    ]
    assert buffer.drain() == [] and len(buffer) == 0


def test_a_full_buffer_drops_and_counts_and_takes_more_once_drained() -> None:
    buffer = EventBuffer("t", capacity=3)
    buffer.emit(EventKind.STORED, [b"a", b"b"])
    buffer.emit(EventKind.STORED, [b"c", b"d"])  # 4 keys would not fit: dropped
    buffer.emit(EventKind.STORED, [b"e"], locality="REMOTE")
    assert (buffer.dropped, buffer.emitted, len(buffer)) == (1, 2, 2)
    assert [e.keys for e in buffer.drain()] == [(b"a", b"b"), (b"e",)]
    buffer.emit(EventKind.STORED, [b"f", b"g", b"h"])
    assert len(buffer) == 1 and buffer.dropped == 1
    assert "dropped=1" in repr(buffer)


def test_capacity_zero_is_off() -> None:
    buffer = EventBuffer("t", capacity=0)
    buffer.emit(EventKind.STORED, [b"a"])
    assert not buffer.enabled and buffer.drain() == [] and buffer.dropped == 0
    with pytest.raises(ValueError, match="capacity"):
        EventBuffer("t", capacity=-1)


def test_emitters_and_a_drainer_on_other_threads_lose_nothing_that_fit() -> None:
    buffer = EventBuffer("t", capacity=1_000_000)
    per_thread, threads = 2_000, 4
    drained: list[TierEvent] = []
    start = threading.Barrier(threads + 1)

    def emit(n: int) -> None:
        start.wait()
        for i in range(per_thread):
            buffer.emit(EventKind.STORED, [n.to_bytes(2, "big") + i.to_bytes(4, "big")])

    workers = [threading.Thread(target=emit, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    while any(w.is_alive() for w in workers):
        drained.extend(buffer.drain())
    for w in workers:
        w.join()
    drained.extend(buffer.drain())
    assert len({e.keys for e in drained}) == per_thread * threads and buffer.dropped == 0
