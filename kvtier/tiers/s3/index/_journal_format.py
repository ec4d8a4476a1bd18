"""The write journal of the S3 tier: how one node tells the others which keys it wrote, and
which it deleted.

Every writer (one ``S3Tier`` instance) buffers the keys it stored and, every ``index_refresh``
seconds when there are any, publishes them as one small *segment* object:

    <prefix>/_kvtier_journal/<wall ms, 15 digits>-<writer id>-<sequence>

Names sort by time, so a reader lists only the recent ones (``StartAfter`` = the name of the
time ``lookback`` seconds ago) and fetches those it has not read yet. A segment is
``MAGIC, u32 count, count x (u16 length, key), xxh3-64 of all before``; when any key was
stored in a pack (``_pack_format``), the magic is ``KVJ2`` and each key is followed by its pack's
name (``u16 length, name``; empty for a key stored as its own object) and the section's
``u64 offset, u64 length``. A tier with an integrity key writes ``KVJ5``: the ``KVJ2`` layout
with a keyed BLAKE3 MAC (``IntegrityKey.mac`` over the segment and the segment's own object
name, its length last) in place of the xxh3 digest. The name holds the journal folder (so a
segment copied from another prefix does not verify) and the stamp, writer and sequence a
reader orders and remembers segments by, so an authentic segment copied under another name
(to be read again, or later than it was written) does not verify either.

``KVJ4`` (the MAC over the segment and the journal folder's name only) and ``KVJ3`` (the same
with the keyed BLAKE2b of kvtier before BLAKE3) are still read where the name is bound some
other way: a snapshot's manifest and body chunks (``_snapshot_format``), which carry their
generation and digest. From the journal a signing reader takes ``KVJ5`` only: accepting the
older formats there would keep any copy of an old segment replayable under a fresh name for
good, while an old-format store segment it ignores only costs it misses of those keys until
a listing or a snapshot brings them (or it stores the block itself). A kvtier from before
``KVJ5`` rejects these segments whole (an unknown magic, counted), as it rejects removal
segments: in a signed fleet mid-upgrade, old and new nodes share blocks, listings and
snapshots, not journal entries.

Keys a writer deleted (on request, or because their object was corrupt) go in *removal
segments* of their own, named alike: ``KVR1, u32 count, count x (u16 length, key, u8 why),
xxh3-64`` (``why``: 1 deleted, 2 corrupt), or ``KVR3``, the same with the ``KVJ5`` MAC over its
name (``KVR2``, signed without the name, is refused: a removal is the segment worth
replaying). They are separate so that a kvtier that predates them rejects those segments
whole (an unknown magic, counted) and still reads every stored key; a store segment never
carries a removal. Segment names carry their writers' wall clocks, so their order says
nothing about when a delete and a store on two nodes happened: a reader checks a removal
against the bucket before it drops a key (``_rechecks``).

A segment is untrusted input, read from a bucket others can write:

- its size is bounded (``max_segment_bytes``; a writer puts at most ``MAX_SEGMENT_ENTRIES``
  keys in one), so reading one never costs more than that;
- a segment that does not parse, or whose MAC does not verify under a signing tier (an
  unsigned segment included), is ignored whole (``SegmentError``; the caller counts it);
- an entry may only name a pack of this prefix, by the exact shape of a pack's name
  (``is_pack_name``), and a key of 1 to 255 bytes; any other entry (another prefix's object,
  the integrity marker, a name with ``..``) is ignored and counted, so nothing a reader
  fetches or deletes because of the journal lies outside this prefix's blocks and packs;
- a removal entry must hold a key of 1 to 255 bytes and a known ``why``; it is read under the
  same bound and the same MAC rule, and a reader drops the key from its index only once a
  HEAD finds its object gone (a forged removal costs a bounded number of HEADs per refresh,
  of keys the reader holds, and never a miss).

Cost per refresh, per reader: one LIST request (one page while fewer than 1000 segments fall
within ``lookback``) plus one small GET per segment another node published since the last
refresh, and one HEAD per removed key it holds (``_rechecks``). Per writer: one small PUT per
refresh interval in which it stored anything (and one more in an interval in which it deleted
anything).

``lookback`` covers the time between a writer stamping a segment name and the segment
becoming listable (its PUT) plus the clock skew between nodes; segments older than twice
``lookback`` are deleted by their writer. This module is pure: names and bytes, no I/O.
"""

from __future__ import annotations

import hmac
import os
import re
import struct

import xxhash

from kvtier.common._format import MAC_BYTES, MAX_KEY_BYTES, IntegrityKey
from kvtier.tiers.s3._names import under_prefix
from kvtier.tiers.s3._pack_format import Location, is_pack_name, pack_name, table_length

