"""Adapters that plug kvtier's tiers into serving engines.

Each engine has its own module (``kvtier.integrations.vllm``), importable only with that
engine's extra installed; ``import kvtier`` never imports one. The engine-neutral part, a
kvtier tier driven from a synchronous engine thread, is ``kvtier.integrations.bridge._bridge``.

- ``_event_stream``: ``EventStream``, the tiers' events as an async iterator of batches, for
  routers and for ``kv_events``;
- ``kv_events``: ``KVEventPublisher``, those events as vLLM's KV events on a ZeroMQ socket,
  ``_kv_wire`` (what a message is: vLLM's batches, the replay's framing, the block hashes)
  and ``_full_state`` (what the tiers hold, as batches a router takes as a reset);
- ``kv_subscriber``: a router's side of those events, ``KVEventSubscriber`` (``_sequence``:
  gaps repaired by replay or full state) and ``ResidencyView`` (``_residency``: shared tiers
  kept once);
- ``vllm`` and ``_vllm_setup`` (the keys, identity and FS settings it derives for vLLM): the
  vLLM adapter;
- ``bridge``: the engine-neutral bridge.
"""

from __future__ import annotations

from kvtier.integrations._event_stream import EventStream

__all__ = ["EventStream"]
