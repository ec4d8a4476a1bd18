"""What the walk that reconciles an FS tier's catalog with its folder costs, against the walk
that ``stat``s every file, and against the floor of reading the folders alone.

    python -m benchmarks.bench_fs_walk                 # 10^6 block files under /var/tmp
    python -m benchmarks.bench_fs_walk --quick         # 10^5 files, fewer rounds
    python -m benchmarks.bench_fs_walk --blocks 300000 --dir /mnt/nvme --json

After a restart from a checkpoint the tier answers at once and walks its folder in the
background, to learn what changed while it was closed (``kvtier.tiers.fs._reconcile``). The
folder here holds ``--blocks`` block files of a 4 KiB block's size, laid out as the tier lays
them out, every one known to the catalog (the common case: nothing changed). Three walks of
that folder, alternating, ``--rounds`` times:

- ``stat_every_file``: ``list_blocks``, every block file with its size and mtime (the walk at
  an open with no catalog, and what the reconcile walked before);
- ``known_by_type``: ``_reconcile.compare`` with a catalog of every name, the reconcile's
  walk: a known name's file is taken by its folder entry's type (asked a folder at a time of
  the catalog's key columns, ``_known``), only the files not known are ``stat``-ed;
- ``floor``: ``os.scandir`` of every shard folder, each name read and nothing else: what any
  walk that learns the folder's contents spends.

Memory: the most bytes ``tracemalloc`` saw at once during one reconcile walk, per block,
against a set of the catalog's names as strings alone (what a walk that asks a set of names
holds for as long as it runs).

Before each walk the page cache is dropped where the process may (``os.sync()``, then ``3``
into ``/proc/sys/vm/drop_caches``: root on a machine that allows it); where it may not, every
walk reads a warm cache, and the run says so. A cold cache is what a restart meets, and there
the ``stat``s read every file's inode from the device. The walk functions are private: this
benchmark measures an internal step, so it imports them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import add_json_flag, drop_page_cache, json_output
from kvtier.tiers.fs._layout import name_of, path_of
from kvtier.tiers.fs._packed_build import from_names, names_of, snapshot
from kvtier.tiers.fs._reconcile import compare
from kvtier.tiers.fs._root import list_blocks, ready_root

FILE_BYTES = 4096 + 64  # a 4 KiB block and its header
KEY_BYTES = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10^5 files, 3 rounds")
    parser.add_argument("--blocks", type=int, help="block files (default 10^6; --quick 10^5)")
    parser.add_argument("--rounds", type=int, help="walks of each kind (default 5; --quick 3)")
    parser.add_argument("--dir", default="/var/tmp", help="where the folder is made (a disk)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    args.blocks = args.blocks or (100_000 if args.quick else 1_000_000)
    args.rounds = args.rounds or (3 if args.quick else 5)
    if args.blocks < 1 or args.rounds < 1:
        parser.error("--blocks and --rounds must be at least 1")
    return args


def fill(root: Path, blocks: int) -> list[str]:
    """``blocks`` block files under ``root``; their names."""
    ready_root(root)
    payload = b"\0" * FILE_BYTES
    names: list[str] = []
    for i in range(blocks):
        name = name_of(i.to_bytes(KEY_BYTES, "big"))
        path = path_of(root, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        names.append(name)
    return names


def floor(root: Path) -> int:
    """Every name in every shard folder, read and nothing else; how many."""
    count = 0
    with os.scandir(root) as firsts:
        for first in firsts:
            if not first.is_dir(follow_symlinks=False):
                continue
            with os.scandir(first.path) as seconds:
                for second in seconds:
                    if second.is_dir(follow_symlinks=False):
                        with os.scandir(second.path) as files:
                            count += sum(1 for _ in files)
    return count


def peak_traced(work: Callable[[], object]) -> int:
    """The most bytes ``tracemalloc`` saw allocated at once while ``work`` ran."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def timed(walk: Callable[[], object]) -> float:
    started = time.perf_counter()
    walk()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="kvtier-walk-", dir=args.dir))
    try:
        root = folder / "tier"
        started = time.perf_counter()
        names = fill(root, args.blocks)
        fill_s = time.perf_counter() - started
        catalog = snapshot(from_names(names, np.full(len(names), FILE_BYTES, np.uint64)))
        del names
        walks: dict[str, Callable[[], object]] = {
            "stat_every_file": lambda: list_blocks(root),
            "known_by_type": lambda: compare(root, catalog),
            "floor": lambda: floor(root),
        }
        # What each walk must find, checked once: a walk that skipped files would be fast.
        difference = compare(root, catalog)
        if len(list_blocks(root)) != args.blocks or difference.found or difference.gone:
            raise RuntimeError("a walk did not find the folder's block files")
        if floor(root) != args.blocks:
            raise RuntimeError("the folders do not hold the block files alone")
        memory = {
            "known_by_type": peak_traced(lambda: compare(root, catalog)),
            "set_of_names": peak_traced(lambda: frozenset(names_of(catalog))),
        }
        seconds: dict[str, list[float]] = {kind: [] for kind in walks}
        cold = True
        for _ in range(args.rounds):
            for kind, walk in walks.items():
                cold = drop_page_cache()[0] and cold
                seconds[kind].append(timed(walk))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {kind: statistics.median(s) for kind, s in seconds.items()}
    return {
        "blocks": args.blocks,
        "rounds": args.rounds,
        "page_cache_dropped": cold,
        "fill_s": round(fill_s, 1),
        "seconds": {
            kind: {"min": round(min(s), 3), "median": round(medians[kind], 3)}
            for kind, s in seconds.items()
        },
        "peak_traced_bytes_per_block": {
            kind: round(peak / args.blocks, 1) for kind, peak in memory.items()
        },
        "stat_every_file_over_known_by_type": round(
            medians["stat_every_file"] / medians["known_by_type"], 2
        ),
        "known_by_type_over_floor": round(medians["known_by_type"] / medians["floor"], 2),
        "load_average": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with json_output(args.json) as out:
        result = run(args)
        out.update(result)
        print(
            f"{result['blocks']} block files, {result['rounds']} rounds, page cache "
            f"{'dropped' if result['page_cache_dropped'] else 'warm (could not drop it)'}, "
            f"load average {result['load_average']}"
        )
        for kind, s in result["seconds"].items():
            print(f"  {kind:16} min {s['min']:8.3f} s   median {s['median']:8.3f} s")
        peak = result["peak_traced_bytes_per_block"]
        print(
            f"  peak traced bytes per block: the walk {peak['known_by_type']}, "
            f"a set of the catalog's names alone {peak['set_of_names']}"
        )
        print(
            "  stat_every_file / known_by_type: "
            f"{result['stat_every_file_over_known_by_type']}x;  known_by_type / floor: "
            f"{result['known_by_type_over_floor']}x"
        )


if __name__ == "__main__":
    main()
