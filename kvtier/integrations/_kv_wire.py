"""What kvtier's KV events are on the wire: vLLM's ``KVEventBatch`` messages and the replay's
framing, as ``kv_events`` sends them and ``kv_subscriber`` reads them.

The wire, as vLLM's ``ZmqEventPublisher`` speaks it (``vllm.distributed.kv_events``):

- each batch is one multipart message ``(topic, sequence, payload)``: the topic as UTF-8, the
  sequence as 8 bytes big-endian counting from 0, the payload msgpack of an array
  ``[timestamp, events]`` (``data_parallel_rank`` appended when set);
- an event is a map tagged ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``
  None, ``token_ids`` empty, ``block_size``, ``lora_id`` and ``lora_name`` None, ``medium``,
  ``locality``, ``ownership``: the tier's name), ``BlockRemoved`` (``block_hashes``, ``medium``,
  ``locality``, ``ownership``) or ``AllBlocksCleared``; stored and removed events also carry
  ``shared`` (other nodes reach the same blocks in that tier) and ``storage`` (``"disk"``,
  ``"object"``), two fields vLLM's decoder skips as it skips any field it does not know;
- replay: a subscriber that joined late sends the first sequence it wants (8 bytes big-endian)
  to the ROUTER socket at ``replay_endpoint`` (from a DEALER socket, after an empty delimiter
  frame) and receives every batch still held from that one on, as ``(topic, sequence,
  payload)`` after the delimiter, then ``("", -1 as 8 signed bytes, "")``.

Block hashes are kvtier's keys as bytes (vLLM accepts bytes or ints) unless ``block_hash``
maps them; a key it maps to None is left out (counted in ``unmapped``). What it returns is
checked before encoding: bytes, or an int msgpack carries (64 bits). A router computes the same
keys from a request's tokens with ``kvtier.block_keys``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._events import EventKind, TierEvent

__all__ = ["END_OF_REPLAY", "FULL_STATE_REQUEST", "BlockHash", "encode_event"]

# The sequence that ends a replay (vLLM's end marker: -1 as 8 signed big-endian bytes).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# What a subscriber sends to the replay socket, in place of a sequence, to get the full state.
FULL_STATE_REQUEST = b"kvtier-full-state"
_HASH_INTS = range(-(2**63), 2**64)  # the ints msgpack carries

BlockHash = bytes | int


def encode_event(
    event: TierEvent, block_size: int, block_hash: Callable[[bytes], BlockHash | None]
) -> tuple[dict[str, Any] | None, int]:
    """``event`` as vLLM's tagged event map, and how many of its keys had no hash (None when
    none had one: nothing to say). A hash msgpack cannot carry raises ``InvalidArgumentError``
    (a ``ValueError``) that says what ``block_hash`` should return instead."""
    if event.kind is EventKind.CLEARED:
        return {"type": "AllBlocksCleared"}, 0
    hashes = [_checked(h, key) for key in event.keys if (h := block_hash(key)) is not None]
    unmapped = len(event.keys) - len(hashes)
    if not hashes:
        return None, unmapped
    where = {
        "medium": event.medium,
        "locality": event.locality,
        "ownership": event.tier,
        "shared": event.shared,
        "storage": event.storage,
    }
    if event.kind is EventKind.REMOVED:
        return {"type": "BlockRemoved", "block_hashes": hashes, **where}, unmapped
    stored = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "lora_name": None,
    }
    return stored | where, unmapped


def _checked(block_hash: object, key: bytes) -> BlockHash:
    """``block_hash`` if msgpack carries it, else the error that says what to return."""
    if isinstance(block_hash, bytes):
        return block_hash
    if isinstance(block_hash, int):
        if block_hash in _HASH_INTS:
            return block_hash
        raise InvalidArgumentError(
            f"block_hash returned an int of {block_hash.bit_length()} bits for a {len(key)}-byte "
            "key, but msgpack carries ints of 64 bits at most: return bytes, or an int of 8 "
            "bytes (e.g. int.from_bytes(key[:8], 'big'))"
        )
    raise InvalidArgumentError(
        f"block_hash must return bytes or an int (or None to leave a key out), got "
        f"{type(block_hash).__name__}"
    )
