"""``KVEventPublisher``: tier events over ZMQ in vLLM's ``KVEventBatch`` framing, with replay,
never blocking its caller. Real sockets on 127.0.0.1; payloads decoded as plain msgpack here
(``test_vllm_kv_events.py`` decodes them with vLLM's own classes)."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
import zmq

import kvtier
from kvtier import EventBuffer, EventKind, TierEvent
from kvtier.integrations.kv_events import END_OF_REPLAY, KVEventPublisher, encode_event

ANY_PORT = "tcp://127.0.0.1:0"
RECEIVE_MS = 10_000  # a failsafe: a message that should come never takes this long
TOO_WIDE = b"\xff" * 9  # a key that, read as one int, needs 72 bits: msgpack carries 64


def as_int(key: bytes) -> int:
    return int.from_bytes(key, "big")


def stored(*keys: bytes, tier: str = "fs", locality: str = "LOCAL") -> TierEvent:
    return TierEvent(EventKind.STORED, keys, tier, locality=locality)


def subscriber(context: Any, endpoint: str, topic: bytes = b"") -> Any:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def assert_released(context: Any, *endpoints: str | None) -> None:
    """A fresh socket binds each endpoint: the publisher holds none of them any more."""
    for endpoint in endpoints:
        assert endpoint is not None
        probe = context.socket(zmq.PUB)
        probe.setsockopt(zmq.LINGER, 0)
        try:
            probe.bind(endpoint)
        finally:
            probe.close()


def joined(publisher: KVEventPublisher, sub: Any) -> int:
    """Publish probes until ``sub`` receives one (a SUB socket misses what is sent before its
    subscription reaches the publisher); the next sequence number."""
    while True:
        publisher.publish([stored(b"probe")])
        try:
            if sub.poll(50):
                break
        except zmq.Again:
            continue
    while sub.poll(200):
        _, sequence, _ = sub.recv_multipart()
    return int.from_bytes(sequence, "big") + 1


def test_batches_carry_topic_sequence_and_vllms_event_maps(context: Any) -> None:
    with KVEventPublisher(
        ANY_PORT, block_size=16, topic="kv", data_parallel_rank=2, heartbeat_s=None
    ) as publisher:
        sub = subscriber(context, publisher.endpoint, b"kv")
        first = joined(publisher, sub)
        publisher.publish(
            [
                stored(b"a", b"b"),
                TierEvent(EventKind.REMOVED, (b"a",), "s3", locality="REMOTE", reason="corrupt"),
                TierEvent(EventKind.CLEARED, (), "fs"),
            ]
        )
        topic, sequence, payload = sub.recv_multipart()
        sub.close()
    assert topic == b"kv" and int.from_bytes(sequence, "big") == first
    timestamp, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(timestamp, float) and rank == 2
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [b"a", b"b"],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 16,
            "lora_id": None,
            "lora_name": None,
            "medium": "STORAGE",
            "locality": "LOCAL",
            "ownership": "fs",
            "shared": False,
            "storage": "",
        },
        {
            "type": "BlockRemoved",
            "block_hashes": [b"a"],
            "medium": "STORAGE",
            "locality": "REMOTE",
            "ownership": "s3",
            "shared": False,
            "storage": "",
        },
        {"type": "AllBlocksCleared"},
    ]


def test_a_late_subscriber_replays_what_it_missed_then_gets_the_end_marker(context: Any) -> None:
    with KVEventPublisher(
        ANY_PORT, block_size=4, replay_endpoint=ANY_PORT, heartbeat_s=None
    ) as publisher:
        sub = subscriber(context, publisher.endpoint)
        start = joined(publisher, sub)
        for i in range(5):
            publisher.publish([stored(bytes([i]))])
        live = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(5)]
        sub.close()
        assert live == list(range(start, start + 5))

        assert publisher.replay_endpoint is not None
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (start + 2).to_bytes(8, "big")])
        frames = []
        while (frame := dealer.recv_multipart())[2] != END_OF_REPLAY:
            frames.append(frame)
        dealer.close()
        assert publisher.statistics().replays == 1
    assert [int.from_bytes(f[2], "big") for f in frames] == [start + 2, start + 3, start + 4]
    assert [msgspec.msgpack.decode(f[3])[1][0]["block_hashes"] for f in frames] == [
        [b"\x02"],
        [b"\x03"],
        [b"\x04"],
    ]


def test_a_restarted_publisher_numbers_its_batches_on_above_its_previous_life(
    context: Any,
) -> None:
    """Numbers start from the clock, not 0: a subscriber that missed a node's restart sees
    its new batches as a gap (and repairs it), never as numbers it already applied."""
    with KVEventPublisher(ANY_PORT, block_size=4, heartbeat_s=None) as before:
        sub = subscriber(context, before.endpoint)
        last = joined(before, sub) - 1
        for i in range(200):
            before.publish([stored(bytes([i % 256]))])
        last += 200
        sub.close()
    with KVEventPublisher(ANY_PORT, block_size=4, heartbeat_s=None) as after:
        sub = subscriber(context, after.endpoint)
        first_after = joined(after, sub) - 1  # at least the probe's number
        sub.close()
    assert first_after > last + 1


def test_closing_just_after_a_subscriber_left_with_batches_in_flight_does_not_abort(
    context: Any,
) -> None:
    """libzmq aborts the process (an assertion in a connection's session) when a PUB socket
    is torn down at once while a subscriber's disconnect is handled with multipart messages
    still queued for it; before the fix, about one close in four here took pytest down."""
    for _ in range(20):
        with KVEventPublisher(ANY_PORT, block_size=4, heartbeat_s=None) as publisher:
            sub = subscriber(context, publisher.endpoint)
            joined(publisher, sub)
            for i in range(200):
                publisher.publish([stored(bytes([i]))])
            sub.close()
        assert_released(context, publisher.endpoint)


def test_a_replay_request_of_the_wrong_shape_is_counted_and_ignored(context: Any) -> None:
    with KVEventPublisher(
        ANY_PORT, block_size=4, replay_endpoint=ANY_PORT, heartbeat_s=None
    ) as publisher:
        assert publisher.replay_endpoint is not None
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.recv_multipart()[2] == END_OF_REPLAY  # nothing held yet: only the end
        dealer.close()
        assert publisher.statistics().bad_replay_requests == 1


async def test_a_subscriber_that_never_reads_blocks_neither_the_loop_nor_the_thread(
    context: Any,
) -> None:
    publisher = KVEventPublisher(ANY_PORT, block_size=4, hwm=10, replay_endpoint=ANY_PORT)
    stalled = subscriber(context, publisher.endpoint)
    stalled.setsockopt(zmq.RCVHWM, 10)
    joined(publisher, stalled)
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await anyio.lowlevel.checkpoint()

    big = [stored(*(i.to_bytes(4, "big") + bytes(60) for i in range(200)))]
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        for _ in range(2_000):
            publisher.publish(big)
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert beats >= 1_000  # the loop kept running other tasks between the publishes
    fresh = subscriber(context, publisher.endpoint)
    joined(publisher, fresh)  # the thread still sends: it did not wait for the stalled reader
    stalled.close()
    fresh.close()
    await publisher.aclose()


def test_a_thread_behind_drops_and_counts_and_publish_never_waits(context: Any) -> None:
    release = threading.Event()

    def slow_hash(key: bytes) -> bytes:
        release.wait(RECEIVE_MS / 1000)
        return key

    publisher = KVEventPublisher(ANY_PORT, block_size=4, queue_batches=2, block_hash=slow_hash)
    outcomes = [publisher.publish([stored(bytes([i]))]) for i in range(10)]
    release.set()
    publisher.close()
    # The thread holds one batch and the queue two more: at least seven were dropped.
    assert outcomes.count(False) >= 7
    assert publisher.statistics().dropped == outcomes.count(False)


def test_a_batch_dropped_by_a_full_queue_leaves_a_gap_in_the_sequence(context: Any) -> None:
    """A dropped batch took its sequence when published: the next batch sent shows the gap
    to every subscriber (the replay holds only what was sent, so a subscriber repairs it
    with the full state)."""
    busy, release = threading.Event(), threading.Event()

    def held(key: bytes) -> bytes:
        if key == b"held":
            busy.set()
            release.wait(RECEIVE_MS / 1000)
        return key

    publisher = KVEventPublisher(
        ANY_PORT, block_size=4, queue_batches=1, replay_endpoint=ANY_PORT, block_hash=held
    )
    with subscriber(context, publisher.endpoint) as sub:
        first = joined(publisher, sub)
        publisher.publish([stored(b"held")])
        assert busy.wait(RECEIVE_MS / 1000)  # the thread is inside block_hash
        outcomes = [publisher.publish([stored(bytes([i]))]) for i in range(3)]
        release.set()
        received: list[tuple[int, list[bytes]]] = []

        def until(last: bytes) -> None:
            while not received or received[-1][1] != [last]:
                _, sequence, payload = sub.recv_multipart()
                if hashes := [e["block_hashes"] for e in msgspec.msgpack.decode(payload)[1]]:
                    received.append((int.from_bytes(sequence, "big"), hashes[0]))

        until(b"\x00")  # the queue is empty again
        assert publisher.publish([stored(b"after")])
        until(b"after")
    publisher.close()
    assert outcomes == [True, False, False]  # one fits the queue behind the held batch
    assert publisher.statistics().dropped == 2
    assert received == [(first, [b"held"]), (first + 1, [b"\x00"]), (first + 4, [b"after"])]


def test_an_idle_publisher_sends_empty_batches_with_the_next_sequences(context: Any) -> None:
    """A subscriber that lost the last batches of a burst learns it from the next message:
    an idle publisher sends one every ``heartbeat_s``, an empty batch with the next sequence."""
    with KVEventPublisher(ANY_PORT, block_size=4, heartbeat_s=0.05) as publisher:
        sub = subscriber(context, publisher.endpoint)
        while not sub.poll(50):  # until the subscription reached the publisher
            publisher.publish([stored(b"probe")])
        publisher.publish([stored(b"last")])
        received: list[tuple[int, bool]] = []  # (sequence, whether it held events)
        while len(received) < 4 or any(events for _, events in received[-3:]):
            _, sequence, payload = sub.recv_multipart()
            events = bool(msgspec.msgpack.decode(payload)[1])
            received.append((int.from_bytes(sequence, "big"), events))
        sub.close()
    sequences = [s for s, _ in received]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))  # no gap
    assert received[-3:] == [(s, False) for s in sequences[-3:]]
    assert publisher.statistics().heartbeats >= 3


def test_keys_without_a_hash_are_left_out_and_counted(context: Any) -> None:
    def only_even(key: bytes) -> int | None:
        return key[0] if key[0] % 2 == 0 else None

    with KVEventPublisher(
        ANY_PORT, block_size=4, block_hash=only_even, heartbeat_s=None
    ) as publisher:
        sub = subscriber(context, publisher.endpoint)
        joined(publisher, sub)
        publisher.publish([stored(b"\x01", b"\x02", b"\x03"), stored(b"\x05")])
        _, _, payload = sub.recv_multipart()
        sub.close()
    _, events = msgspec.msgpack.decode(payload)
    assert [e["block_hashes"] for e in events] == [[2]]
    assert publisher.statistics().unmapped >= 3


async def test_a_stream_of_a_buffer_is_published_until_it_closes(context: Any) -> None:
    buffer = EventBuffer("fs", capacity=100)
    async with KVEventPublisher(ANY_PORT, block_size=4, heartbeat_s=None) as publisher:
        sub = subscriber(context, publisher.endpoint)
        joined(publisher, sub)
        async with anyio.create_task_group() as tg, kvtier.EventStream(buffer) as stream:
            tg.start_soon(publisher.publish_stream, stream)
            buffer.emit(EventKind.STORED, [b"x"])
            _, _, payload = await anyio.to_thread.run_sync(sub.recv_multipart)
            stream.close()
        sub.close()
    assert msgspec.msgpack.decode(payload)[1][0]["block_hashes"] == [b"x"]


def test_a_batch_that_cannot_be_encoded_is_dropped_and_counted_and_the_thread_goes_on(
    context: Any, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = KVEventPublisher(
        ANY_PORT, block_size=4, replay_endpoint=ANY_PORT, block_hash=as_int
    )
    with (
        subscriber(context, publisher.endpoint) as sub,
        caplog.at_level(logging.WARNING, logger="kvtier.integrations.kv_events"),
    ):
        first = joined(publisher, sub)
        publisher.publish([stored(TOO_WIDE)])
        publisher.publish([stored(b"\x01", TOO_WIDE)])
        publisher.publish([stored(b"\x07")])
        _, sequence, payload = sub.recv_multipart()  # sent after the two bad ones
    publisher.close()
    # The dropped ones kept their sequences: a gap a subscriber sees and repairs.
    assert int.from_bytes(sequence, "big") == first + 2
    assert msgspec.msgpack.decode(payload)[1][0]["block_hashes"] == [7]
    assert publisher.statistics().failed == 2
    logged = [r for r in caplog.records if r.name == "kvtier.integrations.kv_events"]
    assert len(logged) == 1 and "64 bits" in logged[0].getMessage()
    assert not publisher._thread.is_alive()
    assert_released(context, publisher.endpoint, publisher.replay_endpoint)


def test_a_block_hash_msgpack_cannot_carry_is_refused_saying_what_to_return() -> None:
    with pytest.raises(ValueError, match="64 bits"):
        encode_event(stored(TOO_WIDE), 4, as_int)
    with pytest.raises(ValueError, match="bytes or an int"):
        encode_event(stored(b"k"), 4, bytes.hex)  # type: ignore[arg-type]
    widest, _ = encode_event(stored(b"\xff" * 8), 4, as_int)
    assert widest is not None and widest["block_hashes"] == [2**64 - 1]


def test_close_with_a_busy_thread_and_a_full_queue_unbinds_and_stops_the_thread(
    context: Any,
) -> None:
    busy, release = threading.Event(), threading.Event()

    def held(key: bytes) -> bytes:
        if key == b"held":
            busy.set()
            release.wait(RECEIVE_MS / 1000)
        return key

    publisher = KVEventPublisher(
        ANY_PORT, block_size=4, queue_batches=2, replay_endpoint=ANY_PORT, block_hash=held
    )
    publisher.publish([stored(b"held")])
    assert busy.wait(RECEIVE_MS / 1000)  # the thread is inside block_hash
    assert publisher.publish([stored(b"1")]) and publisher.publish([stored(b"2")])
    assert not publisher.publish([stored(b"3")])  # the queue is full
    publisher.close()  # returns within its bound though the thread is still held
    assert_released(context, publisher.endpoint, publisher.replay_endpoint)
    release.set()
    publisher._thread.join(RECEIVE_MS / 1000)
    assert not publisher._thread.is_alive()
    # Nothing went out after close: the full queue's one, the held batch and the two queued.
    assert (publisher.statistics().dropped, publisher.statistics().published) == (4, 0)


async def test_publish_stream_returns_when_the_publisher_closes_while_the_stream_is_idle() -> None:
    publisher = KVEventPublisher(ANY_PORT, block_size=4)
    async with kvtier.EventStream(EventBuffer("fs", capacity=10)) as stream:
        with anyio.fail_after(RECEIVE_MS / 1000):
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.publish_stream, stream)
                await anyio.wait_all_tasks_blocked()  # it waits for a batch that never comes
                await publisher.aclose()
            await publisher.publish_stream(stream)  # closed already: returns at once


def test_bad_settings_and_a_taken_port_say_what_to_change() -> None:
    with pytest.raises(kvtier.InvalidArgumentError, match="block_size"):
        KVEventPublisher(ANY_PORT, block_size=0)
    with pytest.raises(kvtier.InvalidArgumentError, match="queue_batches"):
        KVEventPublisher(ANY_PORT, block_size=4, queue_batches=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(kvtier.InvalidArgumentError, match="cannot bind"):
            KVEventPublisher(f"tcp://127.0.0.1:{port}", block_size=4)


def test_publish_after_close_is_a_lifecycle_error() -> None:
    publisher = KVEventPublisher(ANY_PORT, block_size=4)
    publisher.close()
    publisher.close()  # idempotent
    with pytest.raises(kvtier.LifecycleError):
        publisher.publish([stored(b"k")])
    assert "closed" in repr(publisher)
