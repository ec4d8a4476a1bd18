"""``kvtier bench`` and ``kvtier config``: the configured pool and tiers, measured or shown."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from kvtier._cli._common import EXIT_BAD_DATA, EXIT_OK, UsageError, human_bytes
from kvtier.common._errors import KVTierError
from kvtier.common._logging import BurstLogger

__all__ = ["run_bench", "show_config"]

logger = logging.getLogger("kvtier._cli")


def _load_config(path: str | None) -> Any:
    """The configuration both commands use, checked as far as ``bench`` would check it before
    building anything, so ``config`` never accepts what ``bench`` then refuses."""
    from kvtier.manager._stack_config import ENV_CONFIG_FILE, ENV_PREFIX, KVTierConfig
    from kvtier.tiers.s3._config import check_bucket_name

    try:
        if path is not None:
            config = KVTierConfig.from_toml(path)
        elif any(k.startswith(ENV_PREFIX) for k in os.environ):
            config = KVTierConfig.from_env()
        else:
            return None
    except UnicodeDecodeError as exc:  # tomllib reads UTF-8 only
        where = path if path is not None else os.environ.get(ENV_CONFIG_FILE, "the config file")
        raise UsageError(
            f"{where} is not UTF-8 text (byte {exc.start}): save it as UTF-8"
        ) from None
    if config.s3 is not None:
        check_bucket_name(config.s3.bucket)
    return config


def show_config(args: argparse.Namespace, out: IO[str]) -> int:
    config = _load_config(args.config)
    if config is None:
        raise UsageError("no configuration: pass --config FILE or set KVTIER_* variables")
    json.dump(config.to_dict(), out, indent=2)
    out.write("\n")
    return EXIT_OK


@dataclass(slots=True)
class _Row:
    target: str
    op: str
    count: int
    seconds: float
    nbytes: int
    latencies: list[float]
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "target": self.target,
            "op": self.op,
            "count": self.count,
            "errors": self.errors,
            "seconds": self.seconds,
            "ops_per_s": self.count / self.seconds if self.seconds > 0 else math.inf,
            "mib_per_s": self.nbytes / (1 << 20) / self.seconds if self.nbytes else None,
            "p50_ms": _quantile(lat, 0.50) * 1e3 if lat else None,
            "p99_ms": _quantile(lat, 0.99) * 1e3 if lat else None,
        }


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def _bench_tier(tier: Any, blocks: int, block_bytes: int, concurrency: int) -> list[_Row]:
    import anyio

    keys = [b"\xbe" + os.urandom(15) for _ in range(blocks)]  # random: never a real block
    payload = memoryview(os.urandom(block_bytes))
    limiter = anyio.CapacityLimiter(concurrency)
    rows: list[_Row] = []
    log = BurstLogger(logger)  # a tier that is down fails every key: say so once

    async def timed(
        op: str, fn: Callable[[bytes], Any], keys: Sequence[bytes], nbytes: int
    ) -> None:
        latencies: list[float] = []
        errors = 0

        async def one(key: bytes) -> None:
            nonlocal errors
            async with limiter:
                t0 = time.perf_counter()
                try:
                    await fn(key)
                except KVTierError as exc:
                    errors += 1
                    kind = op + ":" + type(exc).__name__
                    log.warning(kind, "bench %s %s failed: %s", tier.name, op, exc)
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for key in keys:
                tg.start_soon(one, key)
        elapsed = time.perf_counter() - started
        rows.append(
            _Row(
                tier.name, op, len(keys), elapsed, nbytes * (len(keys) - errors), latencies, errors
            )
        )

    buffers = {k: bytearray(block_bytes) for k in keys}
    try:
        await timed("store", lambda k: tier.store(k, payload), keys, block_bytes)
        rows.append(await _bench_contains(tier, keys))
        await timed("load", lambda k: tier.load(k, memoryview(buffers[k])), keys, block_bytes)
        bad = sum(bytes(b) != payload for b in buffers.values())
        if bad:
            rows[-1].errors += bad
    finally:
        await timed("delete", tier.delete, keys, 0)  # leave nothing behind in a real cache
    return rows


async def _bench_contains(tier: Any, keys: list[bytes]) -> _Row:
    """One batched existence check of ``keys``; a key it does not find is an error."""
    started = time.perf_counter()
    present = await tier.contains_many(keys)
    elapsed = time.perf_counter() - started
    return _Row(tier.name, "contains_many", len(keys), elapsed, 0, [], len(keys) - sum(present))


async def _bench_pool(manager: Any, blocks: int, rounds: int) -> list[_Row]:
    import numpy as np

    block_bytes = manager.pool.block_bytes
    n = min(blocks, manager.pool.num_blocks)
    keys = [b"\xbf" + os.urandom(15) for _ in range(n)]
    data = np.frombuffer(os.urandom(block_bytes), np.uint8)
    src = np.broadcast_to(data, (n, block_bytes)).copy()
    started = time.perf_counter()
    stored = await manager.store(keys, src)
    rows = [_Row("manager", "store", n, time.perf_counter() - started, stored * block_bytes, [])]
    lookup = manager.lookup
    started = time.perf_counter()
    for _ in range(rounds):
        for key in keys:
            lookup(key)
    rows.append(_Row("manager", "lookup", n * rounds, time.perf_counter() - started, 0, []))
    out = np.empty((n, block_bytes), np.uint8)
    started = time.perf_counter()
    loaded = await manager.load(keys, out)
    rows.append(_Row("manager", "load", n, time.perf_counter() - started, loaded * block_bytes, []))
    await manager.wait_idle()  # let write-through finish before the tier rows are measured
    for tier in manager.tiers:
        for key in keys:
            await tier.delete(key)
    return rows


def run_bench(args: argparse.Namespace, out: IO[str]) -> int:
    import anyio

    from kvtier.manager._stack_config import FSConfig, KVTierConfig, PoolConfig

    with contextlib.ExitStack() as stack:
        config = _load_config(args.config)
        if config is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-"))
            config = KVTierConfig(
                pool=PoolConfig(num_blocks=max(args.blocks, 1), block_bytes=256 << 10),
                fs=FSConfig(root=os.path.join(folder, "fs"), fsync="never"),
            )
            out.write(f"no --config: a host pool and an FS tier in {folder}\n")
        block_bytes = args.block_bytes or config.pool.block_bytes

        async def run() -> list[_Row]:
            rows: list[_Row] = []
            async with config.build() as manager:
                rows += await _bench_pool(manager, args.blocks, args.rounds)
                for tier in manager.tiers:
                    rows += await _bench_tier(tier, args.blocks, block_bytes, args.concurrency)
            return rows

        rows = anyio.run(run)
    results = [r.as_dict() for r in rows]
    if args.json:
        json.dump({"block_bytes": block_bytes, "results": results}, out, indent=2)
        out.write("\n")
    else:
        out.write(
            f"block size {human_bytes(block_bytes)}, {args.blocks} blocks per tier operation\n"
        )
        out.write(
            f"{'target':<10} {'op':<14} {'count':>7} {'errors':>6} {'ops/s':>11} "
            f"{'MiB/s':>9} {'p50 ms':>8} {'p99 ms':>8}\n"
        )
        for r in results:
            mib = "-" if r["mib_per_s"] is None else f"{r['mib_per_s']:.1f}"
            p50 = "-" if r["p50_ms"] is None else f"{r['p50_ms']:.3f}"
            p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.3f}"
            out.write(
                f"{r['target']:<10} {r['op']:<14} {r['count']:>7} {r['errors']:>6} "
                f"{r['ops_per_s']:>11.0f} {mib:>9} {p50:>8} {p99:>8}\n"
            )
    return EXIT_BAD_DATA if any(r["errors"] for r in results) else EXIT_OK
