"""A second kvtier node for the S3 tests: its own process, its own pool, tier and manager.

Run as ``python tests/s3_peer.py '<json>'`` with endpoint, bucket, prefix, namespace (hex),
tokens, block_bytes, seed and mode:

- ``load``: look the blocks up (recording the first answer of each), wait for them through
  the scheduler, load them and print their sha256 digests.
- ``store``: store the blocks through the manager (leaving the manager waits for the
  write-through, closing the tier publishes its journal) and print the write-through counts.
- ``race``: like ``store``, but once open print ``ready`` and wait for a line on stdin, so
  two peers put the same keys at the same moment (the conditional put race).

The blocks are derived from ``seed`` so both processes know what the bytes must be.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Any

import anyio
import numpy as np

from kvtier import HostPool, OffloadScheduler, block_keys
from kvtier.manager import TieringManager
from kvtier.tiers.s3 import S3Tier


def make_blocks(seed: int, count: int, block_bytes: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(block_bytes) for _ in range(count)]


async def main(args: dict[str, Any]) -> dict[str, Any]:
    block_bytes = int(args["block_bytes"])
    keys = block_keys(
        list(range(int(args["tokens"]))), 4, namespace=bytes.fromhex(args["namespace"])
    )
    tier = S3Tier(
        args["bucket"],
        prefix=args["prefix"],
        endpoint_url=args["endpoint"],
        region_name="us-east-1",
        aws_access_key_id=args["access_key"],
        aws_secret_access_key=args["secret_key"],
        lookup_mode=args.get("lookup_mode", "index"),
    )
    pool = HostPool(len(keys) + 4, block_bytes)
    async with TieringManager(pool, [tier]) as manager:
        await tier.wait_index_loaded()  # its first answers come from a whole index
        if args["mode"] == "race":
            print("ready", flush=True)  # the tier is open: wait for the start line
            await anyio.to_thread.run_sync(sys.stdin.readline)
        if args["mode"] in ("store", "race"):
            blocks = make_blocks(int(args["seed"]), len(keys), block_bytes)
            array = np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(len(keys), -1)
            placed = await manager.store(keys, array)
            result: dict[str, Any] = {"placed": placed}
        else:
            first = [manager.lookup(key).name for key in keys]
            count = await OffloadScheduler(manager).lookup(keys, timeout=30)
            out = np.zeros((len(keys), block_bytes), dtype=np.uint8)
            loaded = await manager.load(keys, out)
            result = {
                "first": first,
                "count": count,
                "loaded": loaded,
                "digests": [hashlib.sha256(row.tobytes()).hexdigest() for row in out[:loaded]],
            }
    stats = manager.statistics()
    result["cascades_succeeded"] = stats.writes.succeeded
    result["promotions_succeeded"] = stats.promotions.succeeded
    tier_stats = tier.statistics()
    result["stores"] = tier_stats.stores
    result["stores_skipped_existing"] = tier_stats.stores_skipped_existing
    result["journal_segments_published"] = tier_stats.journal_segments_published
    result["request_path_requests"] = tier_stats.request_path_requests
    return result


if __name__ == "__main__":
    print(json.dumps(anyio.run(main, json.loads(sys.argv[1]))))
