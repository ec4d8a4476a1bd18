"""The S3 tier reads a bucket that others can write: journal segments and pack tables are
untrusted input. Hypothesis feeds random and mutated ones to the parsers, to the coalesced
pack reads and (a few examples) to a tier reading a real SeaweedFS, and checks that the reader
never raises into its caller, never reads more than a block's section for a block, never
deletes or overwrites an object, and never serves a byte that is not the stored block."""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from devtools.weed_server import (
    BUCKET,
    WeedServer,
    raw_client,
)
from kvtier._errors import KVTierError
from kvtier._format import MAX_KEY_BYTES, IntegrityKey, header_size
from kvtier._keys import block_keys
from kvtier._lookup import LookupResult
from kvtier.tiers.s3._config import MAX_PACK_BLOCKS
from kvtier.tiers.s3._journal import (
    MAX_SEGMENT_ENTRIES,
    SegmentError,
    decode_segment,
    encode_segment,
)
from kvtier.tiers.s3._pack import (
    MAX_TABLE_BYTES,
    Location,
    PackTableError,
    decode_table,
    encode_table,
    is_pack_name,
    pack_name,
    table_size,
)
from kvtier.tiers.s3._packs import PackReads
from tests.support import s3_tier
from tests.tiers.s3.s3_forge import forged_segment, forged_segment_name

BLOCK = 4096
PREFIX = "u/p"
KEY = IntegrityKey("correct horse battery staple 0123456789")
SECTION = header_size(16) + BLOCK

FAST = settings(max_examples=150, deadline=None)

_WRITER = "0123456789abcdef"
_NAMES = [
    "",  # the key's own block object
    pack_name(PREFIX, bytes(16), _WRITER, 1),
    pack_name(PREFIX, b"\xab" * 32, _WRITER, 99),
    pack_name("u/q", bytes(16), _WRITER, 1),  # another prefix's pack
    f"{PREFIX}/_kvtier_integrity.json",
    f"{PREFIX}/_kvtier_packs/../_kvtier_integrity.json",
    f"{PREFIX}/_kvtier_packs/00/../../../models/llama.bin",
    f"{PREFIX}/ab/{'ab' * 16}",  # a block object
    "models/llama.bin",
]
names = st.one_of(st.sampled_from(_NAMES), st.text(max_size=40))
offsets = st.one_of(st.sampled_from([0, 38, 39, 400, 2**62]), st.integers(0, 2**64 - 1))
lengths = st.one_of(st.just(SECTION), st.integers(0, 2**64 - 1))
entry = st.tuples(st.binary(max_size=MAX_KEY_BYTES + 10), names, offsets, lengths)
flips = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=3)


