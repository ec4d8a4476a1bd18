"""The write journal of the S3 tier: how one node tells the others which keys it wrote.

Every writer (one ``S3Tier`` instance) buffers the keys it stored and, every ``index_refresh``
seconds when there are any, publishes them as one small *segment* object:

    <prefix>/_kvtier_journal/<wall ms, 15 digits>-<writer id>-<sequence>

Names sort by time, so a reader lists only the recent ones (``StartAfter`` = the name of the
time ``lookback`` seconds ago) and fetches those it has not read yet. A segment is
``MAGIC, u32 count, count x (u16 length, key), xxh3-64 of all before``; a segment that does not
parse is ignored (logged by the caller), never trusted.

Cost per refresh, per reader: one LIST request (one page while fewer than 1000 segments fall
within ``lookback``) plus one small GET per segment another node published since the last
refresh. Per writer: one small PUT per refresh interval in which it stored anything.

``lookback`` covers the time between a writer stamping a segment name and the segment
becoming listable (its PUT) plus the clock skew between nodes; segments older than twice
``lookback`` are deleted by their writer. This module is pure: names and bytes, no I/O.
"""

from __future__ import annotations

import os
import re
import struct

import xxhash

__all__ = [
    "JOURNAL_DIR",
    "SegmentError",
    "decode_segment",
    "encode_segment",
    "journal_prefix",
    "segment_name",
    "segment_time_ms",
    "segment_writer",
    "start_after",
    "writer_id",
]

JOURNAL_DIR = "_kvtier_journal"
MAGIC = b"KVJ1"
_NAME_RE = re.compile(r"(\d{15})-([0-9a-f]{16})-(\d+)$")


class SegmentError(ValueError):
    """A journal segment that does not parse."""


def writer_id() -> str:
    """A random id for one writer (process and tier instance), 16 hex digits."""
    return os.urandom(8).hex()


def journal_prefix(prefix: str) -> str:
    return f"{prefix}/{JOURNAL_DIR}/" if prefix else f"{JOURNAL_DIR}/"


def segment_name(prefix: str, wall_ms: int, writer: str, seq: int) -> str:
    return f"{journal_prefix(prefix)}{wall_ms:015d}-{writer}-{seq}"


def start_after(prefix: str, wall_ms: int) -> str:
    """The ``StartAfter`` that lists the segments stamped at or after ``wall_ms``."""
    return f"{journal_prefix(prefix)}{max(wall_ms, 0):015d}"


def segment_time_ms(name: str) -> int | None:
    """The wall time in a segment name, or None for a name that is not a segment."""
    match = _NAME_RE.search(name)
    return int(match.group(1)) if match else None


def segment_writer(name: str) -> str | None:
    match = _NAME_RE.search(name)
    return match.group(2) if match else None


def encode_segment(keys: list[bytes]) -> bytes:
    parts = [MAGIC, struct.pack("<I", len(keys))]
    for key in keys:
        parts.append(struct.pack("<H", len(key)))
        parts.append(key)
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def decode_segment(data: bytes) -> list[bytes]:
    if len(data) < 16 or data[:4] != MAGIC:
        raise SegmentError("not a kvtier journal segment")
    body, (digest,) = data[:-8], struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise SegmentError("journal segment checksum mismatch")
    (count,) = struct.unpack_from("<I", body, 4)
    keys: list[bytes] = []
    offset = 8
    for _ in range(count):
        if offset + 2 > len(body):
            raise SegmentError("journal segment truncated")
        (length,) = struct.unpack_from("<H", body, offset)
        offset += 2
        if offset + length > len(body):
            raise SegmentError("journal segment truncated")
        keys.append(bytes(body[offset : offset + length]))
        offset += length
    if offset != len(body):
        raise SegmentError("journal segment has trailing bytes")
    return keys
