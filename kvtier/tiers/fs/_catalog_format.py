"""The FS catalog at rest, as bytes: a checkpoint and the frames of the log that follows it.

An owner's catalog (which block files, their sizes, least recently used first) is kept in its
root as a checkpoint plus a log of what changed since (``_catalog_files`` writes and reads
them, ``_catalog_journal`` decides when). This module only turns them into bytes and back:
no I/O, no state.

Checkpoint (little endian)::

    magic "KVTFSCAT" | version u32 | flags u32 | generation u64 | count u64 | names_len u64
    sizes: count x u64 | names: names_len bytes, the names joined by "\\n" | xxh3-64 of all before

Log: a header, then frames, each written by one ``write`` and checksummed on its own, so a
kill -9 in the middle of one leaves a torn last frame that the reader cuts off::

    magic "KVTFSLOG" | version u32 | flags u32 | generation u64 | xxh3-64 of the 24 bytes before
    frame: count u32 | names_len u32 | checksum u64 | ops: count bytes | sizes: count x u64 |
           names: names_len bytes   (checksum: xxh3-64 of count, names_len and the body, seeded
                                     with the generation, so a frame only counts in its log)

The generation is drawn at random for each checkpoint, and its log names it: a log left
beside a newer checkpoint (a kill -9 between the two renames) is not replayed onto it.
Columns rather than records so that a million entries decode in a few C-speed passes.

Everything read is untrusted: lengths are checked before anything is allocated from them,
every name must be a block name (``_layout.is_block_name``: hex digits, or ``h`` and a hash;
never a path), sizes are bounded, and the only exception the decoders raise is
``CatalogFormatError``.
"""

from __future__ import annotations

import array
import enum
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.tiers.fs._layout import is_block_name

__all__ = [
    "CHECKPOINT_VERSION",
    "LOG_HEADER_SIZE",
    "MAX_FRAME_CHANGES",
    "MAX_NAME",
    "CatalogFormatError",
    "Change",
    "Checkpoint",
    "Frame",
    "Limits",
    "RawCheckpoint",
    "decode_checkpoint",
    "decode_checkpoint_raw",
    "decode_frames",
    "decode_log_header",
    "encode_checkpoint",
    "encode_frame",
    "encode_log_header",
]

CHECKPOINT_VERSION = 1
_CHECKPOINT_MAGIC = b"KVTFSCAT"
_LOG_MAGIC = b"KVTFSLOG"
_CHECKPOINT_HEAD = struct.Struct("<8sIIQQQ")
_LOG_HEAD = struct.Struct("<8sIIQQ")
_FRAME_HEAD = struct.Struct("<IIQ")
_SUM = struct.Struct("<Q")
LOG_HEADER_SIZE = _LOG_HEAD.size
MAX_NAME = 200
"""The longest block name (``_layout``): 200 hex digits."""
MAX_FRAME_CHANGES = 65536
"""Changes in one log frame: a flush of more writes several frames."""
_MAX_FILE_SIZE = 1 << 40
"""A block file's size in the catalog: no block is a TiB."""
_HEX = b"0123456789abcdef"
_NAME_BYTES = _HEX + b"h\n"
_OPS = bytes(range(1, 5))


class CatalogFormatError(ValueError):
    """A checkpoint or log frame that is not one this version reads: damaged, truncated, of
    another version, or over the bounds. The reader's answer is to fall back (to the
    walk, or to the checkpoint without the rest of the log)."""


class Change(enum.IntEnum):
    """What a log frame records, replayed in order onto the checkpoint (``Catalog``'s
    operations, so that the order they leave is exactly the catalog's)."""

    ADD = 1  # the name is (now) the most recently used, with this size
    DROP = 2  # the name is gone
    BACK = 3  # a victim a failed store returns: the least recently used end, if absent
    SIZE = 4  # the name's size corrected where it stands: no longer written, still read


@dataclass(frozen=True, slots=True)
class Limits:
    """What a reader accepts: a file past these is damaged, not a reason to run out of
    memory."""

    max_entries: int = 1 << 25
    max_file_bytes: int = 4 << 30


