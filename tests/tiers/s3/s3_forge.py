"""What someone who can write a shared bucket can put in an S3 tier's journal: segments built
by hand, byte by byte, from the documented format (``kvtier.tiers.s3.index._journal_format``), not
with kvtier's encoder, so a test plays a writer that kvtier's own code does not constrain."""

from __future__ import annotations

import struct
import time

import xxhash

__all__ = ["forged_removals", "forged_segment", "forged_segment_name"]


def forged_segment(entries: list[tuple[bytes, str, int, int]]) -> bytes:
    """An unsigned ``KVJ2`` segment of ``(key, object name, offset, length)`` entries (an
    empty name: the key's own block object), with a valid xxh3 digest."""
    parts = [b"KVJ2", struct.pack("<I", len(entries))]
    for key, name, offset, length in entries:
        raw = name.encode()
        parts.append(struct.pack("<H", len(key)) + key)
        parts.append(struct.pack("<H", len(raw)) + raw + struct.pack("<QQ", offset, length))
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def forged_removals(entries: list[tuple[bytes, int]]) -> bytes:
    """An unsigned ``KVR1`` removal segment of ``(key, why code)`` entries, with a valid xxh3
    digest (a code that means nothing included, if the test asks)."""
    parts = [b"KVR1", struct.pack("<I", len(entries))]
    parts += [struct.pack("<H", len(key)) + key + bytes((why,)) for key, why in entries]
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def forged_segment_name(prefix: str, seq: int = 1, writer: str = "f0f0f0f0f0f0f0f0") -> str:
    """A segment name stamped now, which every reader's next poll lists."""
    folder = f"{prefix}/_kvtier_journal/" if prefix else "_kvtier_journal/"
    return f"{folder}{int(time.time() * 1000):015d}-{writer}-{seq}"
