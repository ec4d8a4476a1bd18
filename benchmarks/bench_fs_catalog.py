"""What the FS catalog's packed index costs per call, against the ``OrderedDict`` index it
replaced, and against one block load through the tier.

    python -m benchmarks.bench_fs_catalog              # an index of 10^6 blocks
    python -m benchmarks.bench_fs_catalog --quick      # 10^5 blocks, fewer rounds
    python -m benchmarks.bench_fs_catalog --blocks 300000 --json

Both sides are a catalog of the same 16-byte keys (``block_keys``' length), filled at once as
a checkpoint read back at open fills it, with no journal listening (what the journal does per
call is the same for both):

- ``packed``: ``Catalog`` (``kvtier.tiers.fs._catalog``), the index the tier uses;
- ``ordered_dict``: the same calls written as the catalog wrote them over an
  ``OrderedDict[str, int]`` of file names (the baseline, ``DictCatalog`` below).

Per call, the best of ``--rounds`` rounds of ``--calls`` calls each: ``holds`` of a held key
and of a key never stored (the ``lookup()`` path), ``loaded`` (a load makes a block the most
recently used), ``add`` of a new file (a store landing), ``drop`` (a delete), and ``reserve``
of a full catalog (a store's reservation, evicting the least recently used block), followed
by its ``settle`` (the store's file booked). Each row prints both sides in microseconds, their
ratio, and the packed side's extra time as a share of one block load.

The block load: ``FSTier.load`` of a 4 KiB and of a 256 KiB block from a folder under
``--dir``, read and verified (checksum), page cache warm: the cheapest a load gets, so the
share is the most the index's extra cost can weigh on a request that loads one block. Memory:
``tracemalloc``'s traced bytes per block of each index, as built here.

The catalog is private: this benchmark measures an internal structure, so it imports it; the
block loads use the public API.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

import kvtier
from benchmarks.common import add_json_flag, json_output, settings
from kvtier.tiers.fs._catalog import Catalog, NoRoom, Reservation
from kvtier.tiers.fs._layout import key_of, name_of

BLOCK = 4096 + 64  # a file's size: the block and its header


class DictCatalog:
    """The catalog's index calls as they were over an ``OrderedDict`` of names: the baseline.
    Epochs and watchers as the catalog keeps them (none run here)."""

    def __init__(self, capacity_bytes: int | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.ready = True
        self._index: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.reserved = 0
        self._epoch = 0
        self._watchers = 0
        self._added: dict[str, int] = {}
        self._dropped: dict[str, int] = {}

    def reset(self, entries: Iterable[tuple[str, int]]) -> None:
        self._index = OrderedDict(entries)
        self.used = sum(self._index.values())

    def holds(self, key: bytes) -> bool:
        return self.ready and name_of(key) in self._index

    def add(self, name: str, size: int) -> None:
        self.drop(name)
        self._index[name] = size
        self.used += size
        self._epoch += 1
        if self._watchers:
            self._added[name] = self._epoch

    def drop(self, name: str) -> bool:
        size = self._index.pop(name, None)
        self._taken(name)
        if size is not None:
            self.used -= size
        return size is not None

    def loaded(self, name: str, size: int) -> None:
        if name in self._index:
            self._index.move_to_end(name)
        else:
            self.add(name, size)

    def _taken(self, name: str) -> None:
        if self._watchers:
            self._epoch += 1
            self._dropped[name] = self._epoch

    def reserve(self, key: bytes, name: str, size: int) -> Reservation:
        victims: list[tuple[str, int]] = []
        cap = self.capacity_bytes
        if cap is not None:
            if size > cap:
                raise NoRoom(size, cap)
            budget = cap - self.reserved - size
            while self.used > budget and self._index:
                victim, victim_size = self._index.popitem(last=False)
                if victim == name:
                    self._index[victim] = victim_size
                    if len(self._index) == 1:
                        break
                    continue
                self.used -= victim_size
                self._taken(victim)
                victims.append((victim, victim_size))
        self.reserved += size
        return Reservation(key, name, size, victims)

    def settle(
        self, res: Reservation, landed: int | None, *, written: bool, touched: bool
    ) -> list[tuple[str, int]]:
        self.reserved -= res.size
        if landed is not None:
            self.add(res.name, landed)
        return res.victims if written else []


AnyCatalog = Catalog[object] | DictCatalog


def keys_of(tag: bytes, n: int) -> list[bytes]:
    """``n`` distinct 16-byte keys, as uniform as ``block_keys`` makes them."""
    raw = np.random.default_rng(int.from_bytes(tag, "little")).bytes(16 * n)
    return [raw[i : i + 16] for i in range(0, 16 * n, 16)]


class Calls:
    """The timed rounds of one catalog, which holds ``held``: each returns its calls' seconds."""

    def __init__(self, catalog: AnyCatalog, held: list[bytes], calls: int, tag: bytes) -> None:
        self.catalog = catalog
        self.calls = calls
        self.hits = held[len(held) // 3 :][:calls]
        self.misses = keys_of(b"never", calls)
        self.hit_names = [name_of(k) for k in self.hits]
        self._fresh = (k for k in keys_of(tag, 1 << 22))
        assert all(map(catalog.holds, self.hits))
        assert not any(map(catalog.holds, self.misses))

    def _new_names(self) -> list[tuple[bytes, str]]:
        return [(k, name_of(k)) for k in (next(self._fresh) for _ in range(self.calls))]

    def rounds(self) -> dict[str, Callable[[], float]]:
        return {
            "holds (held)": self.holds_hits,
            "holds (not held)": self.holds_misses,
            "loaded": self.loaded,
            "add (new file)": lambda: self.add_drop()[0],
            "drop": lambda: self.add_drop()[1],
            "reserve (evicting one)": lambda: self.reserve_settle()[0],
            "settle (file booked)": lambda: self.reserve_settle()[1],
        }

    def holds_hits(self) -> float:
        holds, keys = self.catalog.holds, self.hits
        started = time.perf_counter()
        for key in keys:
            holds(key)
        return time.perf_counter() - started

    def holds_misses(self) -> float:
        holds, keys = self.catalog.holds, self.misses
        started = time.perf_counter()
        for key in keys:
            holds(key)
        return time.perf_counter() - started

    def loaded(self) -> float:
        touch, names = self.catalog.loaded, self.hit_names
        started = time.perf_counter()
        for name in names:
            touch(name, BLOCK)
        return time.perf_counter() - started

    def add_drop(self) -> tuple[float, float]:
        names = [name for _, name in self._new_names()]
        add, drop = self.catalog.add, self.catalog.drop
        started = time.perf_counter()
        for name in names:
            add(name, BLOCK)
        middle = time.perf_counter()
        for name in names:
            drop(name)
        return middle - started, time.perf_counter() - middle

    def reserve_settle(self) -> tuple[float, float]:
        catalog = self.catalog
        catalog.capacity_bytes = catalog.used  # full: every reservation evicts one block
        batch = self._new_names()
        reserve, settle = catalog.reserve, catalog.settle
        started = time.perf_counter()
        rooms = [reserve(key, name, BLOCK) for key, name in batch]
        middle = time.perf_counter()
        for res in rooms:
            settle(res, BLOCK, written=True, touched=True)
        ended = time.perf_counter()
        catalog.capacity_bytes = None
        assert all(len(res.victims) == 1 for res in rooms)
        return middle - started, ended - middle


def measure(sides: dict[str, Calls], rounds: int) -> dict[str, dict[str, float]]:
    """Per-call microseconds of each operation on each side: the best of ``rounds``, the
    sides taking turns within each round (a shared machine's load falls on both)."""
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    for _ in range(rounds):
        for side, calls in sides.items():
            for op, one_round in calls.rounds().items():
                us = one_round() / calls.calls * 1e6
                best[side][op] = min(best[side].get(op, float("inf")), us)
    return best


def traced_build(build: Callable[[], AnyCatalog], n: int) -> tuple[AnyCatalog, float]:
    """The catalog ``build`` makes, and the traced bytes per block it holds."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        catalog = build()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return catalog, grown / n


async def load_us(root: str, block_bytes: int, count: int, rounds: int) -> float:
    """Median microseconds of one ``FSTier.load`` of a ``block_bytes`` block (page cache
    warm), over ``rounds`` passes of ``count`` blocks."""
    keys = kvtier.block_keys(list(range(count * 16)), 16, namespace=b"bench-catalog")
    payload = bytearray(np.random.default_rng(1).bytes(block_bytes))
    dst = bytearray(block_bytes)
    times: list[float] = []
    async with kvtier.FSTier(root, fsync="never") as tier:
        for key in keys:
            await tier.store(key, memoryview(payload))
        for _ in range(rounds):
            for key in keys:
                started = time.perf_counter()
                await tier.load(key, memoryview(dst))
                times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def full_state_ms(catalog: Catalog[object], rounds: int) -> dict[str, float]:
    """What a router's full state holds the loop for, best of ``rounds``: the keys made on the
    loop from the names (the way it was taken before: the baseline), against the copy of the
    index's columns that is all the loop does now; and the worker thread's making of the
    keys from that copy."""
    names_on_loop, copy_on_loop, thread = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        keys = [k for n in catalog.names() if (k := key_of(n)) is not None]
        names_on_loop.append(time.perf_counter() - started)
        started = time.perf_counter()
        read = catalog.keys_reader()
        copy_on_loop.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert len(read()) == len(keys)
        thread.append(time.perf_counter() - started)
    best = {
        "names_on_loop_ms": min(names_on_loop) * 1e3,
        "copy_on_loop_ms": min(copy_on_loop) * 1e3,
        "thread_ms": min(thread) * 1e3,
    }
    return best | {"loop_ratio": best["names_on_loop_ms"] / best["copy_on_loop_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the load's folder goes (a disk)")
    parser.add_argument("--quick", action="store_true", help="10^5 blocks, 3 rounds")
    add_json_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.rounds = min(args.blocks, 100_000), 3
    with json_output(args.json) as out:
        out["settings"] = settings(args, "blocks", "calls", "rounds", "quick")
        held = keys_of(b"held", args.blocks)

        def packed() -> Catalog[object]:
            catalog: Catalog[object] = Catalog(None)
            catalog.reset((name_of(k), BLOCK) for k in held)
            return catalog

        def ordered() -> DictCatalog:
            catalog = DictCatalog(None)
            catalog.reset((name_of(k), BLOCK) for k in held)
            return catalog

        memory: dict[str, float] = {}
        calls: dict[str, Calls] = {}
        for side, build in (("ordered_dict", ordered), ("packed", packed)):
            catalog, memory[side] = traced_build(build, args.blocks)
            calls[side] = Calls(catalog, held, args.calls, side.encode())
        sides = measure(calls, args.rounds)
        kept = calls["packed"].catalog
        assert isinstance(kept, Catalog)
        full_state = full_state_ms(kept, min(args.rounds, 3))
        del kept
        del calls
        gc.collect()
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-fs-catalog-") as root:
            loads = {
                "4KiB": asyncio.run(load_us(os.path.join(root, "a"), 4096, 200, args.rounds)),
                "256KiB": asyncio.run(load_us(os.path.join(root, "b"), 262144, 64, args.rounds)),
            }
        rows: list[dict[str, Any]] = []
        for op, base in sides["ordered_dict"].items():
            mine = sides["packed"][op]
            extra = mine - base
            rows.append(
                {
                    "op": op,
                    "packed_us": mine,
                    "ordered_dict_us": base,
                    "ratio": mine / base,
                    "extra_of_4KiB_load": extra / loads["4KiB"],
                    "extra_of_256KiB_load": extra / loads["256KiB"],
                }
            )
        out["baseline"] = "ordered_dict"
        out["rows"] = rows
        out["load_us"] = loads
        out["traced_bytes_per_block"] = memory
        out["full_state"] = full_state
        print(
            f"FS catalog index, {args.blocks:,} blocks of 16-byte keys, best of {args.rounds} "
            f"rounds of {args.calls} calls"
        )
        print(
            f"{'call':<24} {'packed us':>10} {'odict us':>10} {'ratio':>7} "
            f"{'extra/4KiB load':>16} {'extra/256KiB load':>18}"
        )
        for row in rows:
            print(
                f"{row['op']:<24} {row['packed_us']:10.3f} {row['ordered_dict_us']:10.3f} "
                f"{row['ratio']:7.2f} {row['extra_of_4KiB_load']:16.2%} "
                f"{row['extra_of_256KiB_load']:18.2%}"
            )
        print(
            f"one FSTier.load, page cache warm (median): 4 KiB {loads['4KiB']:.1f} us, "
            f"256 KiB {loads['256KiB']:.1f} us"
        )
        print(
            f"traced bytes per block: packed {memory['packed']:.1f}, "
            f"ordered_dict {memory['ordered_dict']:.1f} (aim <= 128)"
        )
        print(
            f"a router's full state holds the loop for {full_state['copy_on_loop_ms']:.1f} ms "
            f"(was {full_state['names_on_loop_ms']:.1f} ms with the keys made on the loop: "
            f"{full_state['loop_ratio']:.0f}x); its worker thread makes the keys in "
            f"{full_state['thread_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
