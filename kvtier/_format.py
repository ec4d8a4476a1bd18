"""The block format at rest (design §4), shared by every tier that writes bytes.

A block is a fixed header followed by its payload. The header names the key it belongs to, so
a file or object renamed, truncated or swapped can never be served as another block, and
carries an xxh3-64 checksum of the payload (xxh3 runs at memory speed, far above disk and
network, so verifying every load costs little) plus a checksum of the header itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "BlockHeader",
    "HeaderError",
    "checksum",
    "decode_header",
    "encode_header",
    "header_size",
]

MAGIC = b"KVTB"
FORMAT_VERSION = 1
# magic, version, flags, key length, reserved, payload length, payload checksum
_FIXED = struct.Struct("<4sHHHHQQ")
_HEADER_SUM = struct.Struct("<Q")
MAX_KEY_BYTES = 255


class HeaderError(ValueError):
    """The bytes are not a valid block header; the caller maps it to a ``corrupt`` miss."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: bytes
    payload_length: int
    payload_checksum: int
    flags: int = 0

    @property
    def size(self) -> int:
        return header_size(len(self.key))


def header_size(key_length: int) -> int:
    return _FIXED.size + key_length + _HEADER_SUM.size


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: bytes, payload: bytes | bytearray | memoryview, flags: int = 0) -> bytes:
    """Header bytes for ``payload`` stored under ``key``."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1 to {MAX_KEY_BYTES} bytes")
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, flags, len(key), 0, memoryview(payload).nbytes, checksum(payload)
    )
    body = fixed + key
    return body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and check a header; raise ``HeaderError`` saying what is wrong."""
    view = memoryview(data)
    if view.nbytes < _FIXED.size:
        raise HeaderError(f"header truncated: {view.nbytes} bytes")
    magic, version, flags, key_len, _, length, payload_sum = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise HeaderError("bad magic: not a kvtier block")
    if version != FORMAT_VERSION:
        raise HeaderError(f"format version {version}, this kvtier reads {FORMAT_VERSION}")
    end = _FIXED.size + key_len
    if key_len == 0 or view.nbytes < end + _HEADER_SUM.size:
        raise HeaderError("header truncated")
    (stored_sum,) = _HEADER_SUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored_sum:
        raise HeaderError("header checksum mismatch")
    return BlockHeader(bytes(view[_FIXED.size : end]), length, payload_sum, flags)


def verify_block(
    expected_key: bytes, header: BlockHeader, payload: bytes | bytearray | memoryview
) -> None:
    """Raise ``HeaderError`` unless ``payload`` is the intact block of ``expected_key``."""
    if header.key != expected_key:
        raise HeaderError("block belongs to another key")
    if memoryview(payload).nbytes != header.payload_length:
        raise HeaderError(
            f"payload is {memoryview(payload).nbytes} bytes, header says {header.payload_length}"
        )
    if checksum(payload) != header.payload_checksum:
        raise HeaderError("payload checksum mismatch")
