"""The S3 tier's existence index, journal and pack formats, without a server (pure state
machines)."""

from __future__ import annotations

import os

import pytest

from kvtier._errors import InvalidArgumentError
from kvtier._lookup import LookupResult, MissReason
from kvtier.tiers._s3 import S3Tier
from kvtier.tiers._s3_index import ExistenceIndex, key_from_object
from kvtier.tiers._s3_journal import (
    SegmentError,
    decode_segment,
    encode_segment,
    segment_name,
    segment_time_ms,
    segment_writer,
    start_after,
)
from kvtier.tiers._s3_pack import (
    Location,
    PackTableError,
    decode_table,
    encode_table,
    is_pack_name,
    pack_name,
    table_length,
    table_size,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unknown_key_is_a_miss_and_known_a_hit() -> None:
    index = ExistenceIndex(miss_ttl=2.0, max_keys=10)
    key = os.urandom(16)
    assert index.lookup(key) is LookupResult.MISS
    index.wrote(key)
    assert index.lookup(key) is LookupResult.HIT
    assert index.take_unpublished() == [(key, None)]
    assert index.take_unpublished() == []
    stats = index.statistics()
    assert (stats.hits, stats.misses, stats.misses_by_reason) == (1, 1, {"not_found": 1})


def test_failed_load_suppresses_for_the_ttl_and_gone_object_is_dropped() -> None:
    clock = Clock()
    index = ExistenceIndex(miss_ttl=2.0, max_keys=10, clock=clock)
    a, b = os.urandom(16), os.urandom(16)
    index.add_many([(a, None), (b, None)])
    index.suppress(a, MissReason.TIMEOUT)
    assert index.lookup(a) is LookupResult.MISS  # no promotion loop on a flaky key
    clock.now += 2.5
    assert index.lookup(a) is LookupResult.HIT
    index.suppress(b, MissReason.NOT_FOUND)  # an index HIT whose GET found nothing
    assert b not in index
    assert index.lookup(b) is LookupResult.MISS


def test_max_keys_bounds_memory() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=2)
    keys = [os.urandom(16) for _ in range(3)]
    assert index.add_many([(key, None) for key in keys]) == keys
    assert index.full and len(index) == 2 and index.evictions == 1


def test_requeue_after_a_failed_publish() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    keys = [os.urandom(16) for _ in range(3)]
    for key in keys:
        index.wrote(key)
    taken = index.take_unpublished()
    index.requeue(taken)
    assert index.take_unpublished() == [(key, None) for key in keys]


def test_seen_segments_are_forgotten_past_the_lookback() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    index.seen("old", 1_000)
    index.seen("new", 5_000)
    assert index.unseen(["old", "new", "other"]) == ["other"]
    index.forget_seen_before(2_000)
    assert index.unseen(["old", "new"]) == ["old"]


def test_segment_round_trip_and_damage() -> None:
    entries: list[tuple[bytes, Location | None]] = [(os.urandom(n), None) for n in (16, 32, 255)]
    data = encode_segment(entries, "p")
    assert data[:4] == b"KVJ1"  # nothing packed: readable by kvtier before packs
    assert decode_segment(data, "p") == (entries, 0)
    assert decode_segment(encode_segment([], "p"), "p") == ([], 0)
    where = Location(pack_name("p", bytes(16), "0123456789abcdef", 1), 300, 262_200)
    packed = [*entries, (os.urandom(16), where)]
    assert encode_segment(packed, "p")[:4] == b"KVJ2"
    assert decode_segment(encode_segment(packed, "p"), "p") == (packed, 0)
    flipped = bytearray(data)
    flipped[10] ^= 1
    for bad in (bytes(flipped), data[:-3], b"", b"XXXX" + data[4:]):
        with pytest.raises(SegmentError):
            decode_segment(bad, "p")