def _mutate(data: bytes, flipped: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for at, bits in flipped:
        if out:
            out[at % len(out)] ^= bits
    return bytes(out if cut is None else out[: cut % (len(out) + 1)])


def _assert_usable(entries: list[tuple[bytes, Location | None]], prefix: str) -> None:
    """What a reader takes from a segment: keys a tier accepts, sections of its own packs."""
    assert len(entries) <= MAX_SEGMENT_ENTRIES
    for key, where in entries:
        assert 1 <= len(key) <= MAX_KEY_BYTES
        if where is not None:
            assert is_pack_name(where.pack, prefix), where.pack
            assert where.offset > 0 and where.length > 0


# -- the parsers ---------------------------------------------------------------------------


@FAST
@given(
    data=st.binary(max_size=4096),
    signed=st.booleans(),
    magic=st.sampled_from(["", "J1", "J2", "J3"]),
)
def test_random_bytes_are_refused_or_name_only_this_prefix(
    data: bytes, signed: bool, magic: str
) -> None:
    if magic:
        data = b"KV" + magic.encode() + data
    try:
        entries, rejected = decode_segment(data, PREFIX, integrity_key=KEY if signed else None)
    except SegmentError:
        return
    assert not signed  # nobody forges a MAC by chance
    _assert_usable(entries, PREFIX)
    assert rejected >= 0


@FAST
@given(
    entries=st.lists(entry, max_size=12),
    signed=st.booleans(),
    flipped=flips,
    cut=st.none() | st.integers(0, 1 << 20),
)
def test_mutated_segments_never_name_anything_outside_the_prefix(
    entries: list[tuple[bytes, str, int, int]],
    signed: bool,
    flipped: list[tuple[int, int]],
    cut: int | None,
) -> None:
    if signed:
        located: list[tuple[bytes, Location | None]] = [
            (key, Location(name, offset, length) if name else None)
            for key, name, offset, length in entries
        ]
        original = encode_segment(located, PREFIX, integrity_key=KEY)
    else:
        original = forged_segment(entries)
    data = _mutate(original, flipped, cut)
    try:
        found, rejected = decode_segment(data, PREFIX, integrity_key=KEY if signed else None)
    except SegmentError:
        return
    assert not signed or data == original  # a signed segment survives no change
    _assert_usable(found, PREFIX)
    if data == original:
        assert len(found) + rejected == len(entries)
        for key, where in found:
            assert (key, where.pack if where else "") in {(k, n) for k, n, _, _ in entries}


tables = st.lists(
    st.tuples(st.binary(min_size=1, max_size=MAX_KEY_BYTES), st.integers(1, 1 << 40)),
    min_size=1,
    max_size=MAX_PACK_BLOCKS,
)


@FAST
@given(
    sections=tables,
    flipped=flips,
    cut=st.none() | st.integers(0, 1 << 20),
    junk=st.binary(max_size=64),
)
def test_pack_tables_are_refused_or_name_contiguous_sections(
    sections: list[tuple[bytes, int]],
    flipped: list[tuple[int, int]],
    cut: int | None,
    junk: bytes,
) -> None:
    name = pack_name(PREFIX, sections[0][0], _WRITER, 1)
    table = encode_table([k for k, _ in sections], [n for _, n in sections])
    for data in (_mutate(table, flipped, cut) + junk, junk):
        try:
            size = table_size(data)
            found = decode_table(data, name)
        except PackTableError:
            continue
        assert size <= MAX_TABLE_BYTES and len(found) <= MAX_PACK_BLOCKS
        expected = size
        for key, where in found:
            assert 1 <= len(key) <= MAX_KEY_BYTES and where.pack == name
            assert where.offset == expected and where.length > 0
            expected += where.length


# -- coalesced pack reads ------------------------------------------------------------------


def _byte_at(pack: int, position: int) -> int:
    return (position * 31 + pack * 7) % 251


@FAST
@given(
    wanted=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.one_of(st.integers(0, 4000), st.integers(2**40, 2**40 + 4000)),
            st.sampled_from([64, 64, 64, 65, 1]),
        ),
        min_size=1,
        max_size=16,
    )
)
def test_pack_reads_fetch_no_more_than_the_sections_they_serve(
    wanted: list[tuple[int, int, int]],
) -> None:
    locations = [Location(f"pack{p}", offset, length) for p, offset, length in wanted]
    budget = sum(where.length for where in locations)
    fetched: list[int] = []

    async def fetch(name: str, lo: int, hi: int) -> bytes | None:
        assert hi - lo <= budget  # checked before a single byte is made
        fetched.append(hi - lo)
        pack = int(name[-1])
        return bytes(_byte_at(pack, p) for p in range(lo, hi))

    async def main() -> dict[int, bytes | None]:
        reads = PackReads(fetch)
        got: dict[int, bytes | None] = {}

        async def load(i: int, where: Location) -> None:
            section = await reads.read(where)
            got[i] = None if section is None else bytes(section)

        async with anyio.create_task_group() as tg:
            for i, where in enumerate(locations):
                tg.start_soon(load, i, where)
        assert reads.bytes == sum(fetched)
        return got

    got = anyio.run(main)
    assert sum(fetched) <= budget
    for i, where in enumerate(locations):
        pack = int(where.pack[-1])
        span = range(where.offset, where.offset + where.length)
        assert got[i] == bytes(_byte_at(pack, p) for p in span)


# -- a tier reading a real bucket ----------------------------------------------------------


@dataclass
class Bucket:
    """What the module's SeaweedFS holds: this prefix's blocks (a pack of four and two plain
    objects), another prefix's block and pack, and files that are no block."""

    server: WeedServer
    prefix: str
    stored: dict[bytes, bytes]
    locations: list[Location]
    names: list[str]
    strangers: list[bytes]


# refreshed by the tests, not by the loop
_tier = functools.partial(s3_tier, index_refresh=100.0, index_lookback=1000.0)


async def _snapshot(server: WeedServer) -> dict[str, str]:
    """Every object but journal segments, with its ETag: what a reader must leave alone."""
    found: dict[str, str] = {}
    async with raw_client(server.endpoint_url) as client:
        kwargs: dict[str, Any] = {"Bucket": BUCKET}
        while True:
            page = await client.list_objects_v2(**kwargs)
            for item in page.get("Contents", ()):
                if "/_kvtier_journal/" not in item["Key"]:
                    found[item["Key"]] = item["ETag"]
            if not page.get("IsTruncated"):
                return found
            kwargs["ContinuationToken"] = page["NextContinuationToken"]


