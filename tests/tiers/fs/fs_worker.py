"""A separate process that uses an FSTier, for the kill -9 and shared-folder tests.

``python tests/fs_worker.py store ROOT NS BLOCK_BYTES FSYNC``: stores blocks 0, 1, 2, ... for
ever, printing ``stored N`` after each one returns; the test kills it with SIGKILL.

``python tests/fs_worker.py mix ROOT NS BLOCK_BYTES CAPACITY KEYS OPS SEED``: stores and loads
overlapping keys under a small capacity while another process does the same, verifies every
load against the expected bytes, and prints one JSON summary line.

The bytes of block ``i`` are derived from ``(NS, i)``, so any process can check them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sys
from collections.abc import Callable

import anyio

from kvtier._errors import BlockNotFoundError, CorruptBlockError, TierError
from kvtier.tiers.fs import FSTier


def key_of(ns: str, i: int) -> bytes:
    return b"\x01" + hashlib.blake2b(f"{ns}/{i}".encode(), digest_size=15).digest()


def payload_of(ns: str, i: int, block_bytes: int) -> bytes:
    return hashlib.shake_128(f"{ns}/{i}/payload".encode()).digest(block_bytes)


def key_and_data(
    ns: str, block_bytes: int
) -> tuple[Callable[[int], bytes], Callable[[int], bytes]]:
    """``key(i)`` and ``data(i)`` of namespace ``ns``: the blocks a test module stores."""
    return functools.partial(key_of, ns), functools.partial(_payload, ns, block_bytes)


def _payload(ns: str, block_bytes: int, i: int) -> bytes:
    return payload_of(ns, i, block_bytes)


async def store_forever(root: str, ns: str, block_bytes: int, fsync: str) -> None:
    async with FSTier(root, fsync=fsync) as tier:
        i = 0
        while True:
            await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, block_bytes)))
            print(f"stored {i}", flush=True)
            i += 1


async def mix(
    root: str, ns: str, block_bytes: int, capacity: int, keys: int, ops: int, seed: int
) -> None:
    rng = random.Random(seed)
    counts = {"stored": 0, "loaded": 0, "missed": 0, "corrupt": 0, "wrong": 0}
    errors: list[str] = []
    dst = bytearray(block_bytes)
    async with FSTier(root, capacity_bytes=capacity, fsync="never") as tier:
        for _ in range(ops):
            i = rng.randrange(keys)
            try:
                if rng.random() < 0.5:
                    await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, block_bytes)))
                    counts["stored"] += 1
                else:
                    await tier.load(key_of(ns, i), memoryview(dst))
                    if dst == payload_of(ns, i, block_bytes):
                        counts["loaded"] += 1
                    else:
                        counts["wrong"] += 1
            except BlockNotFoundError:
                counts["missed"] += 1
            except CorruptBlockError:
                counts["corrupt"] += 1
            except TierError as exc:
                errors.append(repr(exc))
    print(json.dumps({**counts, "errors": errors}), flush=True)


def main(argv: list[str]) -> None:
    mode, root, ns, block_bytes = argv[0], argv[1], argv[2], int(argv[3])
    if mode == "store":
        anyio.run(store_forever, root, ns, block_bytes, argv[4])
    elif mode == "mix":
        capacity, keys, ops, seed = (int(a) for a in argv[4:8])
        anyio.run(mix, root, ns, block_bytes, capacity, keys, ops, seed)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
