"""Journal digests of the S3 tier: one interval's journal segments in one object (names,
format, no I/O).

Without digests every node reads every other writer's segments, so a node's requests per
refresh grow with the fleet. With them, time is cut into intervals of ``index_refresh``
seconds (by the wall clock, which NTP keeps close to the server's), and for each finished
interval one node copies the segments stamped in it into one object named from the
interval; every other node reads that one object by its name, with no LIST
(``_digest`` does the I/O and says who writes one and when):

    <prefix>/_kvtier_digests/<interval ms, 9 digits>-<interval number, 15 digits>

A digest is ``MAGIC, u64 interval, u32 interval ms, writer (8 bytes), u32 count``, then
``count x (u16 length, segment name, u32 length, segment)`` in name order, then the xxh3-128
of all before and the digest folder's name (``KVD1``) or, when the tier signs, the keyed MAC
of ``IntegrityKey.mac`` over them (``KVD2``), so a digest copied from another prefix, or a
journal segment passed off as a digest, does not verify. Segment names are stored without
their folder and must have a segment name's exact shape: a reader rebuilds them under its
own journal folder, so no digest can name an object elsewhere. The segments are kept as
their writers published them, store and removal segments alike, so a reader checks (and
authenticates) each exactly as it checks one read from the journal.

What the bucket holds is untrusted: a digest larger than ``MAX_DIGEST_BYTES``, of more than
``MAX_DIGEST_SEGMENTS`` segments, of another interval or interval length than its name
says, naming a segment stamped outside its window, or that does not parse or verify, is
rejected whole (``DigestError``): the reader then reads the journal as before. The window of
interval ``j`` runs from the start of ``j - CARRY_INTERVALS`` (a digester lists the journal
from there: it carries the segments of the intervals before that no digest holds) to the end
of ``j``. Without the lower bound a digest could bring back a segment of any age, one its
readers read long ago and have forgotten since (they remember names for the lookback only).
"""

from __future__ import annotations

import hmac
import re
import struct
from dataclasses import dataclass

import xxhash

from kvtier.common._format import MAC_BYTES, IntegrityKey
from kvtier.tiers.s3._names import under_prefix
from kvtier.tiers.s3.index._journal_format import journal_prefix, max_segment_bytes, segment_time_ms

__all__ = [
    "CARRY_INTERVALS",
    "DIGEST_DIR",
    "MAX_DIGEST_BYTES",
    "MAX_DIGEST_SEGMENTS",
    "Digest",
    "DigestError",
    "decode_digest",
    "digest_dir",
    "digest_name",
    "encode_digest",
]

DIGEST_DIR = "_kvtier_digests"
MAGIC = b"KVD1"
MAGIC_SIGNED = b"KVD2"
_HEAD = struct.Struct("<4sQI8sI")
_NAME = struct.Struct("<H")
_LENGTH = struct.Struct("<I")
_SUM_BYTES = 16
# A digester stops adding segments at these bounds (the rest go in the next interval's
# digest, or are read from the journal), so a reader never reads more than this.
MAX_DIGEST_SEGMENTS = 4096
MAX_DIGEST_BYTES = 64 << 20
_SEGMENT_FILE_RE = re.compile(r"\d{15}-[0-9a-f]{16}-\d{1,20}")
# A digester also takes the segments of this many intervals before its own that no digest
# holds: the backup of a digester that did not publish, and of a slow PUT. No segment stamped
# before them belongs in its digest.
CARRY_INTERVALS = 2


class DigestError(ValueError):
    """A digest that does not parse or verify: ignored whole."""


@dataclass(frozen=True, slots=True)
class Digest:
    """One interval's segments: ``(full segment name, segment bytes)`` in name order, and
    the writer that made it."""

    interval: int
    interval_ms: int
    writer: str
    segments: list[tuple[str, bytes]]


def digest_dir(prefix: str) -> str:
    return under_prefix(prefix, f"{DIGEST_DIR}/")


def digest_name(prefix: str, interval_ms: int, interval: int) -> str:
    return f"{digest_dir(prefix)}{interval_ms:09d}-{interval:015d}"


