"""The write journal of the S3 tier: how one node tells the others which keys it wrote.

Every writer (one ``S3Tier`` instance) buffers the keys it stored and, every ``index_refresh``
seconds when there are any, publishes them as one small *segment* object:

    <prefix>/_kvtier_journal/<wall ms, 15 digits>-<writer id>-<sequence>

Names sort by time, so a reader lists only the recent ones (``StartAfter`` = the name of the
time ``lookback`` seconds ago) and fetches those it has not read yet. A segment is
``MAGIC, u32 count, count x (u16 length, key), xxh3-64 of all before``; when any key was
stored in a pack (``_s3_pack``), the magic is ``KVJ2`` and each key is followed by its pack's
name (``u16 length, name``; empty for a key stored as its own object) and the section's
``u64 offset, u64 length``. A segment that does not parse is ignored (logged by the caller),
never trusted.

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

from kvtier.tiers._s3_pack import Location

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
MAGIC_PACKS = b"KVJ2"  # each key also names its pack section (or none: its own object)
_WHERE = struct.Struct("<QQ")
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


def encode_segment(entries: list[tuple[bytes, Location | None]]) -> bytes:
    """A segment of ``(key, location)`` entries; version 1 (keys only) when no key is in a
    pack, so a writer that packs nothing stays readable by kvtier before packs."""
    packed = any(where is not None for _, where in entries)
    parts = [MAGIC_PACKS if packed else MAGIC, struct.pack("<I", len(entries))]
    for key, where in entries:
        parts.append(struct.pack("<H", len(key)))
        parts.append(key)
        if packed:
            name = where.pack.encode() if where is not None else b""
            offset, length = (where.offset, where.length) if where is not None else (0, 0)
            parts.append(struct.pack("<H", len(name)) + name + _WHERE.pack(offset, length))
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def decode_segment(data: bytes) -> list[tuple[bytes, Location | None]]:
    if len(data) < 16 or data[:4] not in (MAGIC, MAGIC_PACKS):
        raise SegmentError("not a kvtier journal segment")
    packed = data[:4] == MAGIC_PACKS
    body, (digest,) = data[:-8], struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise SegmentError("journal segment checksum mismatch")
    (count,) = struct.unpack_from("<I", body, 4)
    entries: list[tuple[bytes, Location | None]] = []
    offset = 8

    def take(n: int) -> bytes:
        nonlocal offset
        if offset + n > len(body):
            raise SegmentError("journal segment truncated")
        out = bytes(body[offset : offset + n])
        offset += n
        return out

    for _ in range(count):
        (length,) = struct.unpack("<H", take(2))
        key = take(length)
        where: Location | None = None
        if packed:
            (name_length,) = struct.unpack("<H", take(2))
            name = take(name_length).decode("utf-8", "replace")
            section_offset, section_length = _WHERE.unpack(take(_WHERE.size))
            if name:
                where = Location(name, section_offset, section_length)
        entries.append((key, where))
    if offset != len(body):
        raise SegmentError("journal segment has trailing bytes")
    return entries