@dataclass(frozen=True, slots=True)
class Checkpoint:
    generation: int
    names: list[str]
    sizes: array.array[int]


@dataclass(frozen=True, slots=True)
class RawCheckpoint:
    """A checkpoint whose names are left joined (``_packed_build`` splits and checks them in
    C-speed passes): only name characters, not yet checked one by one."""

    generation: int
    count: int
    names: bytes
    sizes: array.array[int]


@dataclass(frozen=True, slots=True)
class Frame:
    ops: bytes
    names: list[str]
    sizes: array.array[int]


def _u64s(data: bytes | memoryview) -> array.array[int]:
    sizes = array.array("Q")
    sizes.frombytes(data)
    if sys.byteorder != "little":
        sizes.byteswap()
    return sizes


def _le(sizes: array.array[int]) -> bytes:
    if sys.byteorder == "little":
        return sizes.tobytes()
    swapped = array.array("Q", sizes)
    swapped.byteswap()
    return swapped.tobytes()


def _join(names: Sequence[str]) -> bytes:
    return "\n".join(names).encode("ascii")


def _names(blob: bytes, count: int) -> list[str]:
    """``count`` block names from ``blob``; ``CatalogFormatError`` unless each one is one
    ``_layout.name_of`` could give. The common case (hex names) is checked in C-speed passes;
    hashed names (``h``...) one by one."""
    if count == 0:
        if blob:
            raise CatalogFormatError("names where there should be none")
        return []
    if blob.translate(None, _NAME_BYTES):
        raise CatalogFormatError("a name holds a character no block name has")
    names = blob.decode("ascii").split("\n")
    if len(names) != count:
        raise CatalogFormatError(f"{len(names)} names where {count} were announced")
    lengths = list(map(len, names))
    if min(lengths) < 2 or max(lengths) > MAX_NAME:
        raise CatalogFormatError("a name is shorter or longer than any block name")
    if b"h" in blob and not all(map(is_block_name, names)):
        raise CatalogFormatError("a name is not a block name")
    return names


def _check_sizes(sizes: array.array[int]) -> None:
    if sizes and int(np.frombuffer(sizes, dtype=np.uint64).max()) > _MAX_FILE_SIZE:
        raise CatalogFormatError("a block file size past any block's")


# -- checkpoint --------------------------------------------------------------------------------


def encode_checkpoint(generation: int, names: Sequence[str], sizes: array.array[int]) -> bytes:
    """The checkpoint of ``names`` (least recently used first) and their ``sizes``."""
    assert len(names) == len(sizes)
    blob = _join(names)
    head = _CHECKPOINT_HEAD.pack(
        _CHECKPOINT_MAGIC, CHECKPOINT_VERSION, 0, generation, len(names), len(blob)
    )
    hasher = xxhash.xxh3_64()
    body = (head, _le(sizes), blob)
    for part in body:
        hasher.update(part)
    return b"".join((*body, _SUM.pack(hasher.intdigest())))


def decode_checkpoint(data: bytes, limits: Limits) -> Checkpoint:
    """The checkpoint ``data`` holds; ``CatalogFormatError`` for anything else."""
    raw = decode_checkpoint_raw(data, limits)
    # A name listed twice (only a writer that means it could seal that) counts once, as the
    # catalog's index holds it: harmless, so not worth a pass over every name here.
    return Checkpoint(raw.generation, _names(raw.names, raw.count), raw.sizes)