__all__ = [
    "JOURNAL_DIR",
    "MAX_SEGMENT_ENTRIES",
    "SegmentError",
    "decode_removals",
    "decode_segment",
    "encode_removals",
    "encode_segment",
    "is_removal_segment",
    "journal_prefix",
    "max_segment_bytes",
    "segment_name",
    "segment_time_ms",
    "segment_writer",
    "start_after",
    "writer_id",
]

JOURNAL_DIR = "_kvtier_journal"
MAGIC = b"KVJ1"
MAGIC_PACKS = b"KVJ2"  # each key also names its pack section (or none: its own object)
MAGIC_SIGNED_NAMED = b"KVJ5"  # the KVJ2 layout, its MAC over the segment's name too
MAGIC_SIGNED = b"KVJ4"  # the same, its MAC over the journal folder only (snapshots)
MAGIC_SIGNED_LEGACY = b"KVJ3"  # KVJ4 with keyed BLAKE2b (snapshots; still read)
MAGIC_REMOVALS = b"KVR1"  # keys deleted, each with why (xxh3-64, as KVJ1)
MAGIC_REMOVALS_SIGNED = b"KVR3"  # the same, authenticated as KVJ5 is
MAGIC_REMOVALS_UNNAMED = b"KVR2"  # signed as KVJ4 is: refused (see the module docstring)
# How each signed magic's MAC is keyed: over the segment and its own name ("named"), the
# journal folder's ("folder"), or that with keyed BLAKE2b ("legacy").
_SIGNED = {MAGIC_SIGNED_NAMED: "named", MAGIC_SIGNED: "folder", MAGIC_SIGNED_LEGACY: "legacy"}
_SIGNED_REMOVALS = {MAGIC_REMOVALS_SIGNED: "named", MAGIC_REMOVALS_UNNAMED: "folder"}
# What a removal entry's ``why`` byte means; any other value is rejected.
REMOVAL_REASONS = {1: "deleted", 2: "corrupt"}
_REASON_CODES = {reason: code for code, reason in REMOVAL_REASONS.items()}
# A writer puts at most this many keys in one segment (the rest wait for the next one), so a
# segment a reader accepts is bounded, and a PUT that keeps failing re-sends a bounded one.
MAX_SEGMENT_ENTRIES = 16384
_COUNT = struct.Struct("<I")
_U16 = struct.Struct("<H")
_WHERE = struct.Struct("<QQ")
_SUM = struct.Struct("<Q")
_NAME_RE = re.compile(r"(\d{15})-([0-9a-f]{16})-(\d{1,20})")
_MIN_SECTION_OFFSET = table_length(1, 1)  # no section starts before a table of one key
_MAX_SECTION_END = 1 << 62


class SegmentError(ValueError):
    """A journal segment that does not parse or does not verify (ignored whole)."""


def writer_id() -> str:
    """A random id for one writer (process and tier instance), 16 hex digits."""
    return os.urandom(8).hex()


def journal_prefix(prefix: str) -> str:
    return under_prefix(prefix, f"{JOURNAL_DIR}/")


def segment_name(prefix: str, wall_ms: int, writer: str, seq: int) -> str:
    return f"{journal_prefix(prefix)}{wall_ms:015d}-{writer}-{seq}"


def start_after(prefix: str, wall_ms: int) -> str:
    """The ``StartAfter`` that lists the segments stamped at or after ``wall_ms``."""
    return f"{journal_prefix(prefix)}{max(wall_ms, 0):015d}"


def _parse_name(name: str) -> re.Match[str] | None:
    return _NAME_RE.fullmatch(name.rpartition("/")[2])


def segment_time_ms(name: str) -> int | None:
    """The wall time in a segment name, or None for a name that is not a segment."""
    match = _parse_name(name)
    return int(match.group(1)) if match else None


def segment_writer(name: str) -> str | None:
    match = _parse_name(name)
    return match.group(2) if match else None


def max_segment_bytes(prefix: str) -> int:
    """The most bytes a valid segment of ``prefix`` can hold: a reader reads no more."""
    longest_name = len(pack_name(prefix, b"\xff" * MAX_KEY_BYTES, "f" * 16, 10**20 - 1).encode())
    entry = 2 + MAX_KEY_BYTES + 2 + longest_name + _WHERE.size
    return len(MAGIC) + _COUNT.size + MAX_SEGMENT_ENTRIES * entry + MAC_BYTES


def _mac(
    body: bytes, prefix: str, integrity_key: IntegrityKey, scheme: str, name: str | None
) -> bytes:
    """The MAC of a signed segment's ``body`` by ``scheme`` (see ``_SIGNED``)."""
    if scheme == "named":
        assert name is not None
        raw = name.encode()  # its length last, so no name can be shifted into the body
        return integrity_key.mac(body, raw + _COUNT.pack(len(raw)))
    return integrity_key.mac(body, journal_prefix(prefix).encode(), legacy=scheme == "legacy")


