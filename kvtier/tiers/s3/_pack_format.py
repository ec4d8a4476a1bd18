"""Pack objects of the S3 tier: several blocks in one object (names, table, no I/O).

Why: on an object store every request costs CPU on both ends (signing, HTTP, the server's
metadata lookup), and a small block can cost as much to fetch as to recompute; one GET of a
large object costs far less CPU than several GETs of its parts (docs/design.md). Stores that
reach the tier together (one request's new blocks, a batch of deferred writes) are therefore
written as one *pack*, and a node that needs those blocks later (the same request's prefix)
reads them with one ranged GET.

A pack is named ``<prefix>/_kvtier_packs/<2 hex>/<hex first key>-<writer>-<sequence>`` (unique
per writer, so it is never overwritten and needs no conditional put; the two hex digits are
the first key's last byte, which spreads packs over S3's key-name partitions) and holds:

    table:    MAGIC, u32 count, u32 table bytes,
              count x (u16 key length, key, u64 offset, u64 length), xxh3-64 of all before
    sections: count x one block object of ``_codec`` (header naming its key, payload)

Offsets count from the start of the object. The table comes first, so the listing at open
learns a pack's keys with one small ranged GET; each section carries its own header, so a
wrong offset can never serve another key's bytes. A single block stored alone is still a
plain block object (``<prefix>/<2 hex>/<hex key>``), which older kvtier versions read.
"""

from __future__ import annotations

import base64
import re
import struct
import zlib
from dataclasses import dataclass

import xxhash

from kvtier.common._format import MAX_KEY_BYTES
from kvtier.tiers.s3._config import MAX_PACK_BLOCKS
from kvtier.tiers.s3._names import under_prefix

__all__ = [
    "MAX_TABLE_BYTES",
    "PACK_DIR",
    "TABLE_PROBE_BYTES",
    "Location",
    "PackTableError",
    "decode_table",
    "encode_table",
    "is_pack_name",
    "pack_body",
    "pack_name",
    "table_length",
    "table_size",
]

PACK_DIR = "_kvtier_packs"
MAGIC = b"KVP1"
_HEAD = struct.Struct("<4sII")  # magic, count, table bytes
_ENTRY = struct.Struct("<QQ")  # offset, length
_SUM = struct.Struct("<Q")
# The first GET of a listed pack asks for this many bytes: a table of 16 entries with
# 16-byte keys is 12 + 16 x 34 + 8 = 564 bytes; longer tables cost a second GET.
TABLE_PROBE_BYTES = 4096
# What follows the pack folder in a pack's name: shard, first key, writer id, sequence.
_NAME_TAIL = re.compile(r"([0-9a-f]{2})/((?:[0-9a-f]{2}){1,255})-[0-9a-f]{16}-[0-9]{1,20}")


@dataclass(frozen=True, slots=True)
class Location:
    """Where a packed block lives: its pack's object name and the section's byte range."""

    pack: str
    offset: int
    length: int


class PackTableError(ValueError):
    """A pack table that does not parse (the pack is ignored, never trusted)."""


def _pack_dir(prefix: str) -> str:
    return under_prefix(prefix, f"{PACK_DIR}/")


def pack_name(prefix: str, first_key: bytes, writer: str, seq: int) -> str:
    hexkey = first_key.hex()
    return f"{_pack_dir(prefix)}{hexkey[-2:]}/{hexkey}-{writer}-{seq}"


def is_pack_name(name: str, prefix: str) -> bool:
    """Whether ``name`` is exactly the name of a pack of ``prefix`` (``pack_name``'s shape).

    A name read from the bucket (a journal entry) is untrusted: anything else (another
    prefix's object, the integrity marker, a name with ``..`` that an HTTP client or server
    may resolve elsewhere) is not one of this prefix's packs, so it is never read or deleted
    as one."""
    folder = _pack_dir(prefix)
    if not name.startswith(folder):
        return False
    match = _NAME_TAIL.fullmatch(name, len(folder))
    return match is not None and match.group(2).endswith(match.group(1))


def table_length(count: int, key_bytes: int) -> int:
    """Bytes of the table of ``count`` keys of ``key_bytes`` bytes each."""
    return _HEAD.size + count * (2 + key_bytes + _ENTRY.size) + _SUM.size


# No kvtier writes a longer table: a pack that claims one is not read (its table would be
# a GET of up to 4 GiB).
MAX_TABLE_BYTES = table_length(MAX_PACK_BLOCKS, MAX_KEY_BYTES)


def encode_table(keys: list[bytes], lengths: list[int]) -> bytes:
    """The table of a pack whose sections (in order) are ``lengths`` bytes long."""
    size = _HEAD.size + sum(2 + len(k) + _ENTRY.size for k in keys) + _SUM.size
    parts = [_HEAD.pack(MAGIC, len(keys), size)]
    offset = size
    for key, length in zip(keys, lengths, strict=True):
        parts.append(struct.pack("<H", len(key)) + key + _ENTRY.pack(offset, length))
        offset += length
    body = b"".join(parts)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def table_size(head: bytes) -> int:
    """The table's length, from the first 12 bytes of a pack."""
    if len(head) < _HEAD.size:
        raise PackTableError("pack shorter than its table header")
    magic, count, size = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise PackTableError("not a kvtier pack")
    if not (1 <= count <= MAX_PACK_BLOCKS and _HEAD.size + _SUM.size <= size <= MAX_TABLE_BYTES):
        raise PackTableError(f"pack table claims {count} sections in {size} bytes")
    return int(size)


def decode_table(data: bytes, name: str) -> list[tuple[bytes, Location]]:
    """Each key of the pack ``name`` with its location; ``data`` starts at the pack's first
    byte and holds at least the whole table."""
    size = table_size(data)
    if len(data) < size:
        raise PackTableError("pack table truncated")
    body, (digest,) = data[: size - _SUM.size], _SUM.unpack_from(data, size - _SUM.size)
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise PackTableError("pack table checksum mismatch")
    _magic, count, _size = _HEAD.unpack_from(body)
    out: list[tuple[bytes, Location]] = []
    at = _HEAD.size
    expected = size
    for _ in range(count):
        if at + 2 > len(body):
            raise PackTableError("pack table truncated")
        (klen,) = struct.unpack_from("<H", body, at)
        at += 2
        if not 1 <= klen <= MAX_KEY_BYTES:
            raise PackTableError(f"pack table names a key of {klen} bytes")
        if at + klen + _ENTRY.size > len(body):
            raise PackTableError("pack table truncated")
        key = bytes(body[at : at + klen])
        offset, length = _ENTRY.unpack_from(body, at + klen)
        at += klen + _ENTRY.size
        if offset != expected or length <= 0:
            raise PackTableError("pack table sections are not contiguous")
        expected += length
        out.append((key, Location(name, offset, length)))
    if at != len(body):
        raise PackTableError("pack table has trailing bytes")
    return out


def pack_body(table: bytes, bodies: list[bytes]) -> tuple[bytes, str]:
    """The pack object (table, then each block object) and the base64 CRC32 of it, which
    lets the server refuse a body that did not arrive whole (see ``build_object``). About
    a millisecond per MiB: the tier runs it in a worker thread for large packs."""
    body = b"".join([table, *bodies])
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode("ascii")
    return body, crc