def decode_checkpoint_raw(data: bytes, limits: Limits) -> RawCheckpoint:
    """``decode_checkpoint`` less splitting the names and checking them one by one."""
    head_size = _CHECKPOINT_HEAD.size
    if len(data) < head_size + _SUM.size:
        raise CatalogFormatError("shorter than a checkpoint's header")
    magic, version, flags, generation, count, names_len = _CHECKPOINT_HEAD.unpack_from(data)
    if magic != _CHECKPOINT_MAGIC:
        raise CatalogFormatError("not a catalog checkpoint")
    if version != CHECKPOINT_VERSION or flags:
        raise CatalogFormatError(f"checkpoint version {version} (flags {flags}): not this one")
    if count > limits.max_entries:
        raise CatalogFormatError(f"{count} entries, past the bound of {limits.max_entries}")
    if names_len > count * (MAX_NAME + 1):
        raise CatalogFormatError("names longer than that many block names")
    end = head_size + 8 * count + names_len
    if len(data) != end + _SUM.size:
        raise CatalogFormatError(f"{len(data)} bytes where {end + _SUM.size} were announced")
    (stored,) = _SUM.unpack_from(data, end)
    if xxhash.xxh3_64_intdigest(memoryview(data)[:end]) != stored:
        raise CatalogFormatError("checkpoint checksum mismatch")
    sizes = _u64s(memoryview(data)[head_size : head_size + 8 * count])
    _check_sizes(sizes)
    names = data[head_size + 8 * count : end]
    if names.translate(None, _NAME_BYTES):
        raise CatalogFormatError("a name holds a character no block name has")
    return RawCheckpoint(generation, count, names, sizes)


# -- log ---------------------------------------------------------------------------------------


def encode_log_header(generation: int) -> bytes:
    head = _LOG_HEAD.pack(_LOG_MAGIC, CHECKPOINT_VERSION, 0, generation, 0)[: -_SUM.size]
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def decode_log_header(data: bytes) -> int:
    """The generation a log's header names; ``CatalogFormatError`` for anything else."""
    if len(data) < _LOG_HEAD.size:
        raise CatalogFormatError("shorter than a log's header")
    magic, version, flags, generation, stored = _LOG_HEAD.unpack_from(data)
    if magic != _LOG_MAGIC:
        raise CatalogFormatError("not a catalog log")
    if version != CHECKPOINT_VERSION or flags:
        raise CatalogFormatError(f"log version {version} (flags {flags}): not this one")
    if xxhash.xxh3_64_intdigest(data[: _LOG_HEAD.size - _SUM.size]) != stored:
        raise CatalogFormatError("log header checksum mismatch")
    return int(generation)


def encode_frame(
    generation: int, ops: bytes, names: Sequence[str], sizes: array.array[int]
) -> bytes:
    """One frame of at most ``MAX_FRAME_CHANGES`` changes."""
    count = len(ops)
    assert count == len(names) == len(sizes) and 0 < count <= MAX_FRAME_CHANGES
    blob = _join(names)
    lengths = struct.pack("<II", count, len(blob))
    body = b"".join((ops, _le(sizes), blob))
    checksum = xxhash.xxh3_64_intdigest(lengths + body, seed=generation)
    return b"".join((lengths, _SUM.pack(checksum), body))


def decode_frames(
    data: bytes, offset: int, generation: int, max_changes: int
) -> tuple[list[Frame], int]:
    """The good frames of a log from ``offset`` on, and where the last good one ends: the
    first frame that is torn, damaged, of another log or past ``max_changes`` in all ends
    the log there (what follows it was never acknowledged as a whole)."""
    frames: list[Frame] = []
    changes = 0
    view = memoryview(data)
    head = _FRAME_HEAD.size
    while offset + head <= len(data):
        count, names_len, stored = _FRAME_HEAD.unpack_from(data, offset)
        if not 0 < count <= MAX_FRAME_CHANGES or names_len > count * (MAX_NAME + 1):
            break
        if changes + count > max_changes:
            break
        start = offset + head
        end = start + 9 * count + names_len
        if end > len(data):
            break
        lengths = view[offset : offset + 8]
        hasher = xxhash.xxh3_64(seed=generation)
        hasher.update(lengths)
        hasher.update(view[start:end])
        if hasher.intdigest() != stored:
            break
        try:
            frame = _frame(data, start, count, names_len)
        except CatalogFormatError:
            break
        frames.append(frame)
        changes += count
        offset = end
    return frames, offset


def _frame(data: bytes, start: int, count: int, names_len: int) -> Frame:
    ops = data[start : start + count]
    if ops.translate(None, _OPS):
        raise CatalogFormatError("an unknown change")
    sizes = _u64s(memoryview(data)[start + count : start + 9 * count])
    _check_sizes(sizes)
    names_start = start + 9 * count
    names = _names(data[names_start : names_start + names_len], count)
    return Frame(ops, names, sizes)
