"""Blocks as S3 objects: building a put body and reading a GET body into a block buffer.

The object is the block format of ``kvtier._format`` (header, then payload); the payload
checksum is also written to the object metadata. Reading streams the header into a small
buffer, checks it, then streams the payload straight into the destination: the only copy of
the block is the one out of the socket buffer. Every way an object can be wrong is reported
as a ``problem`` string (the tier turns it into a corrupt miss); a destination of the wrong
size for an intact block is the caller's error (``InvalidArgumentError``).
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

from kvtier._errors import InvalidArgumentError
from kvtier._format import (
    FORMAT_VERSION,
    MAGIC,
    HeaderError,
    checksum,
    decode_header,
    encode_header,
    header_size,
)

__all__ = ["META_CHECKSUM", "build_object", "is_newer_format", "read_block"]

META_CHECKSUM = "kvtier-checksum"
META_FORMAT = "kvtier-format"


def build_object(key: bytes, payload: memoryview) -> tuple[bytes, dict[str, str], str]:
    """The object body (header + payload, one copy of the block), its metadata and the
    base64 CRC32 of the body for ``x-amz-checksum-crc32``.

    One ``bytes``: aiohttp writes it to the socket as it is (a ``bytearray`` body was seen to
    stall the event loop while it was copied), and botocore can re-read it on its own
    retries. One pass of xxh3: the metadata takes it from the header. The CRC32 lets the
    server reject a body that did not arrive whole: SeaweedFS stores an *empty* object when
    a client disconnects before sending any byte of the body (a cancelled store), and
    rejects it when the checksum header is there. About a millisecond per MiB in all, so
    the tier runs this in a worker thread for large blocks.
    """
    header = encode_header(key, payload)
    body = b"".join((header, payload))
    digest = decode_header(header).payload_checksum
    metadata = {META_CHECKSUM: f"{digest:016x}", META_FORMAT: str(FORMAT_VERSION)}
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode("ascii")
    return body, metadata, crc


def is_newer_format(head: bytes | bytearray) -> bool:
    """A kvtier header of a format version newer than this kvtier reads."""
    return (
        len(head) >= 6
        and bytes(head[:4]) == MAGIC
        and struct.unpack_from("<H", head, 4)[0] > FORMAT_VERSION
    )


async def _read_into(body: Any, dst: memoryview) -> int:
    """Read from a streaming body until ``dst`` is full or the body ends; bytes read."""
    filled = 0
    while filled < dst.nbytes:
        n = await body.readinto(dst[filled:])
        if n == 0:
            break
        filled += n
    return filled


async def read_block(response: Any, key: bytes, dst: memoryview) -> tuple[str | None, bytearray]:
    """Stream a GetObject ``response`` into ``dst``; return (problem or None, header bytes)."""
    body = response["Body"]
    length = int(response.get("ContentLength", -1))
    head = bytearray(header_size(len(key)))
    got = await _read_into(body, memoryview(head))
    if got < len(head):
        return f"object is {got} bytes, shorter than a header", head
    try:
        header = decode_header(head)
    except HeaderError as exc:
        return str(exc), head
    if header.key != key:
        return "object holds the block of another key", head
    if header.payload_length != length - len(head):
        return f"object is {length} bytes, header says {len(head)} + {header.payload_length}", head
    meta = response.get("Metadata", {}).get(META_CHECKSUM)
    if meta is not None and meta != f"{header.payload_checksum:016x}":
        return "header checksum differs from the object metadata", head
    if header.payload_length != dst.nbytes:
        raise InvalidArgumentError(
            f"dst holds {dst.nbytes} bytes but block {key.hex()} is {header.payload_length} bytes"
        )
    got = await _read_into(body, dst)
    if got != dst.nbytes or checksum(dst) != header.payload_checksum:
        return "checksum mismatch", head
    return None, head
