"""The packed key table behind the S3 tier's existence index: a model check against a plain
dict, the order a full index evicts in, compaction, and the memory it costs per key."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index import ExistenceIndex
from kvtier.tiers.s3.index._journal_format import writer_id
from kvtier.tiers.s3.index._keytable import CHUNK_ROWS, KeyTable


def _location(rng: random.Random) -> Location | None:
    if rng.random() < 0.5:
        return None
    return Location(f"p/_kvtier_packs/00/{rng.randrange(40):02x}", rng.randrange(2**64), 4200)


@pytest.mark.parametrize(
    ("widths", "max_keys"), [((32,), 10**7), ((16,), 500), ((3, 16, 32), 10**4)]
)
def test_the_table_behaves_as_a_dict(widths: tuple[int, ...], max_keys: int) -> None:
    rng = random.Random(sum(widths) + max_keys)
    table = KeyTable(max_keys)
    model: dict[bytes, Location | None] = {}
    pool = [rng.randbytes(rng.choice(widths)) for _ in range(2_000)]
    for _ in range(40_000):
        key, op = rng.choice(pool), rng.random()
        if op < 0.5:
            if key not in model:
                model[key] = where = _location(rng)
                assert table.put(key, where) == -1
            else:
                model[key] = where = _location(rng)
                table.set_location(table.find(key), where)
        elif op < 0.85:
            present = key in model
            model.pop(key, None)
            assert table.remove(key) is present
        elif op < 0.9:
            oldest = table.pop_oldest()
            assert (oldest is None) is (not model)  # the order: tested below, without churn
            if oldest is not None:
                del model[oldest]
        else:
            assert (key in table) is (key in model)
            assert table.location(key) == model.get(key)
    assert len(table) == len(model)
    assert dict(table.entries_reader()()) == model
    assert sorted(table.keys()) == sorted(model)
    # Pack names are shared by their keys and forgotten with the last of them.
    assert {loc.pack for loc in model.values() if loc} == set(table._pack_ids)


def test_a_key_removed_and_added_again_is_the_newest() -> None:
    table = KeyTable(100)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    for key in (a, b, c):
        table.put(key, None)
    table.remove(a)
    table.put(a, None)
    assert [table.pop_oldest() for _ in range(4)] == [b, c, a, None]


def test_the_oldest_key_goes_first_without_churn() -> None:
    table = KeyTable(10**6)
    keys = [i.to_bytes(16, "big") for i in range(2 * CHUNK_ROWS + 5)]
    for key in keys:
        table.put(key, None)
    for key in keys[1::2]:  # half of each chunk: not sparse enough to move
        table.remove(key)
    assert [table.pop_oldest() for _ in range(CHUNK_ROWS + 3)] == keys[0 : 2 * CHUNK_ROWS + 5 : 2]


def test_the_few_keys_left_in_a_chunk_become_the_newest() -> None:
    table = KeyTable(10**6)
    keys = [i.to_bytes(16, "big") for i in range(CHUNK_ROWS + 1)]  # a chunk, one key after
    for key in keys:
        table.put(key, None)
    for key in keys[: CHUNK_ROWS - 10]:
        table.remove(key)
    assert len(table._chunks) == 1  # the first one, dropped: its last ten moved
    assert list(table.keys()) == [keys[CHUNK_ROWS], *keys[CHUNK_ROWS - 10 : CHUNK_ROWS]]


def test_dead_rows_are_compacted_in_order_and_empty_chunks_dropped() -> None:
    table = KeyTable(10**6)
    keys = [i.to_bytes(16, "big") for i in range(3 * CHUNK_ROWS)]
    for key in keys:
        table.put(key, Location("p/_kvtier_packs/00/ab", 0, 10))
    for key in keys[:CHUNK_ROWS]:  # the first chunk, all of it: dropped
        table.remove(key)
    for key in keys[CHUNK_ROWS : 2 * CHUNK_ROWS : 4]:  # three in four kept: not compacted
        table.remove(key)
    for key in keys[CHUNK_ROWS + 1 : 2 * CHUNK_ROWS : 2]:  # one in four kept: compacted
        table.remove(key)
    rows = sum(len(chunk.alive) for chunk in table._chunks.values())
    kept = keys[CHUNK_ROWS + 2 : 2 * CHUNK_ROWS : 4] + keys[2 * CHUNK_ROWS :]
    assert len(table) == len(kept) and rows < len(kept) + CHUNK_ROWS // 2
    assert list(table.keys()) == kept
    assert all(table.location(key) == Location("p/_kvtier_packs/00/ab", 0, 10) for key in kept)


def test_a_full_index_turning_over_keeps_its_memory_bounded() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=1000)
    rng = random.Random(3)
    kept = [rng.randbytes(16) for _ in range(3 * CHUNK_ROWS)]
    for i, key in enumerate(kept):
        index.add(key)
        if i % 3:
            index.discard(key)  # found gone: holes all over the chunks
    assert 990 <= len(index) <= 1000 and index.evictions > CHUNK_ROWS // 2
    table = index._table
    rows = sum(len(chunk.alive) for chunk in table._chunks.values())
    assert rows <= 2 * len(index) + CHUNK_ROWS
    assert len(table._chunks) <= 3 and sum(table._used) == len(index)


def test_an_indexed_key_costs_at_most_128_bytes() -> None:
    """Traced memory of an index of 10^5 packed 32-byte keys (the longer of the usual two),
    8 per pack as the default packs hold, named as a writer names them, built as a load
    builds it: entries decoded, indexed, then dropped (the pack names the index keeps
    count; the keys' ``bytes`` objects go with the entries)."""
    n, width = 100_000, 32
    rng = random.Random(width)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = ExistenceIndex(miss_ttl=1.0, max_keys=10_000_000)
        writer = writer_id()
        packs = [pack_name("t/prefix", rng.randbytes(width), writer, i) for i in range(n // 8)]
        entries = [
            (rng.randbytes(width), Location(packs[i // 8], i % 8 * 4200, 4200)) for i in range(n)
        ]
        index.add_many(entries)
        del entries, packs  # what stays is the index's own
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == n
    assert grown / n <= 128, f"{grown / n:.1f} bytes per key"
