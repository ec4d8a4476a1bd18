"""Tier events as an async iterator, for an engine that embeds kvtier without vLLM.

``EventStream`` takes the events of one or more ``EventBuffer`` (a tier's ``events``; a
manager gives all of its tiers') and yields them in batches: each step waits until at least
one event is queued, then drains every buffer, so a burst of stores is one batch rather than
one wakeup per block. Within a buffer the order is the order the events happened; across
buffers a batch lists them buffer by buffer.

The stream is the buffers' one consumer (``EventBuffer`` explains why there is only one): it
registers itself as their listener when created and lets go when closed, of the buffers it still
listens to only: a newer stream that took a buffer over keeps it. An emitter on another thread
wakes the loop through ``call_soon_threadsafe``, and only when the stream is waiting, so a store
pays nothing for a stream that is busy or gone. Waking a loop that has since closed does
nothing: nobody waits on it any more.

Nothing is lost between batches: events queued while the consumer handles a batch wait in the
buffers, which stay bounded (past their capacity the newest are dropped and counted there).

``full_state()`` is what the stream's tiers hold now, as batches a router takes as a reset
(``_full_state``): the tiers that can say what they hold (``held_keys``: ``FSTier``,
``S3Tier``) are in it; a buffer given on its own has no tier to ask and is left out.
``held_known()`` waits until the tiers that load what they hold in the background (an S3
index) have read it, so a full state taken after it is whole.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Protocol, Self

from anyio.abc import AsyncResource

from kvtier.common._events import EventBuffer, TierEvent
from kvtier.integrations._full_state import (
    FULL_STATE_CHUNK_KEYS,
    HoldsBlocks,
    LoadsInBackground,
    full_state,
    full_state_reader,
)

__all__ = ["EventStream"]

# Held while a stream takes or lets go of a buffer, so a stream closing on one thread never
# detaches a newer stream that another thread is registering on the same buffer.
_listening = threading.Lock()


class HasEvents(Protocol):
    """Anything that reports events in a buffer: ``FSTier``, ``S3Tier``, a custom tier."""

    @property
    def events(self) -> EventBuffer: ...


class EventStream(AsyncResource):
    """An async iterator of batches (``list[TierEvent]``) from the given buffers or tiers.

    ``async for batch in EventStream(fs_tier, s3_tier): ...`` ends once ``close()`` is called
    (or the ``async with`` block is left); a batch is never empty.
    """

    def __init__(self, *sources: EventBuffer | HasEvents) -> None:
        buffers = list(_buffers(sources))
        if not buffers:
            raise ValueError("EventStream needs at least one EventBuffer or tier with .events")
        for buffer in buffers:
            if not buffer.enabled:
                raise ValueError(
                    f"the event buffer of {buffer.tier!r} has capacity 0 (off); give it a "
                    "capacity to stream its events"
                )
        self._buffers = tuple(buffers)
        self._holders = tuple(_holders(sources))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._waiting = False  # set only while __anext__ waits: emitters wake it then
        self._closed = False
        self.batches = 0  # batches handed out
        self.events = 0  # events in them
        with _listening:
            for buffer in self._buffers:
                buffer.listen(self._queued)

    @classmethod
    def from_tiers(cls, tiers: Iterable[object]) -> EventStream:
        """The events of every tier in ``tiers`` that reports them (``manager.tiers``: FS and
        S3 do, a ``MemoryTier`` does not)."""
        reporting = [t for t in tiers if isinstance(getattr(t, "events", None), EventBuffer)]
        if not reporting:
            raise ValueError("none of these tiers reports events (no .events EventBuffer)")
        return cls(*reporting)  # type: ignore[arg-type]  # each has .events, as checked

    @property
    def has_full_state(self) -> bool:
        """Whether any of the stream's tiers can say what it holds: without one, a full state
        would claim the node holds nothing."""
        return bool(self._holders)

    async def held_known(self) -> None:
        """Until every tier of the stream that loads what it holds in the background
        (``LoadsInBackground``: an S3 tier's index) has ended that load: a full state taken
        before would leave out what it had not read yet."""
        for holder in self._holders:
            if isinstance(holder, LoadsInBackground):
                await holder.wait_index_loaded()

    def full_state(self, chunk_keys: int = FULL_STATE_CHUNK_KEYS) -> list[list[TierEvent]]:
        """What the stream's tiers hold now, as batches a router takes as a reset (the module
        doc): call it on the loop that runs the tiers."""
        return full_state(self._holders, chunk_keys)

    def full_state_reader(
        self, chunk_keys: int = FULL_STATE_CHUNK_KEYS
    ) -> Callable[[], list[list[TierEvent]]]:
        """``full_state`` as the tiers are now (taken on their loop), to make in a worker
        thread: a publisher holds its live batches back until it has queued the state."""
        return full_state_reader(self._holders, chunk_keys)

    def _queued(self) -> None:
        """An event was queued (on any thread): wake the waiting consumer, if it waits."""
        if not self._waiting:
            return
        self._waiting = False
        self._wake()

    def _wake(self) -> None:
        """Set the consumer's wakeup from any thread, even after the consumer's loop ended."""
        if (loop := self._loop) is None or (wakeup := self._wakeup) is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                wakeup.set()
            else:
                loop.call_soon_threadsafe(wakeup.set)
        except RuntimeError:  # the loop closed: nobody waits on it any more
            pass

    def _take(self) -> list[TierEvent]:
        batch: list[TierEvent] = []
        for buffer in self._buffers:
            batch.extend(buffer.drain())
        return batch

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> list[TierEvent]:
        while not self._closed:
            if batch := self._take():
                self.batches += 1
                self.events += len(batch)
                return batch
            if self._wakeup is None:
                self._loop = asyncio.get_running_loop()
                self._wakeup = asyncio.Event()
            self._wakeup.clear()
            self._waiting = True
            # An event queued between the drain above and the flag: take it now.
            if any(len(buffer) for buffer in self._buffers):
                self._waiting = False
                continue
            try:
                await self._wakeup.wait()
            finally:
                self._waiting = False
        raise StopAsyncIteration

    def close(self) -> None:
        """End the iteration (a waiting ``__anext__`` returns) and let go of the buffers this
        stream still listens to. Safe from any thread, also after the consumer's loop ended."""
        if self._closed:
            return
        self._closed = True
        with _listening:
            for buffer in self._buffers:
                buffer.unlisten(self._queued)  # a newer stream's stays
        self._wake()

    async def aclose(self) -> None:
        """``close()``, for ``async with`` and callers that close resources by awaiting."""
        self.close()

    async def __aenter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        tiers = ", ".join(repr(buffer.tier) for buffer in self._buffers)
        state = "closed" if self._closed else "open"
        return f"<EventStream [{tiers}] {state} batches={self.batches} events={self.events}>"


def _holders(sources: Iterable[object]) -> Iterable[HoldsBlocks]:
    """The tiers among ``sources`` that can say what they hold (``HoldsBlocks``)."""
    for source in sources:
        buffer = getattr(source, "events", None)
        if isinstance(buffer, EventBuffer) and callable(getattr(source, "held_keys_reader", None)):
            yield source  # type: ignore[misc]  # checked just above, as HoldsBlocks says


def _buffers(sources: Iterable[EventBuffer | HasEvents]) -> Iterable[EventBuffer]:
    for source in sources:
        if isinstance(source, EventBuffer):
            yield source
            continue
        buffer = getattr(source, "events", None)
        if not isinstance(buffer, EventBuffer):
            raise TypeError(
                f"EventStream takes EventBuffers or tiers with an .events EventBuffer, "
                f"got {type(source).__name__}"
            )
        yield buffer
