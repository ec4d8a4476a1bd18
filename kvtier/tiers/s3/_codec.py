"""Blocks as S3 objects: building a put body and reading a GET body into a block buffer.

The object is the block format of ``kvtier.common._format`` (header, then payload); the payload
checksum is also written to the object metadata. Reading checks the header in the first
bytes of the body, then copies each chunk into the destination as it arrives, checking it
there (``verify_response_into``). Every way an object can be wrong is reported
as a ``problem`` string (the tier turns it into a corrupt miss); a destination of the wrong
size for an intact block is the caller's error (``InvalidArgumentError``).

With an ``integrity_key`` the header is signed on store (keyed BLAKE3), and a load checks the
MAC instead of the xxh3 checksum (one pass over the payload either way, as the FS tier does):
an unsigned object, or one signed with another key, is a problem like any other corruption.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import anyio.to_thread

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import (
    FLAG_BLAKE3,
    FLAG_MAC,
    FORMAT_VERSION,
    MAGIC,
    BlockHeader,
    HeaderError,
    IntegrityKey,
    PayloadCheck,
    decode_header,
    encode_header,
    header_size,
    verify_block,
)

__all__ = [
    "META_CHECKSUM",
    "META_FORMAT",
    "build_object",
    "is_newer_format",
    "is_signed",
    "verify_into",
    "verify_response_into",
]

META_CHECKSUM = "kvtier-checksum"
META_FORMAT = "kvtier-format"


def build_object(
    key: bytes, payload: memoryview, *, integrity_key: IntegrityKey | None = None
) -> tuple[bytes, dict[str, str], str]:
    """The object body (header + payload, one copy of the block), its metadata and the
    base64 CRC32 of the body for ``x-amz-checksum-crc32``.

    One ``bytes``: aiohttp writes it to the socket as it is (a ``bytearray`` body was seen to
    stall the event loop while it was copied), and botocore can re-read it on its own
    retries. One pass of xxh3: the metadata takes it from the header. The CRC32 lets the
    server reject a body that did not arrive whole: SeaweedFS stores an *empty* object when
    a client disconnects before sending any byte of the body (a cancelled store), and
    rejects it when the checksum header is there. About a millisecond per MiB in all, so
    the tier runs this in a worker thread for large blocks. With ``integrity_key`` the header
    is signed (one BLAKE3 pass more).
    """
    header = encode_header(key, payload, integrity_key=integrity_key)
    body = b"".join((header, payload))
    digest = decode_header(header, integrity_key=integrity_key).payload_checksum
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


def is_signed(head: bytes | bytearray) -> bool:
    """A kvtier header of this format with the signed flag (not checked: anyone can set it)."""
    return (
        len(head) >= 8
        and bytes(head[:4]) == MAGIC
        and struct.unpack_from("<H", head, 4)[0] == FORMAT_VERSION
        and struct.unpack_from("<H", head, 6)[0] & FLAG_MAC != 0
    )


def _check_header(
    head: bytes,
    key: bytes,
    length: int,
    dst: memoryview,
    meta_checksum: str | None,
    integrity_key: IntegrityKey | None,
) -> tuple[str | None, BlockHeader | None]:
    """Check the ``head`` of an object of ``length`` bytes meant for ``key``'s block in
    ``dst``: (problem, None) for an object that is wrong, (None, header) for one to read."""
    try:
        header = decode_header(head, integrity_key=integrity_key)
    except HeaderError as exc:
        return str(exc), None
    if header.key != key:
        return "object holds the block of another key", None
    if header.payload_length != length - len(head):
        return f"object is {length} bytes, header says {len(head)} + {header.payload_length}", None
    if meta_checksum is not None and meta_checksum != f"{header.payload_checksum:016x}":
        return "header checksum differs from the object metadata", None
    if header.payload_length != dst.nbytes:
        raise InvalidArgumentError(
            f"dst holds {dst.nbytes} bytes but block {key.hex()} is {header.payload_length} bytes"
        )
    return None, header


def verify_into(
    data: bytes | memoryview,
    key: bytes,
    dst: memoryview,
    meta_checksum: str | None,
    integrity_key: IntegrityKey | None = None,
) -> tuple[str | None, bytes]:
    """Check a whole object ``data`` and copy its payload into ``dst``; (problem or None,
    header bytes). A copy and an xxh3 pass (with ``integrity_key`` the MAC replaces the xxh3
    pass), so the tier runs it in a worker thread for large blocks."""
    size = header_size(len(key), integrity_key=integrity_key)
    head = bytes(data[:size])
    if len(head) < size:
        return f"object is {len(data)} bytes, shorter than a header", head
    problem, header = _check_header(head, key, len(data), dst, meta_checksum, integrity_key)
    if header is None:
        return problem, head
    dst[:] = memoryview(data)[len(head) :]
    try:  # over the copy, so what is checked is what the caller gets
        verify_block(key, header, dst, integrity_key=integrity_key)
    except HeaderError as exc:
        return str(exc), head
    return None, head


async def verify_response_into(
    response: Any,
    key: bytes,
    dst: memoryview,
    *,
    thread_bytes: int,
    integrity_key: IntegrityKey | None = None,
) -> tuple[str | None, bytes]:
    """Read a GetObject ``response`` and verify it into ``dst``; (problem or None, header).

    With aiohttp under aiobotocore (the usual case), the body's chunks are copied straight
    into ``dst`` as they arrive (``_stream_into``): one copy of the block, as many awaits as
    a raw ``read()`` makes, and no joined ``bytes`` of the whole object. Otherwise the body
    is read whole and copied (``verify_into``; in a worker thread over ``thread_bytes``).
    """
    body = response["Body"]
    meta = response.get("Metadata", {}).get(META_CHECKSUM)
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    length = response.get("ContentLength")
    streams = content is not None and callable(getattr(content, "readany", None))
    if streams and isinstance(length, int) and length >= 0:
        return await _stream_into(content, length, key, dst, meta, thread_bytes, integrity_key)
    data: bytes = await body.read()
    if len(data) > thread_bytes:
        return await anyio.to_thread.run_sync(verify_into, data, key, dst, meta, integrity_key)
    return verify_into(data, key, dst, meta, integrity_key)


async def _stream_into(
    content: Any,
    length: int,
    key: bytes,
    dst: memoryview,
    meta_checksum: str | None,
    thread_bytes: int,
    integrity_key: IntegrityKey | None,
) -> tuple[str | None, bytes]:
    """Copy the chunks of an aiohttp body (``content``, of ``length`` bytes by its
    Content-Length) into ``dst``, after checking the header in the first bytes.

    Each chunk is copied once, into ``dst``, and the xxh3 check runs over the piece of ``dst``
    just written (what is checked is what the caller gets), on the loop: no second copy and
    no worker-thread hop, so a load keeps up with a raw GET (``bench_s3.py``). A keyed BLAKE3
    MAC is checked the same way; the BLAKE2b MAC of an older signed block runs over ``dst``
    once it is full, in a worker thread above ``thread_bytes``. A body
    that ends early, runs past the header's length or disagrees with it is a problem."""
    size = header_size(len(key), integrity_key=integrity_key)
    first = await _first_bytes(content, size)
    if len(first) < size:
        return f"object is {len(first)} bytes, shorter than a header", first
    head = first[:size]
    problem, header = _check_header(head, key, length, dst, meta_checksum, integrity_key)
    if header is None:
        return problem, head
    try:
        check = PayloadCheck(key, header, integrity_key=integrity_key)
    except HeaderError as exc:
        return str(exc), head
    # xxh3, and a keyed BLAKE3 MAC, are cheap enough per chunk on the loop (tens of
    # microseconds); the BLAKE2b of older signed blocks runs over the whole payload at the end.
    streaming_check = integrity_key is None or bool(header.flags & FLAG_BLAKE3)
    total = dst.nbytes
    filled = 0
    piece: bytes | memoryview = memoryview(first)[size:]
    while True:
        n = len(piece)
        if n:
            if filled + n > total:
                return f"object runs past the {total} payload bytes its header names", head
            end = filled + n
            dst[filled:end] = piece
            if streaming_check:
                check.update(dst[filled:end])
            filled = end
        if filled == total:
            break
        piece = await content.readany()
        if not piece:
            return f"object ended after {size + filled} of {length} bytes", head
    if not streaming_check:
        if total + size > thread_bytes:
            return await anyio.to_thread.run_sync(_finish_check, check, dst, head)
        return _finish_check(check, dst, head)
    try:
        check.finish()
    except HeaderError as exc:
        return str(exc), head
    return None, head


async def _first_bytes(content: Any, size: int) -> bytes:
    """At least ``size`` bytes from the start of the body (fewer only if it ends first)."""
    first = b""
    while len(first) < size:
        chunk = await content.readany()
        if not chunk:
            break
        first += chunk
    return first


def _finish_check(check: PayloadCheck, dst: memoryview, head: bytes) -> tuple[str | None, bytes]:
    """The whole-payload check (a keyed MAC) over ``dst`` once it is full."""
    try:
        check.update(dst)
        check.finish()
    except HeaderError as exc:
        return str(exc), head
    return None, head