def encode_segment(
    entries: list[tuple[bytes, Location | None]],
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
    name: str | None = None,
) -> bytes:
    """A segment of ``(key, location)`` entries (at most ``MAX_SEGMENT_ENTRIES``); version 1
    (keys only) when no key is in a pack and nothing is signed, so a writer that packs
    nothing stays readable by kvtier before packs. With ``integrity_key``: signed over its
    object ``name`` (``KVJ5``), or without a name, over the journal folder (``KVJ4``: a
    snapshot's chunks, whose name is bound by their manifest)."""
    if len(entries) > MAX_SEGMENT_ENTRIES:
        raise ValueError(f"a segment holds at most {MAX_SEGMENT_ENTRIES} entries")
    signed = integrity_key is not None
    packed = signed or any(where is not None for _, where in entries)
    named = MAGIC_SIGNED_NAMED if name is not None else MAGIC_SIGNED
    magic = named if signed else MAGIC_PACKS if packed else MAGIC
    parts = [magic, _COUNT.pack(len(entries))]
    for key, where in entries:
        parts.append(struct.pack("<H", len(key)))
        parts.append(key)
        if packed:
            pack = where.pack.encode() if where is not None else b""
            offset, length = (where.offset, where.length) if where is not None else (0, 0)
            parts.append(struct.pack("<H", len(pack)) + pack + _WHERE.pack(offset, length))
    body = b"".join(parts)
    if integrity_key is not None:
        return body + _mac(body, prefix, integrity_key, _SIGNED[magic], name)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def _authentic_body(
    data: bytes,
    prefix: str,
    integrity_key: IntegrityKey | None,
    name: str | None,
    kinds: tuple[tuple[bytes, ...], dict[bytes, str]] = ((MAGIC, MAGIC_PACKS), _SIGNED),
) -> bytes:
    """The segment without its digest or MAC, once that verifies; else SegmentError.
    ``kinds``: the magics read of one kind of segment (unsigned; signed, with their MAC's
    scheme). Read under its object ``name``, a signed segment must be signed over it; read
    without one (a snapshot's chunk), it must not be."""
    plain, signed = kinds
    magic = data[:4]
    if magic not in (*plain, *signed):
        raise SegmentError("not a kvtier journal segment")
    if integrity_key is None:
        if magic in signed:
            raise SegmentError("signed journal segment, and this tier has no integrity key")
        if len(data) < len(MAGIC) + _COUNT.size + _SUM.size:
            raise SegmentError("journal segment truncated")
        body, (digest,) = data[: -_SUM.size], _SUM.unpack(data[-_SUM.size :])
        if xxhash.xxh3_64_intdigest(body) != digest:
            raise SegmentError("journal segment checksum mismatch")
        return body
    if magic not in signed:
        raise SegmentError("unsigned journal segment under a signing tier")
    scheme = signed[magic]
    if (scheme == "named") != (name is not None):
        raise SegmentError(
            "signed journal segment of an older format (its MAC does not cover its name)"
            if name is not None
            else "journal segment signed over a name, read without one"
        )
    if len(data) < len(MAGIC) + _COUNT.size + MAC_BYTES:
        raise SegmentError("journal segment truncated")
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(_mac(body, prefix, integrity_key, scheme, name), mac):
        raise SegmentError("journal segment MAC does not verify under this tier's key")
    return body


def decode_segment(
    data: bytes,
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
    name: str | None = None,
) -> tuple[list[tuple[bytes, Location | None]], int]:
    """The entries of a segment of ``prefix`` that a reader may use, and how many it ignored
    (see the module docstring); ``name``: the object it was read from (a journal segment;
    None for a snapshot's chunk). A segment that does not parse or verify raises
    ``SegmentError``; nothing else is raised, whatever ``data`` holds."""
    if len(data) > max_segment_bytes(prefix):
        raise SegmentError(f"journal segment of {len(data)} bytes, more than any writer puts")
    body = _authentic_body(bytes(data), prefix, integrity_key, name)
    packed = body[:4] != MAGIC
    (count,) = _COUNT.unpack_from(body, 4)
    if count > MAX_SEGMENT_ENTRIES:
        raise SegmentError(f"journal segment claims {count} entries")
    entries: list[tuple[bytes, Location | None]] = []
    rejected = 0
    at = 8
    end = len(body)
    names: dict[bytes, str | None] = {}  # each pack's name is checked once per segment
    for _ in range(count):
        if at + 2 > end:
            raise SegmentError("journal segment truncated")
        (length,) = _U16.unpack_from(body, at)
        key = body[at + 2 : at + 2 + length]
        at += 2 + length
        usable = 1 <= length <= MAX_KEY_BYTES
        where: Location | None = None
        if packed:
            if at + 2 > end:
                raise SegmentError("journal segment truncated")
            (name_length,) = _U16.unpack_from(body, at)
            raw_name = body[at + 2 : at + 2 + name_length]
            at += 2 + name_length
            if at + _WHERE.size > end:
                raise SegmentError("journal segment truncated")
            section_offset, section_length = _WHERE.unpack_from(body, at)
            at += _WHERE.size
            if raw_name:
                name = names[raw_name] if raw_name in names else _pack_of(raw_name, prefix)
                names[raw_name] = name
                usable = (
                    usable
                    and name is not None
                    and _section_may_exist(section_offset, section_length)
                )
                if name is not None:
                    where = Location(name, section_offset, section_length)
        if at > end:
            raise SegmentError("journal segment truncated")
        if usable:
            entries.append((key, where))
        else:
            rejected += 1
    if at != end:
        raise SegmentError("journal segment has trailing bytes")
    return entries, rejected


