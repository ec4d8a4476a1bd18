"""The FS catalog's packed index against the ``OrderedDict`` it replaces.

``PackedOrder`` must answer every call the catalog makes exactly as ``OrderedDict[bytes, int]``
does, under any interleaving of them, with idents of every length the layout gives mixed in
one index; these tests drive both with the same random operations and compare every answer.
Its tables hold a 256th of the entries each, so a few thousand entries cross every table's
growth and clean-up many times. The memory bound is checked with ``tracemalloc``, which counts
numpy's and ``array``'s buffers too.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.fs._idents import MAX_HEX_KEY, PAD, ident_of_key, ident_of_name, name_of_ident
from kvtier.tiers.fs._layout import name_of
from kvtier.tiers.fs._packed import PackedOrder


def pool(rng: random.Random, n: int) -> list[bytes]:
    """``n`` distinct idents of every shape: 1, 2 and 16 byte keys, the longest key named by
    its hex (100 bytes), and hashed ones (keys of 101 and 300 bytes)."""
    lengths = [1, 2, 16, 16, 16, 32, 100, 101, 300]
    idents: set[bytes] = set()
    while len(idents) < n:
        idents.add(ident_of_key(rng.randbytes(rng.choice(lengths))))
    return sorted(idents)


IDENTS = pool(random.Random(7), 48)
OPS = ["set", "pop", "look", "first", "last", "move", "front", "iter", "put"]


def check(od: OrderedDict[bytes, int], packed: PackedOrder, deep: bool) -> None:
    assert len(packed) == len(od)
    assert bool(packed) is bool(od)
    assert packed.total == sum(od.values())
    if deep:
        assert list(packed.items()) == list(od.items())
        assert list(packed) == list(od)


def apply(od: OrderedDict[bytes, int], packed: PackedOrder, op: str, ident: bytes, n: int) -> None:
    """One catalog call on both, with the same answer from each."""
    if op == "set":
        od[ident] = packed[ident] = n
    elif op == "put":  # how the catalog adds a file: dropped and stored, at the back
        assert packed.put_last(ident, n) == od.pop(ident, None)
        od[ident] = n
    elif op == "pop":
        assert packed.pop(ident, None) == od.pop(ident, None)
    elif op == "look":
        assert (ident in packed) is (ident in od)
        if len(ident) <= 100:
            assert packed.has_key(ident) is (ident in od)
        assert (packed.touch(ident) is None) is (ident not in od)
        if ident in od:
            od.move_to_end(ident)
        if ident in od:
            assert packed[ident] == od[ident]
        else:
            with pytest.raises(KeyError):
                packed[ident]
        assert packed.get(ident) == od.get(ident)
        assert packed.get(ident, -1) == od.get(ident, -1)
    elif op in ("first", "last"):
        if od:
            assert packed.popitem(last=op == "last") == od.popitem(last=op == "last")
        else:
            with pytest.raises(KeyError):
                packed.popitem(last=op == "last")
    elif op in ("move", "front"):
        if ident in od:
            od.move_to_end(ident, last=op == "move")
            packed.move_to_end(ident, last=op == "move")
        elif op == "front":  # how the catalog puts a victim back: at the front
            od[ident] = packed[ident] = n
            od.move_to_end(ident, last=False)
            packed.move_to_end(ident, last=False)
        else:
            with pytest.raises(KeyError):
                packed.move_to_end(ident)
    check(od, packed, deep=op == "iter")


@settings(max_examples=300, deadline=None)
@given(
    start=st.lists(st.tuples(st.sampled_from(IDENTS), st.integers(0, 2**64 - 1)), max_size=40),
    ops=st.lists(
        st.tuples(st.sampled_from(OPS), st.sampled_from(IDENTS), st.integers(0, 2**64 - 1)),
        max_size=200,
    ),
)
def test_answers_as_an_ordered_dict_does(
    start: list[tuple[bytes, int]], ops: list[tuple[str, bytes, int]]
) -> None:
    od = OrderedDict(start)
    packed = PackedOrder(start)  # repeated idents: first place, last size
    check(od, packed, deep=True)
    for op, ident, n in ops:
        apply(od, packed, op, ident, n)
    check(od, packed, deep=True)


def test_long_random_runs_agree() -> None:
    """A hundred thousand calls, weighted like a full tier's: stores evicting the oldest,
    loads touching, deletes, victims put back at the front, now and then a rebuild from the
    columns (how a catalog read back at open arrives)."""
    from kvtier.tiers.fs._packed_build import rebuilt

    rng = random.Random(42)
    idents = pool(rng, 6000)
    od: OrderedDict[bytes, int] = OrderedDict()
    packed = PackedOrder()
    weights = [15, 8, 25, 20, 1, 10, 5, 0, 15]
    for step in range(100_000):
        op = rng.choices(OPS, weights)[0]
        ident = rng.choice(idents[: 300 + step // 20])
        apply(od, packed, op, ident, rng.randrange(1 << 20))
        if step % 20_000 == 0:
            check(od, packed, deep=True)
            packed = rebuilt(packed)
    check(od, packed, deep=True)


def test_idents_round_trip_with_names_and_odd_names_have_none() -> None:
    rng = random.Random(3)
    for n in (1, 2, 16, 100, 101, 300):
        key = rng.randbytes(n)
        ident = ident_of_key(key)
        assert ident_of_name(name_of(key)) == ident
        assert name_of_ident(ident) == name_of(key)
    odd = ["", "a", "abc", "AB", "ab cd", " ab", "0x", "g0", "h" + "0" * 63, "h" + "A" * 64]
    odd += ["aB", "0a0B", "ab\t", "a b ", "\u00b2\u00b2", "h" + "0" * 63 + "F"]
    for bad in odd:  # capitals, whitespace and other digits, which ``fromhex`` may take
        assert ident_of_name(bad) is None, bad
    assert ident_of_name("0" * 202) is None and ident_of_name("0" * 200) == bytes(100)
    assert ident_of_name("12") == b"\x12" and ident_of_name("0a") == b"\x0a"


def test_idents_that_no_name_gives_are_refused() -> None:
    packed = PackedOrder([(b"\xab", 1)])
    for bad in [b"", bytes(102), b"\x01" * 101, b"\x01" + PAD[1:] + bytes(32)]:
        with pytest.raises(ValueError, match="not a block key"):
            packed[bad] = 1
        assert bad not in packed
        assert packed.get(bad) is None
    assert "ab" not in packed and 0xAB not in packed and bytearray(b"\xab") not in packed
    assert list(packed.items()) == [(b"\xab", 1)] and packed.total == 1
    with pytest.raises(KeyError):
        packed.pop(b"\xcd")
    assert repr(packed).startswith("<PackedOrder entries=1 total=1 slots=")


def test_iterating_while_the_order_changes_raises() -> None:
    idents = pool(random.Random(5), 100)
    packed = PackedOrder((i, 1) for i in idents)
    walk = iter(packed)
    next(walk)
    packed.move_to_end(idents[0])
    with pytest.raises(RuntimeError, match="changed during iteration"):
        list(walk)


def test_the_keys_reader_reads_the_index_as_it_was_when_taken() -> None:
    """Every ident that is a key (any length, trailing zero bytes kept), no hashed name's,
    no removed row's; changes after it was taken, while a thread would read, do not show."""
    rng = random.Random(9)
    idents = pool(rng, 2000)
    packed = PackedOrder((i, 1) for i in idents)
    zeros = b"\x00" * 8
    packed[zeros] = 1
    gone = set(rng.sample(idents, 500))
    for ident in gone:
        packed.pop(ident)
    read = packed.keys_reader()
    packed[b"later"] = 1
    packed.pop(next(i for i in idents if i not in gone))
    kept = [i for i in idents if i not in gone]
    assert any(len(i) > MAX_HEX_KEY for i in kept)  # hashed names are there to leave out
    keys = read()
    assert len(keys) == len(set(keys)) and set(keys) == {
        i for i in kept if len(i) <= MAX_HEX_KEY
    } | {zeros}


