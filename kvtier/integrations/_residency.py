"""What a router believes each node holds, built only from the nodes' events.

``ResidencyView`` is a synchronous state machine: subscribers hand it decoded events
(``WireEvent``) per node; a router asks it which tiers of a node hold a key. What it keeps:

- a node's own tiers (a private folder) per node and tier: removed there when that node says;
- a *shared* tier's blocks (an S3 prefix, a folder every node mounts) once, not per node:
  each key with the nodes that announced it (a bit per node). A node that can reach the tier
  (it announced anything of it) is credited with all of its blocks, whoever stored them, so
  a block that only the shared tier holds still draws requests to every node that can load
  it. A removal from a shared tier, by any node, removes the key for everyone (the object is
  gone); a node's reset (``AllBlocksCleared``, the start of its full state) takes only its own
  bit off, so a node that restarts never erases what the others vouch for.

Each tier's class (``tier_class``: ``gpu``, ``host``, ``disk``, ``shared_storage``,
``object_store``) comes from its events' ``medium``, ``storage`` and ``shared``; a router
prices a block by it.

What comes off the wire is untrusted: ``decode_events`` checks every field it uses and raises
``ValueError`` for anything else, which the subscriber counts and drops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TIER_CLASSES",
    "MalformedBatchError",
    "ResidencyView",
    "WireEvent",
    "decode_events",
    "tier_class",
]

BlockHash = bytes | int

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
TIER_CLASSES = ("gpu", "host", "disk", "shared_storage", "object_store")


class MalformedBatchError(ValueError):
    """A message that is not a ``KVEventBatch`` a router can use (untrusted input)."""


@dataclass(frozen=True, slots=True)
class WireEvent:
    """One event of a ``KVEventBatch`` as a router reads it."""

    type: str  # BlockStored, BlockRemoved, AllBlocksCleared
    hashes: tuple[BlockHash, ...] = ()
    tier: str = ""  # ``ownership``: the tier's name; "" for vLLM's own (GPU) events
    medium: str = ""
    shared: bool = False
    storage: str = ""


def tier_class(medium: str, storage: str, shared: bool) -> str:
    """The class a router prices a tier's blocks by (one of ``TIER_CLASSES``)."""
    if medium == "GPU":
        return "gpu"
    if medium == "CPU":
        return "host"
    if storage == "object":
        return "object_store"
    return "shared_storage" if shared else "disk"


def decode_events(body: Any) -> list[WireEvent]:
    """The events of a decoded ``KVEventBatch`` body (``[ts, events, ...]``); ``ValueError``
    (``MalformedBatchError``) when it is not one."""
    if not isinstance(body, list | tuple) or len(body) < 2 or not isinstance(body[1], list):
        raise MalformedBatchError("not a KVEventBatch: [timestamp, events, ...] expected")
    return [_event(event) for event in body[1]]


def _event(event: Any) -> WireEvent:
    if not isinstance(event, dict):
        raise MalformedBatchError("an event is not a map")
    kind = event.get("type")
    if kind == CLEARED:
        return WireEvent(CLEARED)
    if kind not in (STORED, REMOVED):
        raise MalformedBatchError(f"unknown event type {kind!r}")
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, bytes | int) for h in hashes):
        raise MalformedBatchError("block_hashes is not a list of block hashes")
    tier, medium = event.get("ownership") or "", event.get("medium") or ""
    shared, storage = event.get("shared", False), event.get("storage") or ""
    if not (isinstance(tier, str) and isinstance(medium, str) and isinstance(storage, str)):
        raise MalformedBatchError("ownership, medium and storage must be strings")
    if not isinstance(shared, bool):
        raise MalformedBatchError("shared must be a boolean")
    return WireEvent(kind, tuple(hashes), tier, medium, shared, storage)


class ResidencyView:
    """Per node and tier, the blocks the events announced (see the module doc)."""

    def __init__(self, nodes: int) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be 1 or more, got {nodes}")
        self.nodes = nodes
        self._private: list[dict[str, set[BlockHash]]] = [{} for _ in range(nodes)]
        self._shared: dict[str, dict[BlockHash, int]] = {}  # tier -> key -> nodes that vouch
        self._reach: dict[str, int] = {}  # shared tier -> nodes that reach it (bits)
        self.classes: dict[str, str] = {}  # tier -> its class
        self.resets = [0] * nodes

    # -- events ------------------------------------------------------------------------------

    def apply(self, node: int, events: Iterable[WireEvent]) -> None:
        """One batch of ``node``'s events, in order."""
        for event in events:
            if event.type == CLEARED:
                self.reset(node)
                continue
            self.classes[event.tier] = tier_class(event.medium, event.storage, event.shared)
            if event.shared:
                self._apply_shared(node, event)
                continue
            held = self._private[node].setdefault(event.tier, set())
            if event.type == STORED:
                held.update(event.hashes)
            else:
                held.difference_update(event.hashes)

    def _apply_shared(self, node: int, event: WireEvent) -> None:
        bit = 1 << node
        self._reach[event.tier] = self._reach.get(event.tier, 0) | bit
        held = self._shared.setdefault(event.tier, {})
        if event.type == STORED:
            for key in event.hashes:
                held[key] = held.get(key, 0) | bit
        else:
            for key in event.hashes:
                held.pop(key, None)

    def reset(self, node: int) -> None:
        """Forget what ``node`` announced: its own tiers, and its vouching for shared keys
        (a key nobody else vouches for goes). It still reaches the shared tiers it did."""
        self.resets[node] += 1
        self._private[node] = {}
        bit = 1 << node
        for held in self._shared.values():
            for key in [k for k, nodes in held.items() if nodes & bit]:
                if (left := held[key] & ~bit) == 0:
                    del held[key]
                else:
                    held[key] = left

    # -- questions ---------------------------------------------------------------------------

    def tiers_holding(self, node: int, key: BlockHash) -> list[str]:
        """The tiers ``node`` can load ``key`` from, as the events say."""
        found = [tier for tier, held in self._private[node].items() if key in held]
        bit = 1 << node
        found += [
            tier
            for tier, held in self._shared.items()
            if self._reach.get(tier, 0) & bit and key in held
        ]
        return found

    def believed(self, node: int, tier: str) -> set[BlockHash]:
        """What the view holds of ``node``'s private ``tier``."""
        return set(self._private[node].get(tier, ()))

    def shared(self, tier: str) -> set[BlockHash]:
        """What the view holds of shared ``tier`` (once, whoever announced it)."""
        return set(self._shared.get(tier, ()))

    def reaches(self, node: int, tier: str) -> bool:
        return bool(self._reach.get(tier, 0) & (1 << node))

    def __repr__(self) -> str:
        private = sum(len(h) for tiers in self._private for h in tiers.values())
        shared = sum(len(h) for h in self._shared.values())
        return f"<ResidencyView nodes={self.nodes} private={private} shared={shared}>"