async def _fill(server: WeedServer) -> Bucket:
    prefix, other = f"u/{uuid.uuid4().hex}", f"u/{uuid.uuid4().hex}"
    keys = block_keys(list(range(4 * 8)), 4, namespace=os.urandom(8))
    stored = {key: os.urandom(BLOCK) for key in keys[:6]}
    theirs = block_keys(list(range(4 * 3)), 4, namespace=os.urandom(8))
    async with _tier(server, prefix) as writer, _tier(server, other) as neighbour:
        async with anyio.create_task_group() as tg:  # one pack
            for key in keys[:4]:
                tg.start_soon(writer.store, key, memoryview(stored[key]))
        for key in keys[4:6]:  # plain objects
            await writer.store(key, memoryview(stored[key]))
        await neighbour.store(theirs[0], memoryview(os.urandom(BLOCK)))
        async with anyio.create_task_group() as tg:
            for key in theirs[1:]:
                tg.start_soon(neighbour.store, key, memoryview(os.urandom(BLOCK)))
    async with raw_client(server.endpoint_url) as client:
        for name in (f"{prefix}/notes.bin", f"models/{uuid.uuid4().hex}.bin"):
            await client.put_object(Bucket=BUCKET, Key=name, Body=os.urandom(3 * BLOCK))
    objects = await _snapshot(server)
    (pack,) = [n for n in objects if n.startswith(f"{prefix}/_kvtier_packs/")]
    async with raw_client(server.endpoint_url) as client:
        response = await client.get_object(Bucket=BUCKET, Key=pack, Range="bytes=0-4095")
        locations = [where for _, where in decode_table(await response["Body"].read(), pack)]
    names = [*sorted(objects), "", f"{prefix}/_kvtier_packs/../notes.bin", "models/../x"]
    return Bucket(server, prefix, stored, locations, names, [*keys[6:], *theirs])


@pytest.fixture(scope="module")
def bucket(weed_server: WeedServer) -> Bucket:
    return anyio.run(_fill, weed_server)


@st.composite
def hostile_entries(draw: st.DrawFn, bucket: Bucket) -> list[tuple[bytes, str, int, int]]:
    """Entries a writer of the bucket may publish: known and unknown keys, pointed at this
    prefix's pack (right, shifted or oversized), at their own objects, or anywhere else."""
    keys = [*bucket.stored, *bucket.strangers]
    out = []
    for _ in range(draw(st.integers(1, 8))):
        key = draw(st.sampled_from(keys))
        where = draw(st.sampled_from(bucket.locations))
        name = draw(st.sampled_from([where.pack, where.pack, *bucket.names]))
        offset = where.offset + draw(st.sampled_from([0, 0, 1, -1, SECTION, -SECTION, 2**40]))
        length = draw(st.sampled_from([SECTION, SECTION, SECTION + 1, SECTION - 1, 2**40, 0]))
        out.append((key, name, max(offset, 0), length))
    return out


async def _read_through(bucket: Bucket, segment: bytes, seq: int) -> None:
    name = forged_segment_name(bucket.prefix, seq)
    before = await _snapshot(bucket.server)
    async with raw_client(bucket.server.endpoint_url) as client:
        await client.put_object(Bucket=BUCKET, Key=name, Body=segment)
    try:
        async with _tier(bucket.server, bucket.prefix) as reader:
            await reader.refresh_index()  # never raises
            keys = [*bucket.stored, *bucket.strangers]
            hits = [key for key in keys if reader.lookup(key) is LookupResult.HIT]
            out = {key: bytearray(BLOCK) for key in hits}
            served: list[bytes] = []

            async def load(key: bytes) -> None:
                try:
                    await reader.load(key, memoryview(out[key]))
                except KVTierError:
                    return  # a miss, as the contract says
                served.append(key)

            async with anyio.create_task_group() as tg:  # together: their GETs coalesce
                for key in hits:
                    tg.start_soon(load, key)
            for key in served:
                assert bytes(out[key]) == bucket.stored[key]  # a stranger is never served
            stats = reader.statistics()
            assert stats.pack_bytes_read <= len(hits) * SECTION
            assert stats.corrupt_deleted == 0
    finally:
        async with raw_client(bucket.server.endpoint_url) as client:
            await client.delete_object(Bucket=BUCKET, Key=name)
    assert await _snapshot(bucket.server) == before  # nothing deleted or overwritten


# No shrinking: a failing example may change the bucket the next ones read (that is what a
# failure here would be), so the first failure is reported as it was found.
@settings(
    max_examples=12,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data(), flipped=flips)
def test_a_tier_reading_hostile_segments_serves_only_stored_blocks(
    bucket: Bucket, data: st.DataObject, flipped: list[tuple[int, int]]
) -> None:
    entries = data.draw(hostile_entries(bucket))
    segment = forged_segment(entries)
    if flipped and data.draw(st.booleans()):
        segment = _mutate(segment, flipped, None)
    anyio.run(_read_through, bucket, segment, data.draw(st.integers(1, 10**6)))
