"""What a set of tiers holds, as events a router can take as a reset: its *full state*.

A router that joins late, restarts, or lost messages it cannot replay has a view it cannot
trust; a node that restarts holds what its folder and bucket kept, which it never announced
in this life. Both are repaired by the same message: everything the node's tiers hold now,
after a ``CLEARED`` that tells the router to forget what it believed of this node. It is made
of ordinary events (vLLM's ``AllBlocksCleared`` then ``BlockStored``), so a router written for
vLLM engines reads it unchanged.

Bounded: the keys of a tier go out in ``STORED`` events of at most ``chunk_keys`` keys each,
one event per batch, so no message grows with the tier (a tier's own bounds, such as the FS
capacity and the S3 index's ``index_max_keys``, bound how many there are).

Taken on the event loop that changes the tiers, at once: it reflects every event emitted
before it. Events emitted before it that are still queued reach the router after it; they
change nothing, since the last event about a key before the snapshot agrees with it. Events
emitted after it must not reach the router before it (a removal, then a state that still
holds the key): ``full_state_reader`` takes the snapshot on the loop (each tier copies what it
holds, at memory speed) and makes the batches in a worker thread, so whoever publishes holds
its live batches back until the state is queued (``KVEventPublisher`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvtier.common._events import EventBuffer, EventKind, TierEvent

__all__ = [
    "FULL_STATE_CHUNK_KEYS",
    "HoldsBlocks",
    "LoadsInBackground",
    "full_state",
    "full_state_reader",
]

FULL_STATE_CHUNK_KEYS = 4096  # keys per STORED event of a full state: about 70 kB on the wire


class HoldsBlocks(Protocol):
    """A tier that can say what it holds (``FSTier``, ``S3Tier``), besides its events."""

    @property
    def events(self) -> EventBuffer: ...

    def held_keys(self) -> list[bytes]: ...

    def held_keys_reader(self) -> Callable[[], list[bytes]]: ...


@runtime_checkable
class LoadsInBackground(Protocol):
    """A tier that opens before it knows all it holds (``S3Tier``: its index loads in the
    background). A full state taken before the load ends would claim the node holds less than
    it does, and a router that takes it as a reset would forget blocks only this node vouches
    for: so the full state waits for the load (which ends, complete or not, within the tier's
    own bound)."""

    async def wait_index_loaded(self) -> bool: ...


def full_state(
    tiers: Iterable[HoldsBlocks], chunk_keys: int = FULL_STATE_CHUNK_KEYS
) -> list[list[TierEvent]]:
    """The batches of a full state: ``[CLEARED, first chunk]``, then one chunk per batch.

    ``CLEARED`` comes first even when the tiers hold nothing, so the router forgets what it
    believed of this node either way."""
    return full_state_reader(tiers, chunk_keys)()


def full_state_reader(
    tiers: Iterable[HoldsBlocks], chunk_keys: int = FULL_STATE_CHUNK_KEYS
) -> Callable[[], list[list[TierEvent]]]:
    """``full_state`` as the tiers are now, to make in a worker thread (the module doc)."""
    if chunk_keys < 1:
        raise ValueError(f"chunk_keys must be 1 or more, got {chunk_keys}")
    readers = [(tier.events, tier.held_keys_reader()) for tier in tiers]

    def make() -> list[list[TierEvent]]:
        name = ",".join(buffer.tier for buffer, _ in readers) or "*"
        events: list[TierEvent] = [TierEvent(EventKind.CLEARED, (), name)]
        for buffer, read in readers:
            keys = read()
            events.extend(
                _stored(buffer, keys[start : start + chunk_keys])
                for start in range(0, len(keys), chunk_keys)
            )
        if len(events) == 1:
            return [events]
        return [events[:2], *([event] for event in events[2:])]

    return make


def _stored(buffer: EventBuffer, keys: Sequence[bytes]) -> TierEvent:
    return TierEvent(
        EventKind.STORED,
        tuple(keys),
        buffer.tier,
        shared=buffer.shared,
        storage=buffer.storage,
    )
