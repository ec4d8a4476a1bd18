"""A router's side of kvtier's events: follow one publisher and keep a view a router can trust.

``KVEventSubscriber`` reads one node's ``KVEventPublisher`` (vLLM's ``KVEventBatch`` over ZMQ)
and hands each batch, decoded and in sequence order, to a callback; a ``ResidencyView`` fed by
one subscriber per node is what the router believes each node holds::

    view = ResidencyView(nodes=len(endpoints))
    subscribers = [
        KVEventSubscriber(pub, replay_endpoint=replay, on_batch=functools.partial(view.apply, i))
        for i, (pub, replay) in enumerate(endpoints)
    ]
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
        for s in subscribers:
            tg.start_soon((await stack.enter_async_context(s)).run)
        ...  # view.tiers_holding(node, key)

What it repairs (``_sequence``), so that a view is wrong only while an event is in flight:

- **joining late, or a router restart**: it asks for the full state at once (on the replay
  socket, ``FULL_STATE_REQUEST``) and takes it as a reset;
- **lost messages** (a PUB socket drops past its high-water mark; the subscriber fell behind):
  a jump of the sequence is a gap: it asks for a replay from the first missing batch, and for
  the full state when the publisher no longer holds it;
- **a node that restarted**: its sequence starts again from 0 with its announced full state;
  a subscriber that missed that announcement asks for the full state.

Every request has a deadline (``request_timeout``): one that gets no end marker in time is
abandoned on a socket of its own (closed) and made again. Messages that are not a
``KVEventBatch`` are counted (``bad_messages``) and dropped. Without a ``replay_endpoint``
nothing can be repaired: gaps are counted and the view may stay wrong until the node resets.

Needs the ``events`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Self

from anyio.abc import AsyncResource

from kvtier.common._errors import ExtraNotInstalledError
from kvtier.integrations._kv_wire import END_OF_REPLAY, FULL_STATE_REQUEST
from kvtier.integrations._residency import (
    TIER_CLASSES,
    ResidencyView,
    WireEvent,
    decode_events,
    tier_class,
)
from kvtier.integrations._sequence import SequenceStatistics, SequenceTracker

__all__ = [
    "TIER_CLASSES",
    "KVEventSubscriber",
    "ResidencyView",
    "SequenceStatistics",
    "SequenceTracker",
    "WireEvent",
    "decode_events",
    "tier_class",
]

_RETRY_S = 0.2  # how long a failed repair waits before it asks again


class KVEventSubscriber(AsyncResource):
    """Follows one publisher; ``on_batch`` gets its batches in order (see the module doc)."""

    def __init__(
        self,
        endpoint: str,
        *,
        on_batch: Callable[[list[WireEvent]], None],
        replay_endpoint: str | None = None,
        topic: str = "",
        request_timeout: float = 2.0,
        max_held: int = 4096,
        rcvhwm: int = 100_000,
    ) -> None:
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self._zmq, self._zmq_asyncio, self._decode = _wire_modules()
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._on_batch = on_batch
        self._topic = topic.encode()
        self._timeout = request_timeout
        self.tracker = SequenceTracker(max_held)
        self.bad_messages = 0
        self.repairs_failed = 0  # requests that got no end marker in time
        self._context = self._zmq_asyncio.Context()
        self._sub = self._context.socket(self._zmq.SUB)
        self._sub.setsockopt(self._zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(self._zmq.LINGER, 0)
        self._sub.setsockopt(self._zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)
        self._wanted = asyncio.Event()
        self._wanted.set()  # a subscriber that joins asks for the full state first
        self._in_sync = asyncio.Event()  # set once the first reset is applied
        self._closed = False

    @property
    def statistics(self) -> SequenceStatistics:
        return self.tracker.stats

    async def run(self) -> None:
        """Read live batches and repair gaps until cancelled or closed."""
        async with asyncio.TaskGroup() as tg:
            repair = tg.create_task(self._repair()) if self.replay_endpoint else None
            await self._live()
            if repair is not None:  # closed: a repair in flight has nothing left to ask with
                repair.cancel()

    async def _live(self) -> None:
        while not self._closed:
            try:
                frames = await self._sub.recv_multipart()
            except self._zmq.ZMQError:
                if self._closed:  # close took the socket away under this read
                    return
                raise
            parsed = self._parse(frames)
            if parsed is not None:
                self._apply(self.tracker.live(*parsed))

    def _parse(self, frames: list[bytes]) -> tuple[int, list[WireEvent]] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_messages += 1
            return None
        try:
            return int.from_bytes(frames[1], "big"), decode_events(self._decode(frames[2]))
        except ValueError:  # msgspec's DecodeError is one
            self.bad_messages += 1
            return None

    async def wait_in_sync(self) -> None:
        """Until the view has taken this publisher's full state (or its restart's
        announcement) once: a router that routes before then routes on part of what the node
        holds. ``run`` must be running."""
        await self._in_sync.wait()

    def _apply(self, batches: list[list[WireEvent]]) -> None:
        for batch in batches:
            self._on_batch(batch)
        if self.tracker.in_sync:
            self._in_sync.set()
        if self.tracker.want is not None:
            self._wanted.set()

    async def _repair(self) -> None:
        while not self._closed:
            await self._wanted.wait()
            self._wanted.clear()
            want = self.tracker.asked()
            if want is None:
                continue
            ok = await self.ask(want)
            if not ok:
                self.repairs_failed += 1
                await asyncio.sleep(_RETRY_S)
            if self.tracker.want is not None:
                self._wanted.set()

    async def ask(self, want: str) -> bool:
        """Ask for a replay (``"replay"``, from the next sequence) or the full state
        (``"full"``) now, on a socket of its own, and apply the answer; whether it came whole
        before ``request_timeout``. ``run`` asks by itself; this is for a caller that wants
        a fresh state at once."""
        zmq = self._zmq
        start = self.tracker.next or 0
        request = FULL_STATE_REQUEST if want == "full" else start.to_bytes(8, "big")
        if self._closed:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            return await self._ask_on(dealer, want, request)
        except zmq.ZMQError:
            if self._closed:  # close took the socket away under this request
                return False
            raise
        finally:
            dealer.close(linger=0)

    async def _ask_on(self, dealer: Any, want: str, request: bytes) -> bool:
        """``ask`` on its own ``dealer``: send ``request``, apply the answer."""
        full: list[list[WireEvent]] = []
        after: int | None = None
        assert self.replay_endpoint is not None
        dealer.connect(self.replay_endpoint)
        await dealer.send_multipart((b"", request))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while (left := deadline - loop.time()) > 0:
            if not await dealer.poll(left * 1000):
                break
            frames = await dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END_OF_REPLAY:
                if want == "full":
                    if after is None:
                        return False  # the publisher has no tiers to ask now
                    self._apply(self.tracker.full_state(after, full))
                else:
                    self.tracker.replay_ended()
                return True
            parsed = self._parse(frames[1:])
            if parsed is None:
                continue
            if want == "full":
                after = parsed[0]
                full.append(parsed[1])
            else:
                self._apply(self.tracker.replayed(*parsed))
        return False

    def close(self) -> None:
        """Close the sockets; a running ``run`` ends at its next step (cancel it to end it
        at once)."""
        if self._closed:
            return
        self._closed = True
        self._wanted.set()  # a repair waiting for a gap looks again and sees the close
        self._context.destroy(linger=0)  # the SUB socket and any request's, at once

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        s = self.tracker.stats
        return (
            f"<KVEventSubscriber {self.endpoint} next={self.tracker.next} applied={s.applied} "
            f"missed={s.missed} resets={s.resets}>"
        )


def _wire_modules() -> tuple[Any, Any, Callable[[bytes], Any]]:
    """pyzmq (and its asyncio sockets) and msgspec's msgpack decoder, or the error that
    names the extra."""
    try:
        import zmq
        import zmq.asyncio
    except ImportError as exc:
        raise ExtraNotInstalledError("KVEventSubscriber", "events", "pyzmq") from exc
    try:
        import msgspec
    except ImportError as exc:
        raise ExtraNotInstalledError("KVEventSubscriber", "events", "msgspec") from exc
    return zmq, zmq.asyncio, msgspec.msgpack.Decoder().decode