def _pack_of(raw_name: bytes, prefix: str) -> str | None:
    """The pack an entry names if it is one of this prefix's, else None."""
    try:
        name = raw_name.decode("ascii")
    except UnicodeDecodeError:
        return None
    return name if is_pack_name(name, prefix) else None


def _section_may_exist(offset: int, length: int) -> bool:
    """A section after a table and of some length (its exact length is checked before a
    load reads it)."""
    return offset >= _MIN_SECTION_OFFSET and length > 0 and offset + length <= _MAX_SECTION_END


# -- removal segments ----------------------------------------------------------------------

_REMOVALS = ((MAGIC_REMOVALS,), _SIGNED_REMOVALS)
# The most bytes a valid removal segment holds (fewer than a store segment's bound).
_MAX_REMOVAL_BYTES = (
    len(MAGIC) + _COUNT.size + MAX_SEGMENT_ENTRIES * (3 + MAX_KEY_BYTES) + MAC_BYTES
)


def is_removal_segment(data: bytes) -> bool:
    """Whether ``data`` claims to be a removal segment (``decode_removals`` checks it)."""
    return data[:4] in (MAGIC_REMOVALS, *_SIGNED_REMOVALS)


def encode_removals(
    entries: list[tuple[bytes, str]],
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
    name: str | None = None,
) -> bytes:
    """A removal segment of ``(key, why)`` entries (at most ``MAX_SEGMENT_ENTRIES``; ``why``
    one of ``REMOVAL_REASONS``' values); with ``integrity_key``, signed over its object
    ``name`` (``KVR3``), which it then needs."""
    if len(entries) > MAX_SEGMENT_ENTRIES:
        raise ValueError(f"a segment holds at most {MAX_SEGMENT_ENTRIES} entries")
    if integrity_key is not None and name is None:
        raise ValueError("a signed removal segment is signed over its object name: pass name")
    magic = MAGIC_REMOVALS if integrity_key is None else MAGIC_REMOVALS_SIGNED
    parts = [magic, _COUNT.pack(len(entries))]
    for key, why in entries:
        parts.append(_U16.pack(len(key)) + key + bytes((_REASON_CODES[why],)))
    body = b"".join(parts)
    if integrity_key is not None:
        return body + _mac(body, prefix, integrity_key, "named", name)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_removals(
    data: bytes,
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
    name: str | None = None,
) -> tuple[list[tuple[bytes, str]], int]:
    """The ``(key, why)`` entries of a removal segment of ``prefix`` read from the object
    ``name`` that a reader may use, and how many it ignored (a key of no valid length, an
    unknown ``why``). A segment that does not parse or verify (under a key: one not signed
    over ``name``) raises ``SegmentError``; nothing else is raised."""
    if len(data) > _MAX_REMOVAL_BYTES:
        raise SegmentError(f"removal segment of {len(data)} bytes, more than any writer puts")
    if integrity_key is not None and name is None:
        raise SegmentError("a signed removal segment is only read under its object name")
    body = _authentic_body(bytes(data), prefix, integrity_key, name, _REMOVALS)
    (count,) = _COUNT.unpack_from(body, 4)
    if count > MAX_SEGMENT_ENTRIES:
        raise SegmentError(f"journal segment claims {count} entries")
    entries: list[tuple[bytes, str]] = []
    rejected = 0
    at, end = 8, len(body)
    for _ in range(count):
        if at + 2 > end:
            raise SegmentError("journal segment truncated")
        (length,) = _U16.unpack_from(body, at)
        at += 2 + length
        if at + 1 > end:
            raise SegmentError("journal segment truncated")
        why = REMOVAL_REASONS.get(body[at])
        if why is not None and 1 <= length <= MAX_KEY_BYTES:
            entries.append((body[at - length : at], why))
        else:
            rejected += 1
        at += 1
    if at != end:
        raise SegmentError("journal segment has trailing bytes")
    return entries, rejected