def test_draining_from_either_end_and_refilling_reuses_rows() -> None:
    idents = pool(random.Random(8), 3000)
    od: OrderedDict[bytes, int] = OrderedDict()
    packed = PackedOrder()
    for rounds in range(3):
        for i, ident in enumerate(idents):
            od[ident] = packed[ident] = i + rounds
        while od:
            last = len(od) % 3 == 0
            assert packed.popitem(last=last) == od.popitem(last=last)
    assert not packed and packed.total == 0
    assert len(packed._sizes) == len(idents)  # rows were reused, not added


@pytest.mark.parametrize(
    ("build", "n"),
    [
        ("at once", 200_000),  # read back at open
        ("one by one", 50_000),  # stores
    ],
)
def test_memory_per_entry_stays_packed(build: str, n: int) -> None:
    """16-byte keys: the whole index (keys, sizes, order, hash tables, the arrays' spare
    room) costs at most 90 bytes an entry."""
    from kvtier.tiers.fs._packed_build import rebuilt

    rng = random.Random(6)
    idents = [rng.randbytes(16) for _ in range(n)]
    source = PackedOrder()
    if build == "at once":
        for ident in idents:
            source[ident] = 4096
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        if build == "at once":
            packed = rebuilt(source)
        else:
            packed = PackedOrder()
            for ident in idents:
                packed[ident] = 4096
        gc.collect()
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(packed) == n and packed.total == n * 4096
    assert per_entry <= 90, per_entry