def _seal(body: bytes, prefix: str, integrity_key: IntegrityKey | None) -> bytes:
    if integrity_key is None:  # the folder too: a digest copied from another prefix fails
        return xxhash.xxh3_128_digest(body + digest_dir(prefix).encode())
    return integrity_key.mac(body, digest_dir(prefix).encode())


def encode_digest(
    digest: Digest, prefix: str, *, integrity_key: IntegrityKey | None = None
) -> bytes:
    """The digest object (signed with ``integrity_key``); its segments must be this prefix's
    journal segments, at most ``MAX_DIGEST_SEGMENTS``."""
    if len(digest.segments) > MAX_DIGEST_SEGMENTS:
        raise ValueError(f"a digest holds at most {MAX_DIGEST_SEGMENTS} segments")
    magic = MAGIC if integrity_key is None else MAGIC_SIGNED
    head = _HEAD.pack(
        magic,
        digest.interval,
        digest.interval_ms,
        bytes.fromhex(digest.writer),
        len(digest.segments),
    )
    parts = [head]
    for name, data in digest.segments:
        short = name.rpartition("/")[2].encode()
        parts.append(_NAME.pack(len(short)) + short + _LENGTH.pack(len(data)))
        parts.append(data)
    body = b"".join(parts)
    return body + _seal(body, prefix, integrity_key)


def _authentic(data: bytes, prefix: str, integrity_key: IntegrityKey | None) -> bytes:
    """The digest without its seal, once the seal verifies; else DigestError."""
    if len(data) > MAX_DIGEST_BYTES:
        raise DigestError(f"digest of {len(data)} bytes")
    magic = data[:4]
    if magic not in (MAGIC, MAGIC_SIGNED):
        raise DigestError("not a kvtier journal digest")
    if (magic == MAGIC_SIGNED) != (integrity_key is not None):
        raise DigestError("a digest signed or not, unlike this tier")
    seal = MAC_BYTES if integrity_key is not None else _SUM_BYTES
    if len(data) < _HEAD.size + seal:
        raise DigestError("digest truncated")
    body = data[:-seal]
    if not hmac.compare_digest(_seal(body, prefix, integrity_key), data[-seal:]):
        raise DigestError("digest does not verify")
    return body


def decode_digest(
    data: bytes,
    prefix: str,
    interval: int,
    interval_ms: int,
    *,
    integrity_key: IntegrityKey | None = None,
) -> Digest:
    """The digest in ``data``, read from the name of ``interval`` of ``interval_ms``;
    ``DigestError`` for anything that is not exactly one. Nothing else is raised."""
    body = _authentic(bytes(data), prefix, integrity_key)
    _, number, length_ms, writer, count = _HEAD.unpack_from(body, 0)
    if (number, length_ms) != (interval, interval_ms):
        raise DigestError(f"digest of interval {number} x {length_ms} ms under another name")
    if count > MAX_DIGEST_SEGMENTS:
        raise DigestError(f"digest claims {count} segments")
    folder, largest = journal_prefix(prefix), max_segment_bytes(prefix)
    start_ms, end_ms = (interval - CARRY_INTERVALS) * interval_ms, (interval + 1) * interval_ms
    segments: list[tuple[str, bytes]] = []
    at = _HEAD.size
    for _ in range(count):
        if at + _NAME.size > len(body):
            raise DigestError("digest truncated")
        (name_length,) = _NAME.unpack_from(body, at)
        raw = body[at + _NAME.size : at + _NAME.size + name_length]
        at += _NAME.size + name_length
        if at + _LENGTH.size > len(body):
            raise DigestError("digest truncated")
        (length,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if length > largest or at + length > len(body):
            raise DigestError("digest has a segment past its end or too large")
        short = raw.decode("ascii", "replace")
        stamp = segment_time_ms(short)
        if not _SEGMENT_FILE_RE.fullmatch(short) or stamp is None:
            raise DigestError("digest names something that is not a segment")
        if not start_ms <= stamp < end_ms:
            raise DigestError(f"digest carries a segment stamped outside its window ({stamp})")
        segments.append((folder + short, body[at : at + length]))
        at += length
    if at != len(body):
        raise DigestError("digest has trailing bytes")
    if [name for name, _ in segments] != sorted({name for name, _ in segments}):
        raise DigestError("digest segments out of order or repeated")
    return Digest(number, length_ms, writer.hex(), segments)
