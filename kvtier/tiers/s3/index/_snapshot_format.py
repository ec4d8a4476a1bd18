"""Index snapshots of the S3 tier: the whole existence index in one object (names, format, no I/O).

A node opening against a bucket of millions of blocks cannot list them in time; a snapshot
holds what a node's index knew at one moment, so a new node reads one object instead of
listing the prefix, then the journal segments stamped after it (``_snapshot`` does the
I/O and says who writes one and when). Objects live in their own folder:

    <prefix>/_kvtier_snapshots/claim-<generation>            empty: "I am writing this one"
    <prefix>/_kvtier_snapshots/data-<generation>-<writer>   the body: the keys
    <prefix>/_kvtier_snapshots/dir-<generation>-<writer>    where its chunks start
    <prefix>/_kvtier_snapshots/gen-<generation>             the manifest: publishes a body

Generations have 12 digits, so names sort by generation; the newest manifest is the current
snapshot. Claims and manifests are written with ``If-None-Match: *``, so of two nodes that
compact at once one wins; a body is only read through the manifest that names it, so one
whose manifest was never written (its writer crashed, or lost) is never read. The
directory (``_snapshot_directory``) lets a node still reading a body fetch the one chunk that
holds a key it is asked about; a writer that wrote none (an older kvtier) is read as before.

A manifest is a journal segment (``_journal_format``) of one entry whose key is the record
``MAGIC, u64 generation, u64 cover (server ms), u64 body length, xxh3-128 of the body,
writer (8 bytes)``: it is checked, and with an integrity key authenticated, exactly as a
segment is. A body is ``BODY_MAGIC`` then chunks of ``u32 length, segment``, each segment of
at most ``MAX_SEGMENT_ENTRIES`` entries, so every entry of a snapshot is validated (and
authenticated) as a journal entry is: a key of 1 to 255 bytes, a pack of this prefix only.
A reader checks the body's length and xxh3-128 against its manifest: ``decode_body`` before
decoding it, ``BodyDecoder`` (a body decoded as it arrives) once it has all of it.

What the bucket holds is untrusted: a manifest larger than ``MAX_MANIFEST_BYTES``, one whose
body would exceed the reader's ``index_snapshot_max_bytes``, a body that does not match its
manifest, or a chunk that does not parse or verify, rejects the snapshot whole
(``SnapshotError``): the reader then lists the prefix as before (one that decoded the body as
it arrived keeps the entries of the chunks before the fault, each valid on its own). Nothing
in a snapshot can make a reader fetch outside its prefix, and an entry naming a block that is
not there costs one GET that finds nothing (blocks carry their own key and checksum): a
hostile snapshot can cost misses, never a wrong byte.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import xxhash

from kvtier.common._format import IntegrityKey
from kvtier.tiers.s3._names import under_prefix
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3.index._journal_format import (
    MAX_SEGMENT_ENTRIES,
    SegmentError,
    decode_segment,
    encode_segment,
    max_segment_bytes,
)

__all__ = [
    "BODY_MAGIC",
    "MAX_MANIFEST_BYTES",
    "SNAPSHOT_DIR",
    "BodyDecoder",
    "Manifest",
    "SnapshotError",
    "SnapshotName",
    "body_digest",
    "claim_name",
    "data_name",
    "decode_body",
    "decode_chunk",
    "decode_manifest",
    "directory_name",
    "encode_body",
    "encode_chunks",
    "encode_manifest",
    "manifest_name",
    "parse_name",
    "snapshot_dir",
]

SNAPSHOT_DIR = "_kvtier_snapshots"
MAGIC = b"KVS1"
BODY_MAGIC = b"KVB1"
_RECORD = struct.Struct("<4sQQQ16s8s")
_CHUNK = struct.Struct("<I")
MAX_MANIFEST_BYTES = 4096  # a manifest is a segment of one entry: far less
_NAME_RE = re.compile(r"(claim|data|dir|gen)-(\d{12})(?:-([0-9a-f]{16}))?")
MAX_GENERATION = 10**12 - 1


class SnapshotError(ValueError):
    """A snapshot (manifest or body) that does not parse or verify: ignored whole."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a published snapshot is: its generation, the server time its index covers (every
    journal segment listable then is in it), and the body it names."""

    generation: int
    cover_ms: int
    body_length: int
    digest: bytes
    writer: str


@dataclass(frozen=True, slots=True)
class SnapshotName:
    """A parsed name in the snapshot folder."""

    kind: str  # "claim", "data", "dir" or "gen"
    generation: int
    writer: str | None


def snapshot_dir(prefix: str) -> str:
    return under_prefix(prefix, f"{SNAPSHOT_DIR}/")


def claim_name(prefix: str, generation: int) -> str:
    return f"{snapshot_dir(prefix)}claim-{generation:012d}"


def data_name(prefix: str, generation: int, writer: str) -> str:
    return f"{snapshot_dir(prefix)}data-{generation:012d}-{writer}"


def directory_name(prefix: str, generation: int, writer: str) -> str:
    """The directory of a body (``_snapshot_directory``): where each of its chunks starts."""
    return f"{snapshot_dir(prefix)}dir-{generation:012d}-{writer}"


def manifest_name(prefix: str, generation: int) -> str:
    return f"{snapshot_dir(prefix)}gen-{generation:012d}"


def parse_name(name: str, prefix: str) -> SnapshotName | None:
    """The kind, generation and writer of a name in ``prefix``'s snapshot folder; None for
    anything else (another folder, a nested name, a name of another shape)."""
    folder = snapshot_dir(prefix)
    if not name.startswith(folder):
        return None
    match = _NAME_RE.fullmatch(name[len(folder) :])
    if match is None:
        return None
    kind, generation, writer = match.groups()
    if (kind in ("data", "dir")) != (writer is not None):
        return None
    return SnapshotName(kind, int(generation), writer)


def body_digest(body: bytes) -> bytes:
    return xxhash.xxh3_128_digest(body)


def encode_manifest(
    manifest: Manifest, prefix: str, *, integrity_key: IntegrityKey | None = None
) -> bytes:
    """The manifest object: a journal segment of one record (signed as segments are)."""
    record = _RECORD.pack(
        MAGIC,
        manifest.generation,
        manifest.cover_ms,
        manifest.body_length,
        manifest.digest,
        bytes.fromhex(manifest.writer),
    )
    return encode_segment([(record, None)], prefix, integrity_key=integrity_key)


def decode_manifest(
    data: bytes, prefix: str, generation: int, *, integrity_key: IntegrityKey | None = None
) -> Manifest:
    """The manifest in ``data``, read from the name of ``generation``; ``SnapshotError`` for
    anything that is not exactly one (a manifest of another generation included)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise SnapshotError(f"snapshot manifest of {len(data)} bytes")
    try:
        entries, rejected = decode_segment(data, prefix, integrity_key=integrity_key)
    except SegmentError as exc:
        raise SnapshotError(f"snapshot manifest: {exc}") from None
    if rejected or len(entries) != 1 or entries[0][1] is not None:
        raise SnapshotError("snapshot manifest does not hold one record")
    record = entries[0][0]
    if len(record) != _RECORD.size:
        raise SnapshotError("snapshot manifest record has the wrong length")
    magic, gen, cover_ms, length, digest, writer = _RECORD.unpack(record)
    if magic != MAGIC:
        raise SnapshotError("not a kvtier snapshot manifest")
    if gen != generation:
        raise SnapshotError(f"snapshot manifest of generation {gen} under the name of {generation}")
    return Manifest(gen, cover_ms, length, digest, writer.hex())


