"""Building the FS catalog's packed index at once from a checkpoint's names, and its memory.

The bulk build reads untrusted bytes: it must give exactly the index the names and sizes
describe (as the catalog's ``OrderedDict`` of names did, a name listed twice included), and for
anything else only the format's own ``CatalogFormatError``. A ``Catalog`` read back at open
must cost at most 128 bytes per indexed block.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import OrderedDict

import numpy as np
import pytest

from kvtier.tiers.fs._catalog import Catalog
from kvtier.tiers.fs._catalog_format import CatalogFormatError
from kvtier.tiers.fs._idents import ident_of_key, ident_of_name, name_of_ident
from kvtier.tiers.fs._layout import is_block_name, name_of
from kvtier.tiers.fs._packed_build import from_blob, from_names, names_of, rebuilt, snapshot
from kvtier.tiers.fs._packed_table import layout


def names(rng: random.Random, n: int) -> list[str]:
    lengths = [1, 2, 16, 16, 32, 100, 101, 300]
    return [name_of(rng.randbytes(rng.choice(lengths))) for _ in range(n)]


def expected(listed: list[str], sizes: list[int]) -> list[tuple[str, int]]:
    return list(OrderedDict(zip(listed, sizes, strict=True)).items())


def built(listed: list[str], sizes: list[int]) -> list[tuple[str, int]]:
    blob = "\n".join(listed).encode()
    order = from_blob(blob, len(listed), np.array(sizes, dtype=np.uint64))
    return [(name_of_ident(i), size) for i, size in order.items()]


@pytest.mark.parametrize("seed", range(20))
def test_a_bulk_build_is_the_ordered_dict_of_the_names(seed: int) -> None:
    rng = random.Random(seed)
    listed = names(rng, rng.randrange(1, 400))
    listed += rng.choices(listed, k=rng.randrange(0, 5))  # listed twice: first place, last size
    rng.shuffle(listed)
    sizes = [rng.randrange(1 << 40) for _ in listed]
    assert built(listed, sizes) == expected(listed, sizes)


def test_columns_round_trip_and_give_the_names_back() -> None:
    listed = names(random.Random(1), 3000)
    order = from_names(listed, np.arange(len(listed), dtype=np.uint64))
    columns = snapshot(order)
    assert names_of(columns) == list(OrderedDict.fromkeys(listed))
    again = rebuilt(order)
    assert list(again.items()) == list(order.items())


def test_names_no_key_has_are_left_out_of_a_walk_and_refused_in_a_checkpoint() -> None:
    assert [name_of_ident(i) for i in from_names(["ab", "abc", "cd"], np.ones(3, np.uint64))] == [
        "ab",
        "cd",
    ]
    for bad in ["abc", "AB", "a", "", "h" + "0" * 63, "ahh0", "h" * 65, "0" * 202]:
        with pytest.raises(CatalogFormatError):
            built(["ab", bad, "cd"], [1, 2, 3])
    with pytest.raises(CatalogFormatError):
        from_blob(b"ab\ncd", 3, np.ones(3, np.uint64))
    with pytest.raises(CatalogFormatError):
        from_blob(b"ab\ncd", 2, np.ones(3, np.uint64))
    with pytest.raises(CatalogFormatError):
        from_blob(b"", 1, np.ones(1, np.uint64))
    with pytest.raises(CatalogFormatError):
        from_blob(b"ab\n", 1, np.ones(1, np.uint64))


def test_fuzzed_names_give_an_index_of_block_names_or_the_formats_error() -> None:
    """Random bytes over the name alphabet, and flips of valid blobs: an index whose every
    entry is a block name some key has, exactly as announced, or ``CatalogFormatError``."""
    rng = random.Random(5)
    valid = "\n".join(names(rng, 50)).encode()
    alphabet = b"0123456789abcdefh\n"
    for round_ in range(3000):
        if round_ % 2:
            blob = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))
        else:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.choice(alphabet)
            blob = bytes(data)
        count = blob.count(b"\n") + 1 + rng.choice([0, 0, 0, -1, 1])
        count = max(count, 0)
        try:
            order = from_blob(blob, count, np.ones(count, dtype=np.uint64))
        except CatalogFormatError:
            continue
        listed = blob.decode().split("\n") if count else []
        assert len(listed) == count
        assert all(is_block_name(n) and ident_of_name(n) is not None for n in listed)
        assert [name_of_ident(i) for i in order] == list(OrderedDict.fromkeys(listed))


def test_a_catalog_read_back_costs_at_most_128_bytes_a_block() -> None:
    """2x10^5 blocks of 16-byte keys, built at once as an open builds them: the catalog's
    whole index (keys, sizes, LRU order, hash tables, spare room) under tracemalloc."""
    n = 200_000
    rng = random.Random(6)
    listed = [name_of(b"\x01" + rng.randbytes(15)) for _ in range(n)]
    entries = [(name, 4096) for name in listed]
    catalog: Catalog[object] = Catalog(None)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        catalog.reset(Catalog.build(entries))
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert catalog.blocks == n and catalog.used == n * 4096
    assert catalog.holds(ident_of_key(bytes.fromhex(listed[7])))
    assert per_block <= 128, per_block


@pytest.mark.parametrize("seed", range(5))
def test_keys_of_one_length_build_as_the_ordered_dict_of_the_names(seed: int) -> None:
    """The usual folder (every key of one length, named by its hex) takes the one-call path:
    the same index as any other, a name listed twice included."""
    rng = random.Random(seed)
    width = rng.choice([1, 16, 32, 100])
    listed = [name_of(rng.randbytes(width)) for _ in range(rng.randrange(1, 3000))]
    listed += rng.choices(listed, k=rng.randrange(0, 5))
    rng.shuffle(listed)
    sizes = [rng.randrange(1 << 40) for _ in listed]
    assert built(listed, sizes) == expected(listed, sizes)


def test_fuzzed_names_of_one_length_give_their_index_or_the_formats_error() -> None:
    """Flips of a blob of names of one length, capitals and whitespace among them (which
    ``bytes.fromhex`` would take): never an entry that is not the block name listed."""
    rng = random.Random(9)
    valid = "\n".join(name_of(rng.randbytes(16)) for _ in range(40)).encode()
    alphabet = b"0123456789abcdefhAF \t\n\x0b"
    for _ in range(3000):
        data = bytearray(valid)
        for _ in range(rng.randrange(1, 3)):
            data[rng.randrange(len(data))] = rng.choice(alphabet)
        blob = bytes(data)
        count = blob.count(b"\n") + 1
        try:
            order = from_blob(blob, count, np.ones(count, dtype=np.uint64))
        except CatalogFormatError:
            continue
        listed = blob.decode().split("\n")
        assert all(is_block_name(n) and ident_of_name(n) is not None for n in listed)
        assert [name_of_ident(i) for i in order] == list(OrderedDict.fromkeys(listed))


@pytest.mark.parametrize("room", [0, 1, 7, 5000, 40_000])
def test_a_laid_out_table_finds_every_row_by_probing_from_its_home(room: int) -> None:
    """Small tables sort their homes as 16-bit values, large ones as 32-bit: either way each
    row sits at its home or after it, with no empty slot between (linear probing finds it)."""
    rng = np.random.default_rng(room)
    fps = rng.integers(1 << 29, 1 << 30, room, dtype=np.uint32)  # the mark and 29 bits
    rows = np.arange(1, room + 1, dtype=np.int32)
    table, table_fps = layout(rows, fps, room)
    size = len(table)
    assert size >= 2 * room and size & (size - 1) == 0
    assert sorted(r for r in table if r) == rows.tolist()
    for row, fp in zip(rows.tolist(), fps.tolist(), strict=True):
        i = fp & (size - 1)
        while table[i] != row:
            assert table_fps[i], "an empty slot before the row"
            i = (i + 1) & (size - 1)
        assert table_fps[i] == fp
