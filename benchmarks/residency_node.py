"""One node of ``benchmarks.residency``: a FS tier of its own and the run's shared S3 prefix,
publishing their events; it does what the driver tells it on stdin, one JSON command a line,
and answers each with one JSON line on stdout.

Commands: ``store`` / ``delete`` / ``load`` (``tier``: ``fs`` or ``s3``, ``keys``: hex),
``refresh`` (publish and read the S3 journal now) and ``audit_seconds`` (how long the node's
last audit of the shared prefix took, in ``seconds``). A load is what a request touching the block
does: it finds a block that was corrupted or removed behind kvtier's back, and the tier
announces the removal. Answers: ``{"ok": n}`` with the blocks it did (and, for a command with
``"timed": true``, ``started``: when each key's operation began, on the monotonic clock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import anyio
import anyio.to_thread

import kvtier
from kvtier.integrations.kv_events import KVEventPublisher

BLOCK = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("root", "pub", "replay", "s3-endpoint", "bucket", "prefix"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--fs-blocks", type=int, required=True, help="FS capacity, in blocks")
    p.add_argument("--index-refresh", type=float, required=True)
    p.add_argument("--audit-every", type=float, required=True)
    p.add_argument("--walk-every", type=float, required=True)
    p.add_argument("--hwm", type=int, required=True, help="the publisher's high-water mark")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    fs = kvtier.FSTier(
        args.root,
        name="fs",
        capacity_bytes=args.fs_blocks * (BLOCK + 4096),
        walk_interval=args.walk_every,
    )
    s3 = kvtier.S3Tier(
        args.bucket,
        name="s3",
        prefix=args.prefix,
        endpoint_url=args.s3_endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench-secret",
        index_refresh=args.index_refresh,
        index_audit_every=args.audit_every,
        pack_blocks=1,
    )
    tiers = {"fs": fs, "s3": s3}
    publisher = KVEventPublisher(
        args.pub, block_size=16, replay_endpoint=args.replay, hwm=args.hwm, replay_batches=2000
    )
    async with (
        fs,
        s3,
        publisher,
        kvtier.EventStream(fs, s3) as stream,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(publisher.publish_stream, stream)
        print(json.dumps({"ready": True}), flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            print(json.dumps(await command(tiers, json.loads(line))), flush=True)
        stream.close()


async def command(tiers: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    if op == "refresh":
        await tiers["s3"].refresh_index()
        return {"ok": 0}
    if op == "audit_seconds":  # how long this node's last audit took (0.0: none yet)
        return {"ok": 0, "seconds": tiers["s3"].statistics().index_audit_seconds}
    tier = tiers[cmd["tier"]]
    done = 0
    started: list[float] = []  # when each key's command began (``timed``), this machine's
    for key in map(bytes.fromhex, cmd["keys"]):  # monotonic clock, which every process shares
        started.append(time.monotonic())
        try:
            if op == "store":
                await tier.store(key, memoryview(key * (BLOCK // len(key))))
            elif op == "delete":
                await tier.delete(key)
            elif op == "load":
                await tier.load(key, memoryview(bytearray(BLOCK)))
            done += 1
        except kvtier.KVTierError:
            pass  # gone, corrupt: the tier announced it if it held the block
    return {"ok": done, "started": started} if cmd.get("timed") else {"ok": done}


def main() -> None:
    asyncio.run(serve(parse_args()))


if __name__ == "__main__":
    main()
