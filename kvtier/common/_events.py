"""What a tier tells the outside about the blocks it holds: stored, removed, cleared.

KV-aware routers learn which engine holds which prefix from these events (vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``). A tier reports:

- ``STORED`` once a block is durable (as its ``fsync`` setting makes it) and visible to a
  lookup: the file renamed into place, the object written;
- ``REMOVED`` when a block goes: evicted for capacity (reason ``"evicted"``), deleted because
  it failed verification (``"corrupt"``), found gone by a load (``"not_found"``), deleted on
  request (``"deleted"``);
- ``CLEARED`` when every block goes at once.

Each event carries the medium (``"STORAGE"`` for FS and S3), the locality (``"LOCAL"``; a
shared tier reports blocks it learnt from another node as ``"REMOTE"``), the tier's name, what
kind of store it is (``storage``: ``"disk"`` for FS, ``"object"`` for S3) and whether other
nodes reach the same blocks (``shared``: an S3 prefix, a folder opened with ``shared=True``).
A router prices a block by that (a disk block is worth less than one in memory) and keeps a
shared tier's blocks once, credited to every node that reaches the tier, instead of once per
node that happened to announce them. The buffer stamps both on every event it queues; the tier
sets them once (``EventBuffer(..., shared=, storage=)``).

``EventBuffer`` holds them until someone drains it. It is bounded: when nobody drains, the
newest events are dropped and counted (``dropped``), so memory never grows with the stream. A
buffer of capacity 0 is off: ``emit`` returns at once and counts nothing. ``emit`` and
``drain`` may be called from different threads (a tier's loop, an engine's scheduler). A buffer
has one consumer: whoever drains it (``EventStream``, vLLM's ``take_events``) takes the events
from every other.

``listen`` sets one callback run after an event is queued (on the emitting thread, outside
the lock), so a consumer can wait for events instead of polling.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["EventBuffer", "EventKind", "TierEvent"]


class EventKind(enum.Enum):
    """What happened to an event's blocks."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class TierEvent:
    """One change to what a tier holds: ``keys`` (kvtier keys; empty for ``CLEARED``)."""

    kind: EventKind
    keys: tuple[bytes, ...]
    tier: str
    medium: str = "STORAGE"
    locality: str = "LOCAL"
    reason: str | None = None  # why blocks were removed: evicted, corrupt, not_found, deleted
    # What the tier is, the same on all of its events: left out of ``==`` so an event compares
    # by what happened. ``shared``: other nodes reach the same blocks in this tier.
    shared: bool = field(default=False, compare=False)
    storage: str = field(default="", compare=False)  # "disk" (FS), "object" (S3); "" unknown


class EventBuffer:
    """A bounded, thread-safe queue of ``TierEvent`` (see the module doc)."""

    __slots__ = (
        *("_events", "_listener", "_lock", "_size", "capacity", "dropped", "emitted"),
        *("shared", "storage", "tier"),
    )

    def __init__(
        self, tier: str, capacity: int = 65_536, *, shared: bool = False, storage: str = ""
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be 0 (off) or more, got {capacity}")
        self.tier = tier
        self.shared = shared  # stamped on every event (see the module doc)
        self.storage = storage
        self.capacity = capacity  # in keys (a CLEARED event counts as one)
        self.dropped = 0  # events that did not fit
        self.emitted = 0  # events that did
        self._events: list[TierEvent] = []
        self._size = 0
        self._lock = threading.Lock()
        self._listener: Callable[[], None] | None = None

    def listen(self, callback: Callable[[], None] | None) -> None:
        """Run ``callback`` after every queued event (None: stop). It must not block: it runs
        in the emitter's thread, inside a tier's store or load."""
        self._listener = callback

    def unlisten(self, callback: Callable[[], None]) -> None:
        """Stop running ``callback`` if it is still the listener: a newer one stays."""
        with self._lock:
            if self._listener == callback:
                self._listener = None

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._events)

    def emit(
        self,
        kind: EventKind,
        keys: Iterable[bytes] = (),
        *,
        locality: str = "LOCAL",
        reason: str | None = None,
        medium: str = "STORAGE",
    ) -> None:
        """Queue one event, or drop and count it when the buffer is full (never blocks)."""
        if not self.capacity:
            return
        held = tuple(keys)
        if not held and kind is not EventKind.CLEARED:
            return
        size = max(1, len(held))
        with self._lock:
            if self._size + size > self.capacity:
                self.dropped += 1
                return
            self._size += size
            self.emitted += 1
            self._events.append(
                TierEvent(
                    kind, held, self.tier, medium, locality, reason, self.shared, self.storage
                )
            )
        if (listener := self._listener) is not None:
            listener()

    def drain(self) -> list[TierEvent]:
        """Every queued event, oldest first; the buffer is empty after."""
        with self._lock:
            events, self._events, self._size = self._events, [], 0
        return events

    def __repr__(self) -> str:
        return (
            f"<EventBuffer {self.tier!r} queued={len(self._events)} capacity={self.capacity} "
            f"dropped={self.dropped}>"
        )
