"""FSTier throughput and promotion latency, beside baselines measured in the same run.

    python -m benchmarks.bench_fs            # 1 GiB of 2 MiB blocks (the figures to report)
    python -m benchmarks.bench_fs --quick    # 128 MiB, about 20 s (the nox bench session)

Baselines, on the same folder's filesystem and the same bytes:

- ``disk``: what the device does: O_DIRECT writes (each file fdatasync'd) and O_DIRECT reads
  from as many threads as FSTier may use, so the page cache plays no part.
- ``plain``: plain synchronous Python, one file at a time: ``open().write()`` + ``fdatasync``
  and ``open().readinto()``.
- ``aiofiles``: the same publish protocol FSTier uses (temporary file, write, fdatasync,
  rename) and ``readinto`` loads (then the checksum, off the loop) written with aiofiles, one
  await per OS call, at FSTier's concurrency: the design FSTier did not take (one worker-thread
  call per operation).

Cold loads drop every file from the page cache first (fsync, then ``posix_fadvise(...,
POSIX_FADV_DONTNEED)``); warm loads read what the page cache already holds. Stores use
``fsync="data"`` (durable: fdatasync before the rename). Promotion latency is one
``TieringManager.lookup()`` -> HIT of a block that lives only in the FSTier (existence already
known), into a ``HostPool``, beside one plain open + readinto of the same file and beside a
reader that verifies what it read (the aims are against it: cold, the floor, an O_DIRECT read
into an aligned buffer and xxh3 over it; warm, a plain read and xxh3); warm ones are
measured again with every read in a worker thread (``loop_read_bytes=0``, where the tier's
default reads a small page-cached load on the event loop), each with the CPU time the event
loop's thread spent per promotion (``--loop-read-bytes`` sets the default side's limit).

The cost of the integrity key: a second FSTier with ``integrity_key`` set (every block signed
with a keyed BLAKE3 MAC and verified on load instead of xxh3) takes its turn in the same
rounds as the plain (xxh3) FSTier, and ``hash`` prints what each costs on one thread in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import anyio

from benchmarks.common import add_json_flag, drop_cache, json_output, settings
from kvtier import (
    FSConfig,
    FSTier,
    HostPool,
    IntegrityKey,
    LookupResult,
    TieringManager,
    block_keys,
)
from kvtier.common._format import checksum  # the aiofiles baseline verifies as FSTier does
from kvtier.common._settings import parse_size

MiB = 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- baselines -----------------------------------------------------------------------------------


def plain_write(paths: Sequence[Path], blocks: Sequence[memoryview]) -> float:
    started = time.perf_counter()
    for p, b in zip(paths, blocks, strict=True):
        with open(p, "wb") as f:
            f.write(b)
            f.flush()
            os.fdatasync(f.fileno())
    return time.perf_counter() - started


def plain_read(paths: Sequence[Path], dst: memoryview) -> float:
    started = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            f.readinto(dst)
    return time.perf_counter() - started


def odirect_supported(folder: Path) -> bool:
    probe = folder / "odirect-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def disk_io(
    paths: Sequence[Path], block_bytes: int, threads: int, write: bool, source: memoryview
) -> float:
    """O_DIRECT writes (+fdatasync) or reads of whole files from ``threads`` threads."""

    def one(i: int, p: Path) -> None:
        buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT needs
        if write:
            buf[:] = source[(i % 8) * block_bytes : (i % 8 + 1) * block_bytes]
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                os.write(fd, buf)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        else:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                os.readv(fd, [buf])
            finally:
                os.close(fd)
        buf.close()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(paths)), paths))
    return time.perf_counter() - started


async def aiofiles_store(path: Path, payload: memoryview) -> None:
    tmp = path.with_name(path.name + ".tmp")
    async with aiofiles.open(tmp, "wb") as f:
        await f.write(payload)
        await f.flush()
        await aiofiles.os.wrap(os.fdatasync)(f.fileno())
    await aiofiles.os.rename(tmp, path)


async def aiofiles_load(path: Path, dst: memoryview) -> None:
    async with aiofiles.open(path, "rb", buffering=0) as f:
        await f.readinto(dst)
    await anyio.to_thread.run_sync(checksum, dst)  # verified, as FSTier's loads are


# -- FSTier -------------------------------------------------------------------------------------


async def tier_run(
    indices: Sequence[int],
    width: int,
    op: Callable[[int, memoryview], Awaitable[None]],
    scratch: memoryview,
    size: int,
) -> float:
    """Run ``op(i, buffer)`` for every index with ``width`` in flight; return the seconds."""
    todo = iter(indices)

    async def lane(lane_no: int) -> None:
        buf = scratch[lane_no * size : (lane_no + 1) * size]
        for i in todo:
            await op(i, buf)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for lane_no in range(width):
            tg.start_soon(lane, lane_no)
    return time.perf_counter() - started


async def promotion_latency(
    root: Path,
    keys: Sequence[bytes],
    block_bytes: int,
    cold: bool,
    loop_read_bytes: int | None = None,
) -> tuple[list[float], list[float]]:
    """One promotion per key, into a ``HostPool``: each one's latency, and the CPU time the
    event loop's thread spent meanwhile. ``loop_read_bytes``: the tier's setting (None: its
    default; 0: every read in a worker thread)."""
    pool = HostPool(len(keys) + 1, block_bytes)
    for slot in range(pool.num_blocks):
        # Touch every page first, as a serving pool's memory has been long before: the first
        # touch of fresh anonymous memory costs ~1 ms per MiB of page faults in a VM, which
        # would otherwise be billed to the promotion.
        pool.slot_view(slot)[:] = bytes(block_bytes)
    tier = (
        FSTier(root) if loop_read_bytes is None else FSTier(root, loop_read_bytes=loop_read_bytes)
    )
    samples, loop_cpu = [], []
    async with TieringManager(pool, [tier]) as manager:
        for k in keys:
            assert await tier.contains_many([k]) == [True]
            tier.record_hit(k)  # existence known: measure the promotion itself
        for k in keys:
            if cold:
                await anyio.to_thread.run_sync(drop_cache, [tier_path(root, k)])
            else:  # warm: the file is in the page cache, as the plain read's is
                await anyio.to_thread.run_sync(tier_path(root, k).read_bytes)
            event = manager.watch([k])
            started, cpu = time.perf_counter(), time.thread_time()
            assert manager.lookup(k) is LookupResult.RETRY
            await event.wait()
            samples.append(time.perf_counter() - started)
            loop_cpu.append(time.thread_time() - cpu)
            manager.unwatch([k], event)
            assert manager.lookup(k) is LookupResult.HIT
            pinned = pool.pin(k)
            assert pinned is not None
            try:  # a figure is only worth reporting if the right bytes arrived
                expected = await anyio.to_thread.run_sync(tier_path(root, k).read_bytes)
                if pool.slot_view(pinned) != expected[-block_bytes:]:
                    raise AssertionError("promotion did not deliver the block's bytes")
            finally:
                pool.unpin(pinned)
    return samples, loop_cpu


def plain_latency(paths: Sequence[Path], block_bytes: int, cold: bool) -> list[float]:
    dst = memoryview(bytearray(block_bytes))
    samples = []
    for p in paths:
        if cold:
            drop_cache([p])
        else:  # in the page cache, whatever read it last (an O_DIRECT read does not)
            p.read_bytes()
        started = time.perf_counter()
        with open(p, "rb", buffering=0) as f:
            f.readinto(dst)
        samples.append(time.perf_counter() - started)
    return samples


def verifying_latency(
    paths: Sequence[Path], block_bytes: int, cold: bool, slots: bool = False
) -> list[float]:
    """One read of each file that verifies what it read, the least a verifying reader can
    spend: cold, the floor (open with O_DIRECT where the file system takes it, one ``preadv``
    into an aligned buffer, close, xxh3 over the bytes where they landed); warm, a plain read
    from the page cache and the same xxh3. Into one buffer, warm in the CPU's caches from the
    read before; with ``slots``, each file into a slot of its own of one pool-sized buffer
    (touched first, as a serving pool's memory is), as any promotion lands a block in a slot
    that the reads before it did not just write."""
    size = -(-block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    buf = mmap.mmap(-1, size * (len(paths) if slots else 1))
    whole = memoryview(buf)
    whole[:] = bytes(len(buf))
    direct = getattr(os, "O_DIRECT", 0) if cold and odirect_supported(paths[0].parent) else 0
    samples = []
    try:
        for i, p in enumerate(paths):
            view = whole[i * size : (i + 1) * size] if slots else whole[:size]
            if cold:
                drop_cache([p])
            else:  # in the page cache, whatever read it last (an O_DIRECT read does not)
                p.read_bytes()
            started = time.perf_counter()
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | direct)
            try:
                got = os.preadv(fd, [view], 0)
            finally:
                os.close(fd)
            checksum(view[:got])
            samples.append(time.perf_counter() - started)
            view.release()
    finally:
        whole.release()
        buf.close()
    return samples


def tier_path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[-4:-2] / name[-2:] / name


def hash_speed(block_bytes: int) -> dict[str, float]:
    """GB/s of xxh3 and of the keyed BLAKE3 MAC over one block, on one thread, in memory."""
    block = memoryview(bytearray(os.urandom(block_bytes)))
    ikey = IntegrityKey(os.urandom(32))
    out: dict[str, float] = {}
    for label, fn in (
        ("xxh3", lambda: checksum(block)),
        ("blake3 mac", lambda: ikey.mac(b"header", block)),
    ):
        reps = max(4, (256 * MiB) // block_bytes)
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        out[label] = gbps(reps * block_bytes, time.perf_counter() - started)
    return out


# -- the run ------------------------------------------------------------------------------------


async def main(args: argparse.Namespace, out: dict[str, Any]) -> None:
    block_bytes = int(args.block_mib * MiB)
    n = max(args.rounds, int(args.total_mib // args.block_mib))
    total = n * block_bytes
    width = args.concurrency
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.dir))
    try:
        source = memoryview(bytearray(os.urandom(8 * block_bytes)))
        blocks = [source[(i % 8) * block_bytes : (i % 8 + 1) * block_bytes] for i in range(n)]
        keys = block_keys(list(range(n)), 1, namespace=os.urandom(8))
        (base / "plain").mkdir()
        (base / "disk").mkdir()
        (base / "aio").mkdir()
        plain_paths = [base / "plain" / f"{i}" for i in range(n)]
        aio_paths = [base / "aio" / f"{i}" for i in range(n)]
        disk_paths = [base / "disk" / f"{i}" for i in range(n)]
        root = base / "tier"
        tier_paths = [tier_path(root, k) for k in keys]
        signed_root = base / "tier-signed"
        signed_paths = [tier_path(signed_root, k) for k in keys]
        has_odirect = odirect_supported(base)
        print(
            f"bench_fs: {n} blocks x {args.block_mib} MiB = {total / MiB:.0f} MiB in {base}, "
            f"concurrency {width}, fsync={args.fsync}, {args.rounds} interleaved rounds",
            flush=True,
        )
        # The disk of a VM drifts from second to second, so each figure is the median of
        # rounds in which the baselines and FSTier take turns (in rotating order).
        chunks = [
            list(range(r * n // args.rounds, (r + 1) * n // args.rounds))
            for r in range(args.rounds)
        ]
        runs: dict[str, list[float]] = {}
        scratch = memoryview(mmap.mmap(-1, width * block_bytes))
        thread = anyio.to_thread.run_sync

        signed_tier = FSTier(
            signed_root,
            fsync=args.fsync,
            max_concurrency=width,
            integrity_key=IntegrityKey(os.urandom(32)),
        )
        async with FSTier(root, fsync=args.fsync, max_concurrency=width) as tier, signed_tier:

            async def signed_store(i: int, _: memoryview) -> None:
                await signed_tier.store(keys[i], blocks[i])

            async def signed_load(i: int, buf: memoryview) -> None:
                await signed_tier.load(keys[i], buf)

            async def store(i: int, _: memoryview) -> None:
                await tier.store(keys[i], blocks[i])

            async def load(i: int, buf: memoryview) -> None:
                await tier.load(keys[i], buf)

            async def aio_store(i: int, _: memoryview) -> None:
                await aiofiles_store(aio_paths[i], blocks[i])

            async def aio_load(i: int, buf: memoryview) -> None:
                await aiofiles_load(aio_paths[i], buf)

            def pick(paths: list[Path], idx: list[int]) -> list[Path]:
                return [paths[i] for i in idx]

            async def phases(r: int, idx: list[int], kind: str) -> None:
                nbytes = len(idx) * block_bytes
                one = scratch[:block_bytes]
                todo: list[tuple[str, Callable[[], Awaitable[float]]]] = []
                if kind == "store":
                    todo.append(
                        (
                            "plain store",
                            lambda: thread(
                                plain_write, pick(plain_paths, idx), [blocks[i] for i in idx]
                            ),
                        )
                    )
                    if has_odirect:
                        todo.append(
                            (
                                "disk write",
                                lambda: thread(
                                    disk_io, pick(disk_paths, idx), block_bytes, width, True, source
                                ),
                            )
                        )
                    todo.append(
                        (
                            "aiofiles store",
                            lambda: tier_run(idx, width, aio_store, scratch, block_bytes),
                        )
                    )
                    todo.append(
                        ("fstier store", lambda: tier_run(idx, width, store, scratch, block_bytes))
                    )
                    todo.append(
                        (
                            "signed store",
                            lambda: tier_run(idx, width, signed_store, scratch, block_bytes),
                        )
                    )
                elif kind == "cold":

                    async def plain_cold() -> float:
                        await thread(drop_cache, pick(plain_paths, idx))
                        return await thread(plain_read, pick(plain_paths, idx), one)

                    async def tier_cold() -> float:
                        await thread(drop_cache, pick(tier_paths, idx))
                        return await tier_run(idx, width, load, scratch, block_bytes)

                    async def aio_cold() -> float:
                        await thread(drop_cache, pick(aio_paths, idx))
                        return await tier_run(idx, width, aio_load, scratch, block_bytes)

                    async def signed_cold() -> float:
                        await thread(drop_cache, pick(signed_paths, idx))
                        return await tier_run(idx, width, signed_load, scratch, block_bytes)

                    todo.append(("signed load cold", signed_cold))
                    todo.append(("plain load cold", plain_cold))
                    todo.append(("aiofiles load cold", aio_cold))
                    if has_odirect:
                        todo.append(
                            (
                                "disk read",
                                lambda: thread(
                                    disk_io,
                                    pick(disk_paths, idx),
                                    block_bytes,
                                    width,
                                    False,
                                    source,
                                ),
                            )
                        )
                    todo.append(("fstier load cold", tier_cold))
                else:
                    todo.append(
                        ("plain load warm", lambda: thread(plain_read, pick(plain_paths, idx), one))
                    )
                    todo.append(
                        (
                            "fstier load warm",
                            lambda: tier_run(idx, width, load, scratch, block_bytes),
                        )
                    )
                    todo.append(
                        (
                            "signed load warm",
                            lambda: tier_run(idx, width, signed_load, scratch, block_bytes),
                        )
                    )
                shift = r % len(todo)
                for label, run in todo[shift:] + todo[:shift]:
                    runs.setdefault(label, []).append(gbps(nbytes, await run()))

            for kind in ("store", "cold", "warm"):
                for r, idx in enumerate(chunks):
                    await phases(r, idx, kind)
        samples = min(args.samples, n)
        latency = await latencies(root, keys[:samples], plain_paths[:samples], block_bytes, out)

        rows = {label: statistics.median(v) for label, v in runs.items()}
        out["gb_s_median"] = rows
        out["gb_s_rounds"] = runs
        print(f"{'':20}{'GB/s median':>12}   rounds")
        for label, values in runs.items():
            print(f"{label:20}{rows[label]:12.2f}   " + " ".join(f"{v:.2f}" for v in values))
        print("ratios (>= 1: FSTier as fast or faster):")
        ratio = {
            "store / plain store": rows["fstier store"] / rows["plain store"],
            "cold load / plain cold": rows["fstier load cold"] / rows["plain load cold"],
            "warm load / plain warm": rows["fstier load warm"] / rows["plain load warm"],
            "store / aiofiles store": rows["fstier store"] / rows["aiofiles store"],
            "cold load / aiofiles cold": rows["fstier load cold"] / rows["aiofiles load cold"],
        }
        if has_odirect:
            ratio["store / disk write (aim >= 0.9)"] = rows["fstier store"] / rows["disk write"]
            ratio["cold load / disk read (aim >= 0.9)"] = (
                rows["fstier load cold"] / rows["disk read"]
            )
        out["ratios"] = ratio  # each label names the figure and its baseline
        for label, value in ratio.items():
            print(f"  {label:40}{value:6.2f}x")
        print("integrity key (signed FSTier / xxh3 FSTier, same rounds; 1.00x: free):")
        out["integrity_key_cost"] = {
            op: {"baseline": f"fstier {op}", "ratio": rows[f"signed {op}"] / rows[f"fstier {op}"]}
            for op in ("store", "load cold", "load warm")
        }
        for op in ("store", "load cold", "load warm"):
            signed, plain_tier = rows[f"signed {op}"], rows[f"fstier {op}"]
            print(f"  {op:40}{signed / plain_tier:6.2f}x   ({signed:.2f} vs {plain_tier:.2f} GB/s)")
        out["hash_gb_s"] = speeds = await thread(hash_speed, block_bytes)
        print(
            "hash, one thread in memory: "
            + ", ".join(f"{label} {value:.2f} GB/s" for label, value in speeds.items())
        )
        report_latency(latency, samples, args.block_mib, out)
        out["odirect"] = has_odirect
        if not has_odirect:
            print("note: O_DIRECT is not supported here; no disk baseline", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)


async def latencies(
    root: Path,
    keys: Sequence[bytes],
    plain_paths: Sequence[Path],
    block_bytes: int,
    out: dict[str, Any],
    repeat: int = 2,
    loop_read_bytes: int | None = None,
) -> dict[str, float]:
    """Median promotion and plain-read latency, cold and warm, the two taking turns
    ``repeat`` times (the machine drifts), and warm promotions again with every read in a
    worker thread, with the loop's CPU per promotion; each turn's medians go to ``out`` too."""
    turns: dict[str, list[float]] = {}

    def add(label: str, values: list[float]) -> None:
        turns.setdefault(label, []).append(statistics.median(values) * 1e3)

    for _ in range(repeat):
        for cold in (True, False):
            tag = "cold" if cold else "warm"
            promo, cpu = await promotion_latency(root, keys, block_bytes, cold, loop_read_bytes)
            plain = await anyio.to_thread.run_sync(plain_latency, plain_paths, block_bytes, cold)
            floor = await anyio.to_thread.run_sync(
                verifying_latency, plain_paths, block_bytes, cold
            )
            add(f"promotion {tag}", promo)
            add(f"plain read {tag}", plain)
            add(f"verifying read {tag}", floor)
            if not cold:  # the same promotions, each read in a worker thread
                floor = await anyio.to_thread.run_sync(
                    verifying_latency, plain_paths, block_bytes, cold, True
                )
                add("verifying read warm, into pool slots", floor)
                add("loop cpu warm", cpu)
                promo, cpu = await promotion_latency(root, keys, block_bytes, cold, 0)
                add("promotion warm, in a thread", promo)
                add("loop cpu warm, in a thread", cpu)
    out["latency_ms_turns"] = turns
    return {label: statistics.median(values) for label, values in turns.items()}


def report_latency(
    latency: dict[str, float],
    samples: int,
    block_mib: float,
    out: dict[str, Any],
    loop_read_bytes: int | None = None,
) -> None:
    out["latency_ms_median"] = latency
    # The aims are against a reader that verifies (``verifying_latency``): the floor cold, a
    # plain read and xxh3 warm; the plain read alone is shown beside them.
    out["latency_ratios"] = {
        tag: {
            "baseline": f"verifying read {tag}",
            "ratio": latency[f"promotion {tag}"] / latency[f"verifying read {tag}"],
            "aim": aim,
        }
        for tag, aim in (("cold", 1.1), ("warm", 1.25))
    }
    for tag in ("cold", "warm"):
        out["latency_ratios"][f"{tag}, of a plain read"] = {
            "baseline": f"plain read {tag}",
            "ratio": latency[f"promotion {tag}"] / latency[f"plain read {tag}"],
        }
    out["latency_ratios"]["warm, of the floor into pool slots"] = {
        "baseline": "verifying read warm, into pool slots",
        "ratio": latency["promotion warm"] / latency["verifying read warm, into pool slots"],
    }
    threaded = latency["promotion warm, in a thread"]
    out["latency_ratios"]["warm on the loop"] = {
        "baseline": "promotion warm, in a thread",
        "ratio": latency["promotion warm"] / threaded,
    }
    print(f"latency, median of {samples} ({block_mib} MiB block):")
    for tag in ("cold", "warm"):
        p_ms, r_ms = latency[f"promotion {tag}"], latency[f"plain read {tag}"]
        v_ms, aim = latency[f"verifying read {tag}"], out["latency_ratios"][tag]["aim"]
        floor = "the floor (O_DIRECT read + xxh3)" if tag == "cold" else "plain read + xxh3"
        print(
            f"  {tag}: promotion FS -> HostPool {p_ms:7.2f} ms, {floor} {v_ms:7.2f} ms, "
            f"ratio {p_ms / v_ms:5.2f}x (aim <= {aim}); plain read {r_ms:7.2f} ms"
        )
    warm, slotted = latency["promotion warm"], latency["verifying read warm, into pool slots"]
    print(
        f"  warm, the same verifying read into a slot of its own per block (as a promotion "
        f"lands) {slotted:7.2f} ms: promotion {warm / slotted:5.2f}x of it"
    )
    limit = FSConfig(root=".").loop_read_bytes if loop_read_bytes is None else loop_read_bytes
    print(
        f"  warm, every read in a worker thread (loop_read_bytes=0) {threaded:7.2f} ms: "
        f"{warm / threaded:5.2f}x of it with page-cached loads up to {limit >> 10} KiB "
        "read on the event loop"
    )
    on_loop, in_thread = latency["loop cpu warm"], latency["loop cpu warm, in a thread"]
    print(
        f"  the event loop's CPU per warm promotion: {on_loop:5.2f} ms, in a thread "
        f"{in_thread:5.2f} ms: {on_loop / in_thread:5.2f}x"
    )


async def latency_only(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Only the promotion latencies: ``samples`` blocks stored by an FSTier at its defaults
    and the same bytes as plain files."""
    block_bytes = int(args.block_mib * MiB)
    n = args.samples
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.dir))
    try:
        keys = block_keys(list(range(n)), 1, namespace=os.urandom(8))
        blocks = [memoryview(os.urandom(block_bytes)) for _ in range(n)]
        (base / "plain").mkdir()
        plain_paths = [base / "plain" / f"{i}" for i in range(n)]
        await anyio.to_thread.run_sync(plain_write, plain_paths, blocks)
        root = base / "tier"
        async with FSTier(root) as tier:
            for k, b in zip(keys, blocks, strict=True):
                await tier.store(k, b)
        print(f"bench_fs --latency-only: {n} blocks x {args.block_mib} MiB in {base}", flush=True)
        latency = await latencies(
            root, keys, plain_paths, block_bytes, out, args.repeat, args.loop_read_bytes
        )
        report_latency(latency, n, args.block_mib, out, args.loop_read_bytes)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB and fewer samples")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument(
        "--block-mib", type=float, default=2, help="block size in MiB (0.25: 256 KiB)"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--samples", type=int, default=50, help="promotion latency samples")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per phase")
    parser.add_argument("--fsync", default="data", choices=("never", "data", "always"))
    parser.add_argument("--dir", default=None, help="folder on the filesystem to measure")
    parser.add_argument(
        "--latency-only", action="store_true", help="only promotion vs plain read latency"
    )
    parser.add_argument("--repeat", type=int, default=2, help="latency turns (with --latency-only)")
    parser.add_argument(
        "--loop-read-bytes",
        type=parse_size,
        default=None,
        help="the promoting tier's loop_read_bytes (with --latency-only; default: its default)",
    )
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mib, args.samples = min(args.total_mib, 128), min(args.samples, 20)
    return args


def run(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    with json_output(args.json) as out:
        out["settings"] = settings(
            args,
            *("quick", "total_mib", "block_mib", "concurrency", "samples", "rounds", "fsync"),
            "loop_read_bytes",
        )
        asyncio.run((latency_only if args.latency_only else main)(args, out))


if __name__ == "__main__":
    run()
