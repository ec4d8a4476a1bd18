"""kvtier's standalone publisher speaks vLLM's wire format: what ``KVEventPublisher`` sends
decodes with vLLM's own ``KVEventBatch`` classes, live and replayed, the way vLLM's subscribers
read it (``nox -s vllm``)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import anyio

from kvtier import EventKind, EventStream, FSTier, TierEvent
from tests.integrations.test_kv_events import ANY_PORT, RECEIVE_MS, joined, subscriber
from tests.support import vllm_imports

with vllm_imports("vllm.distributed.kv_events"):
    import msgspec  # type: ignore[import-not-found, unused-ignore]
    import zmq  # type: ignore[import-not-found, unused-ignore]
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    from vllm.distributed.kv_events import ZmqEventPublisher as VllmPublisher

    from kvtier.integrations.kv_events import (
        END_OF_REPLAY,
        FULL_STATE_REQUEST,
        KVEventPublisher,
    )

decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode


def test_live_batches_decode_as_vllms_kv_event_batch(context: Any) -> None:
    with KVEventPublisher(
        ANY_PORT, block_size=16, topic="kv", data_parallel_rank=1, heartbeat_s=None
    ) as publisher:
        sub = subscriber(context, publisher.endpoint, b"kv")
        joined(publisher, sub)
        publisher.publish(
            [
                TierEvent(EventKind.STORED, (b"a", b"b"), "fs"),
                TierEvent(EventKind.STORED, (b"c",), "s3", locality="REMOTE"),
                TierEvent(EventKind.REMOVED, (b"a",), "fs", reason="evicted"),
                TierEvent(EventKind.CLEARED, (), "fs"),
            ]
        )
        _, _, payload = sub.recv_multipart()
        sub.close()
    batch = decode(payload)
    assert batch.data_parallel_rank == 1
    stored, remote, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(remote, BlockStored)
    assert (stored.block_hashes, stored.block_size, stored.medium) == ([b"a", b"b"], 16, "STORAGE")
    assert (stored.locality, stored.ownership, stored.parent_block_hash) == ("LOCAL", "fs", None)
    assert (remote.block_hashes, remote.locality, remote.ownership) == ([b"c"], "REMOTE", "s3")
    assert isinstance(removed, BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.locality) == ([b"a"], "STORAGE", "LOCAL")
    assert isinstance(cleared, AllBlocksCleared)


def test_replayed_batches_decode_and_frame_as_vllms_publisher_frames_them(context: Any) -> None:
    """The same replay request to vLLM's publisher and to kvtier's gets frames of the same
    shape, and both decode with vLLM's classes."""
    ours = KVEventPublisher(ANY_PORT, block_size=4, replay_endpoint=ANY_PORT, heartbeat_s=None)
    theirs_endpoint = f"tcp://127.0.0.1:{free_port()}"
    theirs = VllmPublisher(0, endpoint="inproc://kvtier-test-vllm", replay_endpoint=theirs_endpoint)
    try:
        ours.publish([TierEvent(EventKind.STORED, (b"x",), "fs")])
        theirs.publish(
            KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[b"x"], medium="GPU")])
        )
        replies = {}
        for name, endpoint in (("ours", ours.replay_endpoint), ("theirs", theirs_endpoint)):
            replies[name] = replay_from(context, endpoint, 0, expect=1)
    finally:
        ours.close()
        theirs.shutdown()
    for frames in replies.values():
        assert [len(f) for f in frames] == [4, 4]  # delimiter, topic, sequence, payload
        assert frames[-1][2] == END_OF_REPLAY
    assert replies["theirs"][0][2] == (0).to_bytes(8, "big")  # kvtier's count from its start
    (event,) = decode(replies["ours"][0][3]).events
    assert isinstance(event, BlockStored) and event.block_hashes == [b"x"]
    assert isinstance(decode(replies["theirs"][0][3]).events[0], BlockRemoved)


def test_a_heartbeat_decodes_as_an_empty_kv_event_batch(context: Any) -> None:
    """An idle publisher's heartbeat (the next sequence, no events) is a batch vLLM reads."""
    with KVEventPublisher(ANY_PORT, block_size=16, heartbeat_s=0.05) as publisher:
        sub = subscriber(context, publisher.endpoint)
        while True:  # the first messages may come before the subscription: wait for one
            _, _, payload = sub.recv_multipart()
            if not decode(payload).events:
                break
        sub.close()
    assert decode(payload).events == [] and publisher.statistics().heartbeats >= 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def replay_from(context: Any, endpoint: str | None, start: int, expect: int) -> list[list[bytes]]:
    """Ask ``endpoint`` for a replay from ``start`` until ``expect`` batches and the end marker
    came (a publisher's thread may not have sent a just-published batch yet: ask again)."""
    assert endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        while True:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames = []
            while True:
                frames.append(dealer.recv_multipart())
                if frames[-1][2] == END_OF_REPLAY:
                    break
            if len(frames) == expect + 1:
                return frames
    finally:
        dealer.close()


def test_shared_tier_fields_and_a_full_state_decode_as_vllms_kv_event_batch(
    context: Any, tmp_path: Path
) -> None:
    """kvtier's own fields (``shared``, ``storage``) are skipped by vLLM's decoder, and the
    full state, announced and answered on the replay socket, is ordinary batches."""

    async def run() -> tuple[bytes, list[list[bytes]]]:
        async with FSTier(tmp_path / "c", name="disk") as tier:
            await tier.store(b"k" * 16, memoryview(bytes(4096)))
        async with (
            FSTier(tmp_path / "c", name="disk") as tier,
            KVEventPublisher(
                ANY_PORT, block_size=16, replay_endpoint=ANY_PORT, heartbeat_s=None
            ) as ours,
            EventStream(tier) as stream,
            anyio.create_task_group() as tg,
        ):
            sub = subscriber(context, ours.endpoint)
            # the announcement goes out as the stream starts: subscribed first, or it is missed
            await anyio.to_thread.run_sync(joined, ours, sub)
            tg.start_soon(ours.publish_stream, stream)
            replies = await anyio.to_thread.run_sync(full_state_of, context, ours.replay_endpoint)
            announced = await anyio.to_thread.run_sync(next_full_state, sub)
            sub.close()
            stream.close()
        return announced, replies

    announced, replies = anyio.run(run)
    for payload in (announced, replies[0][3]):
        cleared, kept = decode(payload).events
        assert isinstance(cleared, AllBlocksCleared) and isinstance(kept, BlockStored)
        assert (kept.block_hashes, kept.ownership, kept.medium) == ([b"k" * 16], "disk", "STORAGE")
    assert replies[-1][2] == END_OF_REPLAY


def next_full_state(sub: Any) -> bytes:
    """The next batch that starts with a clear (the live batches of the tier's own walk may
    come before the announcement)."""
    while True:
        _, _, payload = sub.recv_multipart()
        events = decode(payload).events
        if events and isinstance(events[0], AllBlocksCleared):
            return bytes(payload)


def full_state_of(context: Any, endpoint: str | None) -> list[list[bytes]]:
    assert endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        while True:
            dealer.send_multipart([b"", FULL_STATE_REQUEST])
            frames = []
            while True:
                frames.append(dealer.recv_multipart())
                if frames[-1][2] == END_OF_REPLAY:
                    break
            if len(frames) > 1:  # asked before the stream ran: only the end marker came
                return frames
    finally:
        dealer.close()
