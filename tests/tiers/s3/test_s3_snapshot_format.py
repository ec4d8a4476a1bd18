"""The index snapshot format (``kvtier.tiers.s3.index._snapshot_format``): names and bytes read
from an untrusted bucket are parsed exactly, and whatever a snapshot holds is refused whole or read
within its bounds."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import IntegrityKey
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index import _snapshot_format
from kvtier.tiers.s3.index._snapshot_format import (
    BodyDecoder,
    Manifest,
    SnapshotError,
    body_digest,
    claim_name,
    data_name,
    decode_body,
    decode_manifest,
    encode_body,
    encode_manifest,
    manifest_name,
    parse_name,
    snapshot_dir,
)
from tests.support import fresh_keys

PREFIX = "fleet/model"
WRITER = "0123456789abcdef"


def _manifest(body: bytes, generation: int = 3) -> Manifest:
    return Manifest(generation, 1_700_000_000_000, len(body), body_digest(body), WRITER)


def test_names_parse_back_and_nothing_else_does() -> None:
    claim = parse_name(claim_name(PREFIX, 7), PREFIX)
    assert claim is not None and (claim.kind, claim.generation, claim.writer) == ("claim", 7, None)
    parsed = parse_name(data_name(PREFIX, 7, WRITER), PREFIX)
    assert parsed is not None and (parsed.kind, parsed.generation, parsed.writer) == (
        "data",
        7,
        WRITER,
    )
    gen = parse_name(manifest_name(PREFIX, 12), PREFIX)
    assert gen is not None and (gen.kind, gen.generation, gen.writer) == ("gen", 12, None)
    folder = snapshot_dir(PREFIX)
    for name in (
        manifest_name("other", 1),  # another prefix
        f"{folder}gen-1",  # not 12 digits
        f"{folder}gen-000000000001-{WRITER}",  # a manifest has no writer
        f"{folder}data-000000000001",  # a body has one
        f"{folder}x/gen-000000000001",  # nested
        f"{folder}gen-000000000001/../x",
    ):
        assert parse_name(name, PREFIX) is None, name


@pytest.mark.parametrize("key", [None, IntegrityKey(b"k" * 32)])
def test_a_snapshot_round_trips_and_any_change_is_refused(key: IntegrityKey | None) -> None:
    keys = fresh_keys(40)
    pack = pack_name(PREFIX, keys[0], WRITER, 1)
    entries: list[tuple[bytes, Location | None]] = [
        (k, Location(pack, 4096 + 100 * i, 100) if i % 2 else None) for i, k in enumerate(keys)
    ]
    body = encode_body(entries, PREFIX, integrity_key=key)
    manifest = _manifest(body)
    encoded = encode_manifest(manifest, PREFIX, integrity_key=key)
    assert decode_manifest(encoded, PREFIX, 3, integrity_key=key) == manifest
    assert decode_body(body, PREFIX, manifest, integrity_key=key) == (entries, 0)
    with pytest.raises(SnapshotError):
        decode_manifest(encoded, PREFIX, 4, integrity_key=key)  # published under another name
    flipped = body[:-3] + bytes([body[-3] ^ 1]) + body[-2:]
    with pytest.raises(SnapshotError):
        decode_body(flipped, PREFIX, manifest, integrity_key=key)
    with pytest.raises(SnapshotError):  # the body checks out, but under its own digest
        decode_body(flipped, PREFIX, _manifest(flipped), integrity_key=key)
    other = IntegrityKey(b"o" * 32)
    with pytest.raises(SnapshotError):
        decode_manifest(encoded, PREFIX, 3, integrity_key=other)


def test_a_chunk_claiming_more_than_the_body_holds_is_refused() -> None:
    body = encode_body([(k, None) for k in fresh_keys(3)], PREFIX)
    forged = body[:4] + struct.pack("<I", 1 << 31) + body[8:]
    with pytest.raises(SnapshotError):
        decode_body(forged, PREFIX, _manifest(forged))


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_snapshot_error(data: bytes) -> None:
    for attempt in (
        lambda: decode_manifest(data, PREFIX, 1),
        lambda: decode_body(data, PREFIX, _manifest(data)),
        lambda: decode_body(b"KVB1" + data, PREFIX, _manifest(b"KVB1" + data)),
    ):
        try:
            attempt()
        except SnapshotError:
            pass


def _streamed(
    body: bytes, manifest: Manifest, piece: int, key: IntegrityKey | None = None
) -> Iterator[list[tuple[bytes, Location | None]]]:
    """What a ``BodyDecoder`` returns for ``body`` fed ``piece`` bytes at a time, then
    finished (an empty list for the finish)."""
    decoder = BodyDecoder(PREFIX, manifest, integrity_key=key)
    for start in range(0, len(body), piece):
        yield decoder.feed(body[start : start + piece])
    decoder.finish()
    yield []


@pytest.mark.parametrize("key", [None, IntegrityKey(b"k" * 32)])
@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_a_body_decoded_as_it_arrives_gives_each_chunk_once_it_is_whole(
    monkeypatch: pytest.MonkeyPatch, key: IntegrityKey | None, piece: int
) -> None:
    monkeypatch.setattr(_snapshot_format, "MAX_SEGMENT_ENTRIES", 8)  # chunks of 8 entries
    keys = fresh_keys(30)
    pack = pack_name(PREFIX, keys[0], WRITER, 1)
    entries: list[tuple[bytes, Location | None]] = [
        (k, Location(pack, 4096 + 100 * i, 100) if i % 3 else None) for i, k in enumerate(keys)
    ]
    body = encode_body(entries, PREFIX, integrity_key=key)
    got = list(_streamed(body, _manifest(body), piece, key))
    assert [e for batch in got for e in batch] == entries
    assert all(len(batch) % 8 == 0 or batch[-1:] == entries[-1:] for batch in got)
    given = [i for i, batch in enumerate(got) if batch]
    if piece >= len(body):
        assert len(given) == 1  # all of it at once
    else:  # the first chunk long before the rest of the body arrived
        assert got[0] == [] and given[0] < len(got) // 2


def test_a_body_decoded_as_it_arrives_is_refused_as_a_whole_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bad chunk stops the decoder there (the chunks before it were given: each checks out
    alone); a body longer or shorter than its manifest, or not matching its digest, is refused
    at the first byte past its length or at the finish."""
    monkeypatch.setattr(_snapshot_format, "MAX_SEGMENT_ENTRIES", 4)
    entries: list[tuple[bytes, Location | None]] = [(k, None) for k in fresh_keys(12)]
    body = encode_body(entries, PREFIX)
    flipped = body[:-3] + bytes([body[-3] ^ 1]) + body[-2:]  # in the last chunk
    decoder = BodyDecoder(PREFIX, _manifest(flipped))
    given = decoder.feed(flipped[: len(flipped) // 2])
    with pytest.raises(SnapshotError):
        decoder.feed(flipped[len(flipped) // 2 :])
    assert given and given == entries[: len(given)]
    for wrong in (body + b"x", body[:-1], flipped):
        with pytest.raises(SnapshotError):
            list(_streamed(wrong, _manifest(body), 64))
    with pytest.raises(SnapshotError):
        list(_streamed(b"KVB", _manifest(b"KVB"), 64))  # shorter than the magic


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=64))
def test_any_bytes_decoded_as_they_arrive_decode_or_raise_snapshot_error(
    data: bytes, piece: int
) -> None:
    for body in (data, b"KVB1" + data):
        try:
            list(_streamed(body, _manifest(body), piece))
        except SnapshotError:
            pass