def encode_chunks(
    entries: list[tuple[bytes, Location | None]],
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
    per_chunk: int = MAX_SEGMENT_ENTRIES,
) -> list[tuple[int, bytes]]:
    """A body's chunks, each ``u32 length, segment`` of ``per_chunk`` entries (at most
    ``MAX_SEGMENT_ENTRIES``), with the index in ``entries`` of its first entry."""
    per_chunk = min(per_chunk, MAX_SEGMENT_ENTRIES)
    chunks = []
    for start in range(0, len(entries), per_chunk):
        chunk = encode_segment(
            entries[start : start + per_chunk], prefix, integrity_key=integrity_key
        )
        chunks.append((start, _CHUNK.pack(len(chunk)) + chunk))
    return chunks


def encode_body(
    entries: list[tuple[bytes, Location | None]],
    prefix: str,
    *,
    integrity_key: IntegrityKey | None = None,
) -> bytes:
    """A snapshot body: ``entries`` as segments of at most ``MAX_SEGMENT_ENTRIES`` each."""
    chunks = encode_chunks(entries, prefix, integrity_key=integrity_key)
    return b"".join([BODY_MAGIC, *(chunk for _, chunk in chunks)])


def decode_chunk(
    data: bytes, prefix: str, *, integrity_key: IntegrityKey | None = None
) -> tuple[list[tuple[bytes, Location | None]], int]:
    """The entries of one chunk read on its own (``u32 length, segment``, exactly), and how
    many were ignored; ``SnapshotError`` if it does not parse or verify."""
    if len(data) < _CHUNK.size:
        raise SnapshotError("snapshot chunk truncated")
    (size,) = _CHUNK.unpack_from(data)
    if size != len(data) - _CHUNK.size or size > max_segment_bytes(prefix):
        raise SnapshotError("snapshot chunk of the wrong length")
    try:
        return decode_segment(data[_CHUNK.size :], prefix, integrity_key=integrity_key)
    except SegmentError as exc:
        raise SnapshotError(f"snapshot chunk: {exc}") from None


