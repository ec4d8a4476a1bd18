"""Cost of a lookup when every key is a primary hit, against a bare dict-membership loop.

    python -m benchmarks.bench_lookup [--keys 1000] [--repeat 200] [--quick] [--json]

Prints ns per key for: the floor (a Python loop of `key in dict` over the same keys),
`TieringManager.lookup` called per key, and `OffloadScheduler.maximal_prefix_lookup` (which
uses the manager's batch fast path), each with LRU and ARC, plus the ratio to the floor measured
in the same run. Times are the best of several rounds, because this machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import timeit
from collections.abc import Callable

import numpy as np

import kvtier
from benchmarks.common import add_json_flag, json_output


def best_ns_per_key(fn: Callable[[], object], n_keys: int, repeat: int, number: int) -> float:
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number / n_keys * 1e9


class PerKeyOnly:
    """The manager without its batch fast path: what a scheduler without it would cost."""

    def __init__(self, manager: kvtier.TieringManager) -> None:
        self.lookup = manager.lookup


async def measure_policy(
    policy: str, keys: list[bytes], repeat: int, number: int
) -> list[tuple[str, float]]:
    n_keys = len(keys)
    pool = kvtier.HostPool(n_keys, 64, policy=policy)
    async with kvtier.TieringManager(pool, [kvtier.MemoryTier()]) as manager:
        await manager.store(keys, np.zeros((n_keys, 64), np.uint8))
        await manager.wait_idle()
        scheduler = kvtier.OffloadScheduler(manager)
        per_key = kvtier.OffloadScheduler(PerKeyOnly(manager))  # type: ignore[arg-type]
        lookup = manager.lookup
        assert scheduler.maximal_prefix_lookup(keys) == n_keys
        assert per_key.maximal_prefix_lookup(keys) == n_keys

        def manager_loop() -> None:
            for key in keys:
                lookup(key)

        return [
            (
                f"TieringManager.lookup per key [{policy}]",
                best_ns_per_key(manager_loop, n_keys, repeat, number),
            ),
            (
                f"maximal_prefix_lookup, per-key path [{policy}]",
                best_ns_per_key(
                    lambda: per_key.maximal_prefix_lookup(keys), n_keys, repeat, number
                ),
            ),
            (
                f"maximal_prefix_lookup, fast path [{policy}]",
                best_ns_per_key(
                    lambda: scheduler.maximal_prefix_lookup(keys), n_keys, repeat, number
                ),
            ),
        ]


async def run(n_keys: int, repeat: int, number: int) -> list[tuple[str, float]]:
    keys = kvtier.block_keys(list(range(n_keys * 16)), 16, namespace=b"bench")
    floor_dict = dict.fromkeys(keys, 0)

    def floor() -> None:
        for key in keys:
            key in floor_dict  # noqa: B015 - the membership test is the measured work

    rows = [("dict membership loop (floor)", best_ns_per_key(floor, n_keys, repeat, number))]
    for policy in ("lru", "arc"):
        rows += await measure_policy(policy, keys, repeat, number)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--number", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for CI/nox)")
    add_json_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.number = 5, 10
    with json_output(args.json) as out:
        out["settings"] = {"keys": args.keys, "repeat": args.repeat, "number": args.number}
        rows = asyncio.run(run(args.keys, args.repeat, args.number))
        floor = rows[0][1]
        out["baseline"] = rows[0][0]
        out["rows"] = [
            {"what": name, "ns_per_key": ns, "of_floor": ns / floor} for name, ns in rows
        ]
        print(f"lookup cost over {args.keys} keys, all primary hits (best of {args.repeat} rounds)")
        print(f"{'what':<48} {'ns/key':>8} {'x floor':>8}")
        for name, ns in rows:
            print(f"{name:<48} {ns:8.1f} {ns / floor:8.2f}")


if __name__ == "__main__":
    main()
