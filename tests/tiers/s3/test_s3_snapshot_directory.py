"""A snapshot body's directory (``kvtier.tiers.s3.index._snapshot_directory``): a sorted body
whose chunks can be fetched one by one, and a directory read from an untrusted bucket that is
used only when it names exactly that body."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier import IntegrityKey
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index import _snapshot_directory as directory_format
from kvtier.tiers.s3.index._snapshot_directory import (
    Directory,
    check_chunk,
    decode_directory,
    encode_sorted_body,
)
from kvtier.tiers.s3.index._snapshot_format import (
    Manifest,
    SnapshotError,
    body_digest,
    decode_body,
    decode_chunk,
    directory_name,
    parse_name,
)
from tests.support import fresh_keys

PREFIX = "fleet/model"
WRITER = "0123456789abcdef"


def _manifest(body: bytes) -> Manifest:
    return Manifest(3, 1_700_000_000_000, len(body), body_digest(body), WRITER)


def _entries(count: int) -> list[tuple[bytes, Location | None]]:
    """``count`` keys, every other one in a pack."""
    pack = pack_name(PREFIX, b"\x01" * 16, WRITER, 1)
    return [
        (key, Location(pack, 1000 + 100 * i, 100) if i % 2 else None)
        for i, key in enumerate(fresh_keys(count))
    ]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directory_format, "SORTED_CHUNK_ENTRIES", 4)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("key", [None, IntegrityKey(b"k" * 32)])
def test_each_key_is_found_in_the_one_chunk_its_directory_names(key: IntegrityKey | None) -> None:
    entries = _entries(11)
    body, table = encode_sorted_body(entries, PREFIX, integrity_key=key)
    manifest = _manifest(body)
    directory = decode_directory(table, manifest)
    assert len(directory) == 3  # 4 + 4 + 3
    # The body is still a body an older reader takes whole, in key order.
    whole, rejected = decode_body(body, PREFIX, manifest, integrity_key=key)
    assert whole == sorted(entries) and rejected == 0
    for wanted, where in entries:
        i = directory.chunk_of(wanted)
        lo, hi = directory.offsets[i], directory.offsets[i] + directory.lengths[i]
        chunk, _ = decode_chunk(body[lo:hi], PREFIX, integrity_key=key)
        check_chunk(chunk, directory, i)
        assert (wanted, where) in chunk
    # A key outside every chunk's range is in no chunk; one between two ranges neither.
    assert directory.chunk_of(b"\x00") == -1 and directory.chunk_of(b"\xff" * 16) == -1
    between = directory.lasts[0] + b"\x00"
    assert between < directory.firsts[1] and directory.chunk_of(between) == -1


def test_an_empty_index_has_an_empty_directory() -> None:
    body, table = encode_sorted_body([], PREFIX)
    directory = decode_directory(table, _manifest(body))
    assert len(directory) == 0 and directory.chunk_of(b"\x01" * 16) == -1


def _signed(table: bytes) -> bytes:
    return table + struct.pack("<Q", xxhash.xxh3_64_intdigest(table))


@pytest.mark.usefixtures("small_chunks")
def test_a_directory_of_another_body_or_that_does_not_tile_it_is_refused() -> None:
    body, table = encode_sorted_body(_entries(9), PREFIX)
    manifest = _manifest(body)
    raw = table[:-8]
    other, _ = encode_sorted_body(_entries(9), PREFIX)
    head = struct.Struct("<4sI16s")
    magic, count, _digest = head.unpack_from(raw)
    first_span = head.size  # the first chunk's offset (u64) and length (u32)
    offset, length = struct.unpack_from("<QI", raw, first_span)
    cases = {
        "checksum": table[:-1] + bytes([table[-1] ^ 1]),
        "another body": _signed(head.pack(magic, count, body_digest(other)) + raw[head.size :]),
        "gap": _signed(
            raw[:first_span] + struct.pack("<QI", offset + 1, length) + raw[first_span + 12 :]
        ),
        "short": _signed(
            raw[:first_span] + struct.pack("<QI", offset, length - 1) + raw[first_span + 12 :]
        ),
        "count": _signed(head.pack(magic, count + 1, _digest) + raw[head.size :]),
        "trailing": _signed(raw + b"\x00"),
        "magic": _signed(b"KVD0" + raw[4:]),
    }
    for why, forged in cases.items():
        with pytest.raises(SnapshotError):
            decode_directory(forged, manifest)
        assert why


def test_unsorted_or_overlapping_ranges_are_refused() -> None:
    body, _ = encode_sorted_body(_entries(2), PREFIX)
    manifest = _manifest(body)
    half = (len(body) - 4) // 2
    a, b = sorted(fresh_keys(2))

    def table(ranges: list[tuple[bytes, bytes]]) -> bytes:
        spans = [(4, half), (4 + half, len(body) - 4 - half)]
        parts = [struct.pack("<4sI16s", b"KVD1", 2, body_digest(body))]
        for (offset, length), (first, last) in zip(spans, ranges, strict=True):
            parts.append(struct.pack("<QI", offset, length))
            parts.append(bytes([len(first)]) + first + bytes([len(last)]) + last)
        return _signed(b"".join(parts))

    assert len(decode_directory(table([(a, a), (b, b)]), manifest)) == 2
    for ranges in ([(b, b), (a, a)], [(a, b), (b, b)], [(b, a), (b, b)]):
        with pytest.raises(SnapshotError):
            decode_directory(table(ranges), manifest)


@pytest.mark.usefixtures("small_chunks")
def test_a_chunk_with_keys_outside_its_range_is_refused() -> None:
    body, table = encode_sorted_body(_entries(8), PREFIX)
    directory = decode_directory(table, _manifest(body))
    lo, hi = directory.offsets[1], directory.offsets[1] + directory.lengths[1]
    second, _ = decode_chunk(body[lo:hi], PREFIX)
    check_chunk(second, directory, 1)
    with pytest.raises(SnapshotError):
        check_chunk(second, directory, 0)  # the right bytes, fetched for the wrong range
    with pytest.raises(SnapshotError):
        decode_chunk(body[lo : hi - 1], PREFIX)  # not the whole chunk


def test_directory_names_parse_back() -> None:
    parsed = parse_name(directory_name(PREFIX, 7, WRITER), PREFIX)
    assert parsed is not None and (parsed.kind, parsed.generation, parsed.writer) == (
        "dir",
        7,
        WRITER,
    )
    assert parse_name(directory_name(PREFIX, 7, WRITER).rsplit("-", 1)[0], PREFIX) is None


@given(st.binary(max_size=400))
def test_any_bytes_decode_as_a_directory_or_chunk_or_raise_snapshot_error(data: bytes) -> None:
    body, _ = encode_sorted_body(_entries(3), PREFIX)
    for attempt in (
        lambda: decode_directory(data, _manifest(body)),
        lambda: decode_directory(b"KVD1" + data, _manifest(body)),
        lambda: decode_chunk(data, PREFIX),
    ):
        try:
            attempt()
        except SnapshotError:
            pass


def test_chunk_of_compares_keys_as_bytes() -> None:
    directory = Directory([4], [10], [b"a"], [b"b"])
    assert directory.chunk_of(b"a") == 0 and directory.chunk_of(b"ab") == 0
    assert directory.chunk_of(b"c") == -1
