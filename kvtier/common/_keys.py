"""Content keys for KV blocks, chained through the prefix (docs/design.md, "Decisions worth
knowing").

A key must mean the same bytes on every process and machine that shares a tier, so it is a
cryptographic hash of explicit bytes (never Python's ``hash()``), and it starts with a scheme
version byte so that a future change of scheme can never alias keys written by this one.

The ``namespace`` should be a ``CacheIdentity`` (``kvtier.common._identity``): every key then
derives from everything that changes a block's bytes, and tiers given the same identity check that
their folder or prefix holds it. Bare bytes still work: the caller vouches that they name all
of it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvtier.common._arguments import positive_int
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import MAX_KEY_BYTES

__all__ = ["KEY_SCHEME_VERSION", "KEY_SIZE", "KeyNamespace", "block_keys", "check_key"]

KEY_SCHEME_VERSION = 1
KEY_SIZE = 16
_DIGEST_SIZE = KEY_SIZE - 1
_PERSON = b"kvtier.key.v1"
_LEN = struct.Struct("<Q")


def check_key(key: object, what: str = "key") -> bytes:
    """Return ``key`` if it is a usable key, else raise an error that says what is wrong."""
    if type(key) is not bytes:
        raise InvalidArgumentError(
            f"{what} must be bytes (from kvtier.block_keys), got {type(key).__name__}"
        )
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"{what} must be 1 to {MAX_KEY_BYTES} bytes long, got {len(key)} bytes"
        )
    return key


def _token_array(token_ids: Sequence[int] | Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    if hasattr(token_ids, "detach"):  # a torch tensor, possibly on a GPU
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"token_ids must be one-dimensional, got shape {arr.shape}; pass one sequence"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise InvalidArgumentError("token_ids must be non-negative")
    return arr.astype("<i8", copy=False)


@runtime_checkable
class KeyNamespace(Protocol):
    """What a cache identity (``kvtier.CacheIdentity``) gives ``block_keys``: the bytes every
    key derives from, and the block size its keys cover."""

    @property
    def namespace(self) -> bytes: ...

    @property
    def block_size(self) -> int: ...


def block_keys(
    token_ids: Sequence[int] | Any,
    block_size: int,
    *,
    namespace: bytes | KeyNamespace = b"",
    parent: bytes | None = None,
) -> list[bytes]:
    """Return one key per full block of ``token_ids``; a partial last block gets none.

    ``namespace`` must name everything that changes the KV bytes of the same tokens (model,
    dtype, layout, tensor-parallel shard): a ``CacheIdentity`` (whose ``block_size`` must be
    ``block_size``), or bytes you vouch for. ``parent`` continues a chain from an earlier key.
    """
    positive_int(block_size, "block_size")
    if isinstance(namespace, KeyNamespace):
        if namespace.block_size != block_size:
            raise InvalidArgumentError(
                f"block_size is {block_size} but the identity's is {namespace.block_size}: "
                "keys of one identity cover blocks of its block size"
            )
        namespace = namespace.namespace
    elif not isinstance(namespace, bytes):
        raise InvalidArgumentError(
            f"namespace must be bytes or a CacheIdentity, got {type(namespace).__name__}; "
            "encode strings first"
        )
    if parent is not None:
        check_key(parent, "parent")
    tokens = _token_array(token_ids)
    head = _LEN.pack(block_size) + _LEN.pack(len(namespace)) + namespace
    prev = parent if parent is not None else b""
    version = bytes([KEY_SCHEME_VERSION])
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=_PERSON)
        h.update(head)
        h.update(_LEN.pack(len(prev)))
        h.update(prev)
        h.update(tokens[start : start + block_size].tobytes())
        prev = version + h.digest()
        keys.append(prev)
    return keys