def test_segment_names_sort_by_time_and_parse() -> None:
    first = segment_name("p", 1_700_000_000_000, "0123456789abcdef", 1)
    later = segment_name("p", 1_700_000_000_001, "0000000000000000", 9)
    assert first < later
    assert start_after("p", 1_700_000_000_000) < first
    assert segment_time_ms(first) == 1_700_000_000_000
    assert segment_writer(first) == "0123456789abcdef"
    assert segment_time_ms("p/_kvtier_journal/junk") is None
    assert segment_name("", 5, "0123456789abcdef", 1).startswith("_kvtier_journal/")


def test_object_names_map_back_to_keys() -> None:
    key = os.urandom(16)
    hexkey = key.hex()
    assert key_from_object(f"pre/fix/{hexkey[:2]}/{hexkey}", "pre/fix") == key
    assert key_from_object(f"{hexkey[:2]}/{hexkey}", "") == key
    assert key_from_object(f"other/{hexkey[:2]}/{hexkey}", "pre") is None
    assert key_from_object(f"pre/zz/{hexkey}", "pre") is None
    assert key_from_object("pre/_kvtier_journal/000-abc-1", "pre") is None
    assert key_from_object(f"pre/{hexkey[:2]}/{hexkey[:-1]}x", "pre") is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lookup_mode": "sometimes"}, "lookup_mode must be 'index'"),
        ({"index_refresh": 0}, "index_refresh"),
        ({"index_refresh": 10.0, "index_lookback": 15.0}, "index_lookback"),
        ({"index_max_keys": 0}, "index_max_keys"),
    ],
)
def test_index_settings_are_checked(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        S3Tier("bucket", **overrides)  # type: ignore[arg-type]


def test_index_settings_from_the_config_file() -> None:
    from kvtier._config import KVTierConfig

    pool = {"num_blocks": 4, "block_bytes": 4096}
    config = KVTierConfig.from_dict(
        {"pool": pool, "s3": {"bucket": "abc", "lookup_mode": "ask", "index_refresh": 1.0}}
    )
    (tier,) = config.build_tiers()
    assert isinstance(tier, S3Tier)
    assert (tier.settings.lookup_mode, tier.settings.index_refresh) == ("ask", 1.0)
    with pytest.raises(InvalidArgumentError, match="index_lookback"):
        KVTierConfig.from_dict({"pool": pool, "s3": {"bucket": "abc", "index_refresh": 40.0}})


def test_packed_keys_keep_their_location_until_dropped() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    a, b = os.urandom(16), os.urandom(16)
    where = Location("p/_kvtier_packs/ab/x-y-1", 100, 50)
    index.wrote(a, where)
    index.add(b)
    assert (index.location(a), index.location(b)) == (where, None)
    assert index.take_unpublished() == [(a, where)]
    index.add(a)  # its own object listed too: reading it from the pack stays cheaper
    assert index.location(a) == where
    index.suppress(a, MissReason.NOT_FOUND)  # the pack is gone
    assert a not in index and index.location(a) is None


def test_pack_table_round_trip_and_damage() -> None:
    keys = [os.urandom(16) for _ in range(3)]
    lengths = [262_200, 262_200, 1000]
    table = encode_table(keys, lengths)
    assert len(table) == table_length(3, 16) and table_size(table[:12]) == len(table)
    found = decode_table(table + b"sections", "p/pack")
    assert [k for k, _ in found] == keys
    assert [w.offset for _, w in found] == [len(table), len(table) + 262_200, len(table) + 524_400]
    assert all(
        w.pack == "p/pack" and w.length == n for (_, w), n in zip(found, lengths, strict=True)
    )
    flipped = bytearray(table)
    flipped[20] ^= 1
    for bad in (bytes(flipped), table[:-3], b"", b"XXXX" + table[4:]):
        with pytest.raises(PackTableError):
            decode_table(bad, "p/pack")


def test_pack_names_are_unique_per_writer_and_apart_from_blocks() -> None:
    key = bytes(range(16))
    first = pack_name("p", key, "0123456789abcdef", 1)
    assert first != pack_name("p", key, "0123456789abcdef", 2)
    assert first.startswith("p/_kvtier_packs/0f/" + key.hex())
    assert is_pack_name(first, "p") and not is_pack_name("p/01/" + key.hex(), "p")
    assert key_from_object(first, "p") is None  # never listed as a block object