def decode_body(
    data: bytes,
    prefix: str,
    manifest: Manifest,
    *,
    integrity_key: IntegrityKey | None = None,
) -> tuple[list[tuple[bytes, Location | None]], int]:
    """The entries of a body that matches ``manifest``, and how many were ignored (as a
    segment's are); ``SnapshotError`` if it does not match, parse or verify."""
    if len(data) != manifest.body_length:
        raise SnapshotError(
            f"snapshot body of {len(data)} bytes, its manifest says {manifest.body_length}"
        )
    if body_digest(data) != manifest.digest:
        raise SnapshotError("snapshot body does not match its manifest's digest")
    if data[:4] != BODY_MAGIC:
        raise SnapshotError("not a kvtier snapshot body")
    largest = max_segment_bytes(prefix)
    view = memoryview(data)
    entries: list[tuple[bytes, Location | None]] = []
    rejected = 0
    at = len(BODY_MAGIC)
    while at < len(data):
        if at + _CHUNK.size > len(data):
            raise SnapshotError("snapshot body truncated")
        (length,) = _CHUNK.unpack_from(data, at)
        at += _CHUNK.size
        if length > largest or at + length > len(data):
            raise SnapshotError("snapshot body has a chunk past its end or too large")
        try:
            chunk, ignored = decode_segment(
                bytes(view[at : at + length]), prefix, integrity_key=integrity_key
            )
        except SegmentError as exc:
            raise SnapshotError(f"snapshot body: {exc}") from None
        entries.extend(chunk)
        rejected += ignored
        at += length
    return entries, rejected


class BodyDecoder:
    """A snapshot body decoded as it arrives, so its first keys are indexed while the rest is
    still on the wire (a body of millions of keys takes seconds to read).

    ``feed`` takes the body's bytes in order and returns the entries of each chunk it
    completed: a chunk is a journal segment, checked (and with an integrity key,
    authenticated) on its own as ``decode_body`` checks it, so what it returns is as
    trustworthy as a segment read from the journal. ``finish`` then checks the body whole
    against its manifest (length, digest). A synchronous state machine holding at most one
    chunk and one fed piece: ``SnapshotError`` at the first byte past the manifest's length,
    the first chunk that does not parse or verify, or a body that does not match at the end.
    The entries of the chunks before a rejection were each valid: a reader keeps them (an
    entry naming a block that is gone costs one GET that finds nothing, as a stale segment's
    does) and lists the prefix for the rest.
    """

    def __init__(
        self, prefix: str, manifest: Manifest, *, integrity_key: IntegrityKey | None = None
    ) -> None:
        self._prefix, self._manifest, self._integrity_key = prefix, manifest, integrity_key
        self._largest = max_segment_bytes(prefix)
        self._digest = xxhash.xxh3_128()
        self._buffer = bytearray()
        self._done = 0  # body bytes before the buffer, all parsed
        self.length = manifest.body_length
        self.received = 0
        self.entries = 0  # entries returned
        self.rejected = 0  # entries ignored, as a segment's are

    @property
    def parsed(self) -> int:
        """Body bytes decoded so far: every chunk before this offset was returned."""
        return self._done

    def feed(self, data: bytes) -> list[tuple[bytes, Location | None]]:
        """The entries of the chunks ``data`` completed (none while one is incomplete)."""
        length = self._manifest.body_length
        self.received += len(data)
        if self.received > length:
            raise SnapshotError(f"snapshot body longer than the {length} bytes of its manifest")
        self._digest.update(data)
        buffer = self._buffer
        buffer += data
        at, entries = 0, list[tuple[bytes, Location | None]]()
        if self._done == 0:
            if len(buffer) < len(BODY_MAGIC):
                return entries
            if buffer[: len(BODY_MAGIC)] != BODY_MAGIC:
                raise SnapshotError("not a kvtier snapshot body")
            at = len(BODY_MAGIC)
        while len(buffer) - at >= _CHUNK.size:
            (size,) = _CHUNK.unpack_from(buffer, at)
            end = at + _CHUNK.size + size
            if size > self._largest or self._done + end > length:
                raise SnapshotError("snapshot body has a chunk past its end or too large")
            if end > len(buffer):
                break
            try:
                chunk, ignored = decode_segment(
                    bytes(buffer[at + _CHUNK.size : end]),
                    self._prefix,
                    integrity_key=self._integrity_key,
                )
            except SegmentError as exc:
                raise SnapshotError(f"snapshot body: {exc}") from None
            entries.extend(chunk)
            self.entries += len(chunk)
            self.rejected += ignored
            at = end
        del buffer[:at]
        self._done += at
        return entries

    def finish(self) -> None:
        """The whole body was fed: check it against its manifest."""
        length = self._manifest.body_length
        if self.received != length:
            raise SnapshotError(
                f"snapshot body of {self.received} bytes, its manifest says {length}"
            )
        if self._digest.digest() != self._manifest.digest:
            raise SnapshotError("snapshot body does not match its manifest's digest")
        if self._buffer or self._done < len(BODY_MAGIC):
            raise SnapshotError("snapshot body truncated")
