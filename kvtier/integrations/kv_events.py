"""kvtier's tier events on the wire that KV-aware routers read: vLLM's ``KVEventBatch`` over ZMQ.

A router that follows vLLM engines (llm-d's KV cache manager, Dynamo's router) subscribes to
each engine's PUB socket and decodes every message as vLLM's ``KVEventBatch``. An engine that
embeds kvtier without vLLM publishes its tiers' events the same way::

    publisher = KVEventPublisher("tcp://127.0.0.1:5557", block_size=16,
                                 replay_endpoint="tcp://127.0.0.1:5558")
    async with publisher, EventStream(fs_tier, s3_tier) as stream:
        await publisher.publish_stream(stream)      # until the stream is closed

The wire (vLLM's ``KVEventBatch`` messages, the replay's framing, the block hashes) is
``_kv_wire``'s.

Full state (kvtier's, beside vLLM's wire): what the node's tiers hold now, as batches a router
takes as a reset (``AllBlocksCleared`` then ``BlockStored`` chunks; ``_full_state``). It goes
out on the PUB socket, to every subscriber, when ``publish_stream`` starts, once its tiers
know what they hold (a node that restarts announces what its folder and bucket kept; an S3
index that loads in the background is read first), and to one subscriber on the replay socket
when it sends ``FULL_STATE_REQUEST`` instead of a sequence: the batches, each framed as a
replayed one and carrying the sequence of the next live batch (the state is that of every
batch before it), then the end marker. Requests that arrive together share one snapshot. A
publisher with no ``publish_stream`` running has no tiers to ask and answers with the end
marker alone (``full_states_unavailable``), and so does one whose stream has no tier that can
say what it holds (``EventStream.has_full_state``).

Sequences: each batch takes its number when it is published, so one dropped (the queue was
full, it could not be encoded or sent, the publisher closed first) leaves a gap a subscriber
sees and repairs (``kv_subscriber``: by replay, or by the full state since a dropped batch is
not held for replay); one with no event to say goes out as an empty batch (``[ts, []]``). A
PUB socket drops a subscriber's messages past its high-water mark, the newest first, and a
gap shows only when a later batch arrives: so a publisher idle for ``heartbeat_s`` sends an
empty batch with the next number (a *heartbeat*), and a subscriber that lost the last batches
of a burst learns it within that time of reading again (vLLM's decoder reads an empty batch
as one with no events).

A publisher numbers its batches from the microseconds since the epoch at its start, not from
0: a node that restarts then continues above what its previous life sent (no publisher sends
a batch per microsecond for long), so a subscriber that missed the restart and its
announcement sees a gap, not a run of numbers it takes for ones it already applied, and
repairs it (a replay the new publisher cannot serve, then its full state). Subscribers take
the first number they see as where they join, as vLLM's do.

Nothing here blocks the caller: ``publish`` encodes nothing and only queues the batch, or drops
and counts it when ``queue_batches`` are already waiting. One thread owns both sockets,
encodes, sends without blocking (a PUB socket drops for a subscriber past its high-water mark;
the replay socket drops the rest of a replay for a requester that does not read) and serves
replays from the last ``replay_batches`` batches. Sockets always bind (a router connects).

The thread serves every batch after it: a batch it cannot encode or send is dropped, counted
(``failed``) and logged once per burst. ``close`` lets it send what is queued, but never waits
on it for more than a bound: past that it closes the sockets itself (the endpoints are free once
``close`` returns), and the thread drops what is left and ends at its next step (a
``block_hash`` that is still running finishes first).

Needs the ``events`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import anyio
import anyio.to_thread
from anyio.abc import AsyncResource

from kvtier.common._errors import ExtraNotInstalledError, InvalidArgumentError, LifecycleError
from kvtier.common._events import TierEvent
from kvtier.common._logging import BurstLogger
from kvtier.common._threads import run_sync
from kvtier.integrations._event_stream import EventStream
from kvtier.integrations._kv_wire import (
    END_OF_REPLAY,
    FULL_STATE_REQUEST,
    BlockHash,
    encode_event,
)

__all__ = [
    "END_OF_REPLAY",
    "FULL_STATE_REQUEST",
    "KVEventPublisher",
    "PublisherStatistics",
    "encode_event",
]

_STOP = object()  # queued by close: the thread sends what came before and ends
_IDLE_POLL_S = 0.05  # how long the thread waits for a batch before it looks for replay requests
_CLOSE_S = 2.0  # how long close waits for the thread before it closes the sockets itself
_UNBIND_S = 1.0  # how long closing a socket waits for ZMQ to close its listener
_CLOSE_LINGER_MS = 100  # what a closing socket gives its connections to finish (``_unbind``)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    """What a ``KVEventPublisher`` sent, dropped and served, for its operator."""

    published: int  # batches sent on the PUB socket (heartbeats not counted)
    dropped: int  # batches not sent: the thread was ``queue_batches`` behind, or was closed
    unmapped: int  # keys ``block_hash`` mapped to None
    replays: int  # replay requests served
    bad_replay_requests: int  # replay messages of the wrong shape, ignored
    failed: int = 0  # batches dropped because encoding or sending them raised (logged)
    full_states: int = 0  # full states sent: announced on the PUB socket, or answered
    full_states_unavailable: int = 0  # requests answered with the end marker alone
    heartbeats: int = 0  # empty batches sent because the publisher was idle


@dataclass(frozen=True, slots=True)
class _FullState:
    """A snapshot for the thread to send: on the PUB socket (``to`` None: its batches take
    the sequences from ``sequence`` on) or to each requester on the replay socket (framed
    with ``sequence``, the first taken after the snapshot: it is the state of those before)."""

    batches: list[list[TierEvent]]
    to: tuple[bytes, ...] | None
    sequence: int


class KVEventPublisher(AsyncResource):
    """Publishes batches of ``TierEvent`` as vLLM's ``KVEventBatch`` (see the module doc)."""

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_batches: int = 10_000,
        hwm: int = 100_000,
        queue_batches: int = 1_024,
        data_parallel_rank: int | None = None,
        block_hash: Callable[[bytes], BlockHash | None] | None = None,
        clock: Callable[[], float] = time.time,
        heartbeat_s: float | None = 0.5,
    ) -> None:
        _check_settings(block_size, replay_batches, hwm, queue_batches)
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise InvalidArgumentError(
                f"heartbeat_s must be positive (seconds idle before an empty batch), or None "
                f"for no heartbeat; got {heartbeat_s}"
            )
        self.heartbeat_s = heartbeat_s
        zmq, self._encoder = _wire_modules()
        self.block_size = block_size
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._block_hash: Callable[[bytes], BlockHash | None] = block_hash or bytes
        self._clock = clock
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_batches)
        # Held while a sequence is taken and its batch queued, so the queue is in sequence order.
        self._sequence_lock = threading.Lock()
        self._next_sequence = first_sequence()  # the sequence the next batch takes
        self._heartbeats = 0
        self._last_sent = time.monotonic()  # the thread's: when it last sent on the PUB socket
        self._held: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_batches)
        self._closed = False
        self._on_close: set[Callable[[], None]] = set()  # wakes each ``publish_stream``
        self._state_lock = threading.Lock()  # ``_closed`` and ``_on_close``
        self._published = self._dropped = self._unmapped = 0
        self._replays = self._bad_requests = 0
        self._left = self._failed = 0  # the thread's: batches it dropped at close, or failed
        self._full_states = self._full_states_unavailable = 0
        # Set while a ``publish_stream`` runs: wakes it to take a snapshot for ``_wanting``.
        self._full_state_source: Callable[[], None] | None = None
        self._wanting: list[bytes] = []  # requesters of a full state, waiting for the snapshot
        self._log = BurstLogger(_logger)
        # Held while a thread uses the sockets: the publisher's, or close taking them over.
        self._sockets_lock = threading.Lock()
        self._sockets_open = True
        context = zmq.Context.instance()
        self._pub = _bound(context.socket(zmq.PUB), endpoint, hwm, zmq.SNDHWM)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            # ZMQ learns what a peer read only every half high-water mark, so twice the replay
            # (and its end marker) always fits a requester that reads.
            replay_hwm = 2 * (replay_batches + 1)
            self._replay = _bound(
                context.socket(zmq.ROUTER), replay_endpoint, replay_hwm, zmq.SNDHWM
            )
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._zmq = zmq
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------

    def publish(self, events: Sequence[TierEvent]) -> bool:
        """Queue one batch; False when it was dropped (the thread is ``queue_batches`` behind).
        Never blocks."""
        if self._closed:
            raise LifecycleError("publish on a closed KVEventPublisher")
        if not events:
            return True
        with self._sequence_lock:
            sequence = self._next_sequence
            self._next_sequence += 1
            try:
                self._queue.put_nowait((sequence, list(events)))
            except queue.Full:  # its sequence stays taken: subscribers see the gap
                self._dropped += 1
                return False
        return True

    async def publish_stream(self, stream: EventStream, *, announce: bool = True) -> None:
        """Publish every batch of ``stream`` until it ends (closed) or this publisher closes;
        an idle stream does not hold it: closing the publisher from any thread ends it. The
        stream stays open (it is the caller's).

        ``announce``: publish the stream's full state (what its tiers hold: a node that
        restarted tells routers what it kept) as soon as its tiers know it (an S3 index that
        loads in the background has been read: ``EventStream.held_known``); live batches go
        out meanwhile. While it runs, full-state requests on the replay socket are answered
        from snapshots of the stream's tiers, also once they know. A stream of buffers alone
        (no tier that can say what it holds) has no full state: neither is done."""
        loop = asyncio.get_running_loop()
        wanted = asyncio.Event()
        with anyio.CancelScope() as scope:

            def stop() -> None:
                with contextlib.suppress(RuntimeError):  # that loop ended, and this call with it
                    loop.call_soon_threadsafe(scope.cancel)

            def want() -> None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(wanted.set)

            knows = stream.has_full_state
            with self._state_lock:
                if self._closed:
                    return
                self._on_close.add(stop)
                if knows:
                    self._full_state_source = want
            taking = anyio.Lock()  # held while a full state is made, until it is queued
            try:
                async with anyio.create_task_group() as tg:
                    if knows:
                        tg.start_soon(self._answer_full_states, stream, wanted, announce, taking)
                    async for batch in stream:
                        if taking.locked():  # it may hold events after the snapshot: state first
                            async with taking:
                                pass
                        self.publish(batch)
                    tg.cancel_scope.cancel()
            except LifecycleError:  # closed on another thread since the batch came
                return
            finally:
                with self._state_lock:
                    self._on_close.discard(stop)
                    if self._full_state_source is want:
                        self._full_state_source = None

    async def _answer_full_states(
        self, stream: EventStream, wanted: asyncio.Event, announce: bool, taking: anyio.Lock
    ) -> None:
        """Once the stream's tiers know what they hold (an S3 index loads in the background;
        live batches go out meanwhile), announce the full state; then one snapshot for every
        requester waiting when it is taken, each time one asks (those who asked during the
        load are answered after it)."""
        await stream.held_known()
        with contextlib.suppress(LifecycleError):  # closed meanwhile: nothing more to send
            if announce:
                await self._take_full_state(stream, taking, None)
            while True:
                await wanted.wait()
                wanted.clear()
                with self._state_lock:
                    requesters, self._wanting = self._wanting, []
                if requesters:
                    await self._take_full_state(stream, taking, tuple(requesters))

    async def _take_full_state(
        self, stream: EventStream, taking: anyio.Lock, to: tuple[bytes, ...] | None
    ) -> None:
        """Snapshot the tiers on the loop, make the batches in a worker thread (millions of
        keys never hold the loop), and queue them; ``taking`` holds the live batches back
        meanwhile, since those may say what happened after the snapshot."""
        async with taking:
            batches = await run_sync(stream.full_state_reader())
            self._queue_full_state(batches, to)

    def _queue_full_state(
        self, batches: list[list[TierEvent]], to: tuple[bytes, ...] | None
    ) -> None:
        """Queue a snapshot taken just now: announced (``to`` None: its batches take the next
        sequences) or answered (framed with the next sequence, which it takes nothing of)."""
        if self._closed:
            raise LifecycleError("publish on a closed KVEventPublisher")
        with self._sequence_lock:
            sequence = self._next_sequence
            if to is None:
                self._next_sequence += len(batches)
            try:
                self._queue.put_nowait(_FullState(batches, to, sequence))
            except queue.Full:  # subscribers see the gap; requesters hear nothing and ask again
                self._dropped += 1

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(
            self._published,
            self._dropped + self._left,
            self._unmapped,
            self._replays,
            self._bad_requests,
            self._failed,
            self._full_states,
            self._full_states_unavailable,
            self._heartbeats,
        )

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets: the endpoints are free
        when it returns. It waits two seconds at most for the thread, then closes the sockets
        itself and the thread drops what is left (``aclose`` waits in a worker thread instead
        of the loop)."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            waiting, self._on_close = self._on_close, set()
        for stop in waiting:
            stop()
        with contextlib.suppress(queue.Full):  # a full queue: the thread is busy, not waiting
            self._queue.put_nowait(_STOP)  # behind the batches already queued: sent first
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_CLOSE_S)
        self._close_sockets()  # the thread's already, unless it was held past the bound

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        s = self.statistics()
        state = "closed" if self._closed else "open"
        return (
            f"<KVEventPublisher {self.endpoint} {state} published={s.published} "
            f"dropped={s.dropped} replays={s.replays}>"
        )

    # -- the thread's side ---------------------------------------------------------------------

    def _run(self) -> None:
        """Send queued batches in order and answer replay requests between them; once closed,
        send what is still queued and end (or end at once if close took the sockets)."""
        try:
            while True:
                with self._sockets_lock:
                    if not self._sockets_open:
                        break
                    if self._replay is not None:
                        self._serve_replays()
                try:
                    batch = self._queue.get(block=not self._closed, timeout=_IDLE_POLL_S)
                except queue.Empty:
                    if self._closed:
                        break
                    self._heartbeat()
                    continue
                if batch is _STOP:
                    break
                try:
                    if isinstance(batch, _FullState):
                        self._send_full_state(batch)
                    else:
                        assert isinstance(batch, tuple)
                        self._send(*batch)
                except Exception as exc:  # one bad batch never ends the thread
                    self._failed += 1
                    self._log.warning(
                        "batch", "dropped an event batch that cannot be encoded or sent: %s", exc
                    )
        finally:
            self._close_sockets()
            while True:  # queued behind the end: nobody will send them
                try:
                    left = self._queue.get_nowait()
                except queue.Empty:
                    break
                if left is not _STOP:
                    self._left += 1

    def _encode(self, batch: list[TierEvent]) -> bytes:
        """The payload of ``batch``: an empty batch when none of its events has anything to
        say (it keeps its sequence)."""
        events = []
        for event in batch:
            encoded, unmapped = encode_event(event, self.block_size, self._block_hash)
            self._unmapped += unmapped
            if encoded is not None:
                events.append(encoded)
        body: list[Any] = [self._clock(), events]
        if self._rank is not None:
            body.append(self._rank)
        return self._encoder(body)

    def _send(self, sequence: int, batch: list[TierEvent]) -> None:
        self._send_payload(sequence, self._encode(batch))

    def _send_payload(self, sequence: int, payload: bytes, *, heartbeat: bool = False) -> None:
        with self._sockets_lock:
            if not self._sockets_open:  # close took the sockets while this batch was encoded
                self._left += not heartbeat
                return
            self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            self._held.append((sequence, payload))
            self._last_sent = time.monotonic()
            if heartbeat:
                self._heartbeats += 1
            else:
                self._published += 1

    def _heartbeat(self) -> None:
        """Idle for ``heartbeat_s``: an empty batch with the next sequence. Taken only while
        the queue is empty (under the lock publishers queue under), so every batch before it
        has been sent or dropped: it never overtakes one."""
        if self.heartbeat_s is None or time.monotonic() - self._last_sent < self.heartbeat_s:
            return
        with self._sequence_lock:
            if not self._queue.empty():
                return
            sequence = self._next_sequence
            self._next_sequence += 1
        self._send_payload(sequence, self._encode([]), heartbeat=True)

    def _send_full_state(self, full_state: _FullState) -> None:
        """Announce it on the PUB socket, or send it to each requester, then the end marker.
        A requester that does not read loses the rest of it, and asks again."""
        if full_state.to is None:
            for offset, batch in enumerate(full_state.batches):
                self._send(full_state.sequence + offset, batch)
            self._full_states += 1
            return
        payloads = [self._encode(batch) for batch in full_state.batches]
        zmq = self._zmq
        with self._sockets_lock:
            if not self._sockets_open:
                return
            after = full_state.sequence.to_bytes(8, "big")  # the state of every batch before it
            for requester in full_state.to:
                try:
                    for payload in payloads:
                        frames = (requester, b"", self._topic, after, payload)
                        self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
                    self._replay.send_multipart(
                        (requester, b"", b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK
                    )
                except zmq.Again:
                    continue
                self._full_states += 1

    def _serve_replays(self) -> None:
        zmq = self._zmq
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) == 3 and frames[2] == FULL_STATE_REQUEST:
                self._want_full_state(frames[0])
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                self._bad_requests += 1
                continue
            requester, delimiter, first = frames
            start = int.from_bytes(first, "big")
            self._replays += 1  # counted before its end marker goes out: seen once it came
            try:
                for sequence, payload in list(self._held):
                    if sequence >= start:
                        message = (
                            requester,
                            delimiter,
                            self._topic,
                            sequence.to_bytes(8, "big"),
                            payload,
                        )
                        self._replay.send_multipart(message, flags=zmq.NOBLOCK)
                self._replay.send_multipart(
                    (requester, delimiter, b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK
                )
            except zmq.Again:  # the requester does not read: the rest of its replay is dropped
                pass

    def _want_full_state(self, requester: bytes) -> None:
        """Ask the running ``publish_stream`` for a snapshot; without one, end at once."""
        with self._state_lock:
            source = self._full_state_source
            if source is not None:
                self._wanting.append(requester)
        if source is not None:
            source()
            return
        self._full_states_unavailable += 1
        with contextlib.suppress(self._zmq.Again):
            self._replay.send_multipart(
                (requester, b"", b"", END_OF_REPLAY, b""), flags=self._zmq.NOBLOCK
            )

    def _close_sockets(self) -> None:
        """Unbind and close both sockets (once), from the thread or from ``close``."""
        with self._sockets_lock:
            if not self._sockets_open:
                return
            self._sockets_open = False
            _unbind(self._zmq, self._pub, self.endpoint)
            if self._replay is not None:
                assert self.replay_endpoint is not None
                _unbind(self._zmq, self._replay, self.replay_endpoint)


def first_sequence() -> int:
    """The number of a new publisher's first batch: the microseconds since the epoch (module
    doc), so a restarted node's numbers continue above its previous life's."""
    return time.time_ns() // 1000


def _check_settings(block_size: int, replay_batches: int, hwm: int, queue_batches: int) -> None:
    if block_size < 1:
        raise InvalidArgumentError(
            f"block_size must be the tokens per block (1 or more), got {block_size}"
        )
    for name, value in (
        ("replay_batches", replay_batches),
        ("hwm", hwm),
        ("queue_batches", queue_batches),
    ):
        if value < 1:
            raise InvalidArgumentError(f"{name} must be 1 or more, got {value}")


def _wire_modules() -> tuple[Any, Callable[[Any], bytes]]:
    """pyzmq and msgspec's msgpack encoder, or the error that names the extra."""
    try:
        import zmq
    except ImportError as exc:
        raise ExtraNotInstalledError("KVEventPublisher", "events", "pyzmq") from exc
    try:
        import msgspec
    except ImportError as exc:
        raise ExtraNotInstalledError("KVEventPublisher", "events", "msgspec") from exc
    return zmq, msgspec.msgpack.Encoder().encode


def _unbind(zmq: Any, socket: Any, endpoint: str) -> None:
    """Close ``socket``, with ``endpoint`` free again on return: ZMQ closes a listener on its
    I/O thread after ``close`` returns, so this waits for the listener's closed event
    (``_UNBIND_S`` at most; an ``inproc`` endpoint has no listener).

    Closed with a short linger, never unbound first nor closed with none: libzmq (4.3.5)
    aborts the whole process when a connection's session is torn down at once while the
    peer's disconnect is being handled with a multipart message still queued for it (an
    ``errno_assert`` as it empties the pipe: a router that went away just before this node
    closed). The linger lets the disconnect finish first; what is still queued after it is
    dropped."""
    if endpoint.startswith("inproc://"):
        socket.close(linger=0)
        return
    monitor = socket.get_monitor_socket(zmq.EVENT_CLOSED)
    try:
        socket.close(linger=_CLOSE_LINGER_MS)
        monitor.poll(_UNBIND_S * 1000)
    finally:
        monitor.close(linger=0)


def _bound(socket: Any, endpoint: str, hwm: int, option: int) -> Any:
    """``socket`` with its send high-water mark set, bound to ``endpoint``."""
    socket.setsockopt(option, hwm)
    try:
        socket.bind(endpoint)
    except Exception as exc:
        socket.close(linger=0)
        raise InvalidArgumentError(
            f"cannot bind the event socket to {endpoint!r} ({exc}); give a free "
            "'tcp://HOST:PORT' (port 0: any free port), 'ipc://PATH' or 'inproc://NAME'"
        ) from exc
    return socket
