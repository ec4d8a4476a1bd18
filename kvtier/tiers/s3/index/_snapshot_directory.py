"""A snapshot body's directory: which chunk holds which keys (format, no I/O).

A body of millions of keys takes seconds to stream in, and a key near its end would wait for
all of it. A writer therefore sorts the body by key and writes, beside it, a small object
naming each chunk's byte range and the first and last key it holds
(``directory_name``): a node still streaming the body finds the chunk of a key it is asked
about and fetches that chunk alone with one ranged GET (``_snapshot_sections``). Sorting
changes nothing for a reader without the directory (an older kvtier): the body's format is
the same, its entries in another order.

Layout: ``MAGIC, u32 count, the body's xxh3-128``, then per chunk ``u64 offset, u32
length, u8 n, first key (n bytes), u8 m, last key (m bytes)``, then the xxh3-64 of all
before. What the bucket holds is untrusted: a directory is used only if it names the body
its reader's manifest names (the digest), if its chunks tile that body exactly, from the
first byte after the body's magic to its end, and if their key ranges are sorted and
disjoint; and a chunk fetched through it is used only if it decodes and verifies as a chunk
of the body does and holds only keys within the range the directory gave it
(``check_chunk``). A forged directory can cost a GET and a wait for the stream, never a
wrong answer: every entry it brings is one the body holds.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

import xxhash

from kvtier.common._format import IntegrityKey
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3.index._snapshot_format import (
    BODY_MAGIC,
    Manifest,
    SnapshotError,
    body_digest,
    encode_chunks,
)

__all__ = [
    "MAX_DIRECTORY_BYTES",
    "SORTED_CHUNK_ENTRIES",
    "Directory",
    "check_chunk",
    "decode_directory",
    "encode_sorted_body",
]

MAGIC = b"KVD1"
_HEAD = struct.Struct("<4sI16s")
_SPAN = struct.Struct("<QI")
_SUM = struct.Struct("<Q")
# Entries per chunk of a sorted body: a chunk fetched for one key is a few hundred KiB even
# when every key names a pack, and decodes in milliseconds.
SORTED_CHUNK_ENTRIES = 4096
# The largest directory a reader reads: about 80,000 chunks of 16-byte keys, 3x10^8 keys.
MAX_DIRECTORY_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Directory:
    """A body's chunks in order: byte ranges and the key range each holds."""

    offsets: list[int]
    lengths: list[int]
    firsts: list[bytes]
    lasts: list[bytes]

    def __len__(self) -> int:
        return len(self.offsets)

    def chunk_of(self, key: bytes) -> int:
        """The chunk whose key range holds ``key``; -1 if none does (not in the body)."""
        i = bisect.bisect_right(self.firsts, key) - 1
        return i if i >= 0 and key <= self.lasts[i] else -1


def encode_sorted_body(
    entries: list[tuple[bytes, Location | None]],
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
) -> tuple[bytes, bytes]:
    """A body of ``entries`` sorted by key, in chunks of ``SORTED_CHUNK_ENTRIES``, and its
    directory. ``entries`` holds each key once (an index's)."""
    entries = sorted(entries, key=lambda entry: entry[0])
    chunks = encode_chunks(
        entries, prefix, integrity_key=integrity_key, per_chunk=SORTED_CHUNK_ENTRIES
    )
    body = b"".join([BODY_MAGIC, *(chunk for _, chunk in chunks)])
    parts = [_HEAD.pack(MAGIC, len(chunks), body_digest(body))]
    at = len(BODY_MAGIC)
    ends = [start for start, _ in chunks[1:]] + [len(entries)] * bool(chunks)
    for (start, chunk), end in zip(chunks, ends, strict=True):
        first, last = entries[start][0], entries[end - 1][0]
        parts.append(_SPAN.pack(at, len(chunk)))
        parts.append(bytes([len(first)]) + first + bytes([len(last)]) + last)
        at += len(chunk)
    table = b"".join(parts)
    return body, table + _SUM.pack(xxhash.xxh3_64_intdigest(table))


def decode_directory(data: bytes, manifest: Manifest) -> Directory:
    """The directory in ``data`` of the body ``manifest`` names; ``SnapshotError`` for
    anything else (see the module docstring)."""
    if not _HEAD.size + _SUM.size <= len(data) <= MAX_DIRECTORY_BYTES:
        raise SnapshotError(f"snapshot directory of {len(data)} bytes")
    table, (digest,) = data[: -_SUM.size], _SUM.unpack_from(data, len(data) - _SUM.size)
    if xxhash.xxh3_64_intdigest(table) != digest:
        raise SnapshotError("snapshot directory checksum mismatch")
    magic, count, body = _HEAD.unpack_from(table)
    if magic != MAGIC:
        raise SnapshotError("not a kvtier snapshot directory")
    if body != manifest.digest:
        raise SnapshotError("snapshot directory of another body")
    out = Directory([], [], [], [])
    at, expected = _HEAD.size, len(BODY_MAGIC)
    for _ in range(count):
        if at + _SPAN.size > len(table):
            raise SnapshotError("snapshot directory truncated")
        offset, length = _SPAN.unpack_from(table, at)
        at += _SPAN.size
        first, at = _key(table, at)
        last, at = _key(table, at)
        if offset != expected or length <= 0 or first > last:
            raise SnapshotError("snapshot directory chunks do not tile the body")
        if out.lasts and first <= out.lasts[-1]:
            raise SnapshotError("snapshot directory key ranges are not sorted")
        out.offsets.append(offset)
        out.lengths.append(length)
        out.firsts.append(first)
        out.lasts.append(last)
        expected = offset + length
    if at != len(table):
        raise SnapshotError("snapshot directory has trailing bytes")
    if expected != manifest.body_length:
        raise SnapshotError("snapshot directory chunks do not tile the body")
    return out


def _key(table: bytes, at: int) -> tuple[bytes, int]:
    if at >= len(table) or not 1 <= table[at] <= len(table) - at - 1:
        raise SnapshotError("snapshot directory truncated")
    end = at + 1 + table[at]
    return table[at + 1 : end], end


def check_chunk(
    entries: list[tuple[bytes, Location | None]], directory: Directory, chunk: int
) -> None:
    """``SnapshotError`` unless every entry of a chunk fetched through ``directory`` lies
    within the key range it gave ``chunk`` (a chunk read from elsewhere in the body, or
    from another body, is not used)."""
    first, last = directory.firsts[chunk], directory.lasts[chunk]
    if any(not first <= key <= last for key, _ in entries):
        raise SnapshotError("snapshot chunk holds keys outside its directory range")
