"""kvtier's FSTier behind vLLM (``kvtier.integrations.vllm``) beside vLLM's own ``fs`` tier.

    python -m benchmarks.bench_vllm_fs            # 512 MiB per case (the figures to report)
    python -m benchmarks.bench_vllm_fs --quick    # 256 MiB per case

Needs vLLM's tiering modules (`nox -s vllm` installs them). Both tiers are built by vLLM's
``SecondaryTierFactory`` over one primary view of 2 MiB chunks, and driven the way vLLM's
``TieringOffloadingManager`` drives them: every job submitted (``submit_store`` /
``submit_load``), then ``get_finished_jobs()`` polled until all are back. Two shapes: jobs of
128 blocks (one request's prefix) and jobs of 1 block (many small requests).

Contenders, all in the same run on the same filesystem:

- ``vllm-fs``: vLLM's pure-Python ``fs`` tier as it configures itself: O_DIRECT where the
  filesystem allows it, 16 read and 16 write threads, no fsync, no checksum. (Its C extension
  needs CUDA libraries; on a CPU machine vLLM falls back to this same Python path.)
- ``vllm-fs-buffered``: the same with O_DIRECT off (page cache on both sides).
- ``kvtier``: kvtier's FSTier as the adapter configures it: ``fsync="never"`` (vLLM's
  durability; a kill -9 still loses nothing), checksums on, O_DIRECT where the filesystem
  takes it (whole-page blocks move between the disk and vLLM's slots with no copy).
- ``kvtier-data``: ``"fsync": "data"`` (fdatasync before publishing; a kvtier config file's
  default).
- ``kvtier-buffered``: ``kvtier`` with ``"direct_io": false`` (the page cache on both sides).

Two floors for loads, outside vLLM's tier API: the same number of 2 MiB files (no header, in
folders two levels deep, as vLLM's are) read cold from 32 threads, each with one ``open`` (plus
O_DIRECT where the filesystem takes it), one ``preadv`` into the primary region and a
``close``: ``raw-read`` does nothing else, ``raw-read+xxh3`` also takes kvtier's checksum
(xxh3) of each block where it landed. The second is the least CPU any reader that verifies
what it read can spend; vLLM's fs tier verifies nothing, so its CPU per GiB sits near the
first.

The kvtier contenders read with 32 threads (the adapter's default, vLLM's fs tier's count)
and write with 16.

The adapter hands each job (and jobs submitted together) to the tier as one pinned batch
(``load_many``/``store_many``).

The process is set up as vLLM's engine sets up its own: the primary region is faulted in
before the first job (vLLM's ``SharedOffloadRegion`` pre-faults it with
``MADV_POPULATE_WRITE``) and the startup heap is frozen (vLLM's ``freeze_gc_heap``), so
neither a fresh mapping's page faults (~300 ms of CPU per GiB loaded, for every contender)
nor a full collection of the ~600k objects vLLM's imports leave (~0.3 s) lands in a phase.

Block hashes are random, as vLLM's (SHA-256) are, so both tiers' files spread over their
folders and both create them as they go: a fresh folder is part of what a store costs.

Loads are cold: before each load phase every stored file is evicted from the page cache
(``fsync`` + ``POSIX_FADV_DONTNEED``), so reads come from the device for every contender.
Each load is checked against what was stored, outside the timing. Every phase starts after
``os.sync()``, so no contender pays for another's writeback. The ratio column is each
contender's MiB/s over ``vllm-fs``'s in the same case; ``--repeat`` runs the contenders in
turn and keeps each one's best.

Each case's JSON holds ``ratios``: kvtier's load CPU per GiB over ``raw-read+xxh3``'s, its
store CPU per GiB and both MiB/s over ``vllm-fs``'s, each with its baseline and aim (from the
best of ``--repeat`` runs, all in this run). With ``strace`` on the machine (``--no-syscalls``
skips it), ``syscalls_per_block`` counts, in one more pass of ``vllm-fs`` and ``kvtier`` that is
not timed, the system calls per block stored and loaded: those on files (open, read, write,
close, ``cachestat``, ...) and the others (thread and loop wake-ups, memory; the harness's
own sleeps left out), see ``benchmarks.syscalls``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import mmap
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import add_json_flag, drop_cache, json_output
from benchmarks.syscalls import count_syscalls, per_block
from kvtier.common._format import checksum

try:
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ImportError:
    sys.exit("bench_vllm_fs needs vLLM's tiering modules: run it in `nox -s vllm`'s env")

MiB = 1 << 20
BLOCK = 2 * MiB
POLL = 0.0002  # seconds between get_finished_jobs() polls, the same for every contender
FLOOR_THREADS = 32  # vLLM's fs tier's 16 read and 16 write threads all take loads


def offloading_spec(num_chunks: int) -> TieringOffloadingSpec:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=BLOCK,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": num_chunks * BLOCK, "secondary_tiers": []},
        engine_id=f"bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="bench/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return TieringOffloadingSpec(config)


def contenders(root: Path) -> dict[str, dict[str, Any]]:
    kv = "kvtier.integrations.vllm"
    return {
        "vllm-fs": {"type": "fs", "root_dir": str(root / "vllm")},
        "vllm-fs-buffered": {"type": "fs", "root_dir": str(root / "vllm-buffered")},
        "kvtier": {
            "type": "kvtier",
            "module_path": kv,
            "tier": {"kind": "fs", "root": str(root / "kvtier")},  # the adapter's defaults
        },
        "kvtier-data": {
            "type": "kvtier",
            "module_path": kv,
            "tier": {"kind": "fs", "root": str(root / "kvtier-data"), "fsync": "data"},
        },
        "kvtier-buffered": {
            "type": "kvtier",
            "module_path": kv,
            "tier": {"kind": "fs", "root": str(root / "kvtier-buffered"), "direct_io": False},
        },
    }


def run_jobs(
    tier: Any, jobs: list[TransferJob], submit: Callable[[TransferJob], None]
) -> tuple[float, float]:
    """Submit every job, poll until all are back: (wall seconds, CPU seconds of this process,
    all threads). Raises if a job failed."""
    pending = {j.job_id for j in jobs}
    cpu = time.process_time()
    started = time.perf_counter()
    for job in jobs:
        submit(job)
    failed = []
    while pending:
        for result in tier.get_finished_jobs():
            pending.discard(result.job_id)
            if not result.success:
                failed.append(result.job_id)
        if pending:
            time.sleep(POLL)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    if failed:
        raise RuntimeError(f"{len(failed)} job(s) failed")
    return seconds, cpu


def populate(region: mmap.mmap) -> None:
    """Fault the whole primary region in, as vLLM's ``SharedOffloadRegion`` does when it
    creates the CPU tier (``MADV_POPULATE_WRITE``): in vLLM a load lands in resident memory,
    so the page faults of a fresh mapping are no part of either tier's cost."""
    try:
        region.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
    except OSError:  # before Linux 5.14: touch every page
        np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".json")]


def bench_case(
    name: str,
    tier_config: dict[str, Any],
    per_job: int,
    n_blocks: int,
    root: Path,
    calls: dict[str, dict[str, int]] | None = None,
) -> tuple[float, float, float, float]:
    """(store MiB/s, load MiB/s, store CPU ms/GiB, load CPU ms/GiB) for one case. With
    ``calls``, each phase's system calls are counted into it (``"store"``, ``"load"``): a
    pass whose times mean nothing."""
    spec = offloading_spec(2 * n_blocks)
    region = mmap.mmap(-1, 2 * n_blocks * BLOCK)
    populate(region)
    flat = memoryview(region)
    view = flat.cast("B", (2 * n_blocks, BLOCK))
    src = np.frombuffer(region, dtype=np.uint8)
    src[: n_blocks * BLOCK] = np.random.default_rng(per_job).integers(
        0, 256, n_blocks * BLOCK, dtype=np.uint8
    )
    tier = SecondaryTierFactory.create_secondary_tier(dict(tier_config), view, spec)
    if name == "vllm-fs-buffered":
        tier._use_o_direct = False  # the one knob vLLM's fs tier has no setting for
    try:
        # Block hashes as vLLM makes them (SHA-256 digests): uniformly random. vLLM's fs tier
        # files a block under folders named by the hash's first hex digits, kvtier under
        # folders named by a hash of the key, so with random hashes both spread their files
        # and both pay for the folders they create (a shared prefix would put every one of
        # vLLM's files in a single folder, and leave only kvtier creating folders).
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(n_blocks)]

        def jobs(first_slot: int, promotion: bool, id0: int) -> list[TransferJob]:
            return [
                TransferJob(
                    job_id=id0 + j,
                    keys=keys[j * per_job : (j + 1) * per_job],
                    chunk_ids=np.arange(
                        first_slot + j * per_job, first_slot + (j + 1) * per_job, dtype=np.int32
                    ),
                    is_promotion=promotion,
                    req_context=None,
                )
                for j in range(n_blocks // per_job)
            ]

        os.sync()  # start from a clean page cache: no contender pays another's writeback
        with counting(calls, "store"):
            store_s, store_cpu = run_jobs(tier, jobs(0, False, 0), tier.submit_store)
        drop_cache(files_under(root))
        os.sync()
        with counting(calls, "load"):
            load_s, load_cpu = run_jobs(tier, jobs(n_blocks, True, 10**6), tier.submit_load)
        if not np.array_equal(src[: n_blocks * BLOCK], src[n_blocks * BLOCK :]):
            raise RuntimeError(f"{name}: loaded bytes differ from the stored ones")
    finally:
        tier.shutdown()
        del src
        view.release()
        flat.release()
        region.close()
    total = n_blocks * BLOCK / MiB
    gib = total / 1024
    return total / store_s, total / load_s, store_cpu * 1e3 / gib, load_cpu * 1e3 / gib


@contextlib.contextmanager
def counting(calls: dict[str, dict[str, int]] | None, phase: str) -> Iterator[None]:
    """Count the body's system calls into ``calls[phase]`` (when ``calls`` is given)."""
    if calls is None:
        yield
        return
    with count_syscalls() as counts:
        yield
    calls[phase] = counts


def floors(n_blocks: int, root: Path) -> dict[str, tuple[float, float]]:
    """(load MiB/s, load CPU ms/GiB) of ``raw-read`` and ``raw-read+xxh3`` (see above)."""
    region = mmap.mmap(-1, n_blocks * BLOCK)
    populate(region)
    flat = memoryview(region)
    slots = [flat[i * BLOCK : (i + 1) * BLOCK] for i in range(n_blocks)]
    data = np.random.default_rng(n_blocks).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    paths = []
    for _ in range(n_blocks):
        name = os.urandom(16).hex()
        folder = root / name[:2] / name[2:4]
        folder.mkdir(parents=True, exist_ok=True)
        paths.append(folder / name)
        paths[-1].write_bytes(data)
    direct = getattr(os, "O_DIRECT", 0)
    try:  # O_DIRECT where the filesystem takes it, as vLLM's tier and kvtier's decide
        os.close(os.open(paths[0], os.O_RDONLY | direct))
    except OSError:
        direct = 0
    expected = checksum(data)

    def read(i: int, verify: bool) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC | direct)
        try:
            if os.preadv(fd, [slots[i]], 0) != BLOCK:
                raise RuntimeError(f"{paths[i]}: short read")
        finally:
            os.close(fd)
        if verify and checksum(slots[i]) != expected:
            raise RuntimeError(f"{paths[i]}: checksum mismatch")

    figures = {}
    gib = n_blocks * BLOCK / (1 << 30)
    try:
        with concurrent.futures.ThreadPoolExecutor(FLOOR_THREADS) as pool:
            list(pool.map(time.sleep, [0.001] * FLOOR_THREADS))  # every thread started
            for name, verify in (("raw-read", False), ("raw-read+xxh3", True)):
                drop_cache(paths)
                os.sync()
                cpu, started = time.process_time(), time.perf_counter()
                list(pool.map(read, range(n_blocks), [verify] * n_blocks))
                seconds = time.perf_counter() - started
                figures[name] = (gib * 1024 / seconds, (time.process_time() - cpu) * 1e3 / gib)
    finally:
        for slot in slots:
            slot.release()
        flat.release()
        region.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB per case")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the best counts")
    parser.add_argument(
        "--syscalls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count system calls per block (strace; a pass of its own per case)",
    )
    add_json_flag(parser)
    args = parser.parse_args()
    # vLLM's EngineCore freezes its startup heap (vllm.utils.gc_utils.freeze_gc_heap), so a
    # full collection in the scheduler process never walks the ~600k objects its imports
    # made. Do the same here: else a 0.3 s collection lands in whichever phase runs then.
    gc.collect()
    gc.freeze()
    n_blocks = 128 if args.quick else 256
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    with json_output(args.json) as out:
        out["settings"] = {
            "blocks": n_blocks,
            "block_mib": BLOCK // MiB,
            "repeat": args.repeat,
            "syscalls": args.syscalls,
            "folder": str(base),
            "cpu_count": os.cpu_count(),
        }
        out["baseline"] = "vllm-fs"
        print(
            f"{n_blocks} blocks of {BLOCK // MiB} MiB per case ({n_blocks * BLOCK // MiB} MiB), "
            f"{os.cpu_count()} CPUs, folder {base}"
        )
        jobs = [per_job for per_job in (128, 1) if per_job <= n_blocks]
        out["cases"] = [run_case(args, base, per_job, n_blocks) for per_job in jobs]


def run_case(args: argparse.Namespace, base: Path, per_job: int, n_blocks: int) -> dict[str, Any]:
    """Every contender with ``per_job`` blocks per transfer job, the best of ``--repeat`` runs;
    printed, and returned with each throughput as a ratio of vLLM's own FS tier."""
    figures: dict[str, tuple[float, float, float, float]] = {}
    floor_figures: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeat):
        for name in contenders(base):
            root = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir=base))
            try:
                got = bench_case(name, contenders(root)[name], per_job, n_blocks, root)
            finally:
                with contextlib.suppress(OSError):
                    shutil.rmtree(root)
            best = figures.get(name, (0.0, 0.0, float("inf"), float("inf")))
            figures[name] = (
                max(best[0], got[0]),
                max(best[1], got[1]),
                min(best[2], got[2]),
                min(best[3], got[3]),
            )
        root = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir=base))
        try:
            for name, (load, load_cpu) in floors(n_blocks, root).items():
                best_floor = floor_figures.get(name, (0.0, float("inf")))
                floor_figures[name] = (max(best_floor[0], load), min(best_floor[1], load_cpu))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    ref = figures["vllm-fs"]
    print(f"\n{per_job} block(s) per job (MiB/s: best run; CPU: ms of this process per GiB)")
    head = ("tier", "store MiB/s", "x vllm-fs", "load MiB/s", "x vllm-fs", "store CPU", "load CPU")
    print("  {:<18} {:>12} {:>10} {:>12} {:>10} {:>10} {:>10}".format(*head))
    rows = {}
    for name, (store, load, store_cpu, load_cpu) in figures.items():
        rows[name] = {
            "store_mib_s": store,
            "load_mib_s": load,
            "store_of_vllm_fs": store / ref[0],
            "load_of_vllm_fs": load / ref[1],
            "store_cpu_ms_per_gib": store_cpu,
            "load_cpu_ms_per_gib": load_cpu,
        }
        print(
            f"  {name:<18} {store:>12.0f} {store / ref[0]:>10.2f} "
            f"{load:>12.0f} {load / ref[1]:>10.2f} {store_cpu:>10.0f} {load_cpu:>10.0f}"
        )
    floor_rows = {}
    for name, (load, load_cpu) in floor_figures.items():
        floor_rows[name] = {
            "load_mib_s": load,
            "load_of_vllm_fs": load / ref[1],
            "load_cpu_ms_per_gib": load_cpu,
            "load_cpu_of_vllm_fs": load_cpu / ref[3],
        }
        print(
            f"  {name:<18} {'-':>12} {'-':>10} {load:>12.0f} {load / ref[1]:>10.2f} "
            f"{'-':>10} {load_cpu:>10.0f}"
        )
    verified = floor_figures["raw-read+xxh3"][1]
    print(
        f"  load CPU per GiB over vllm-fs's: raw-read+xxh3 {verified / ref[3]:.2f}x, "
        f"kvtier {figures['kvtier'][3] / ref[3]:.2f}x ({figures['kvtier'][3] / verified:.2f}x "
        "raw-read+xxh3's)"
    )
    kv = figures["kvtier"]
    # What issue-sized aims are judged by: kvtier's figures over their baselines, same run.
    ratios = {
        "load_cpu_of_floor": {"baseline": "raw-read+xxh3", "ratio": kv[3] / verified, "aim": 1.25},
        "store_cpu_of_vllm_fs": {"baseline": "vllm-fs", "ratio": kv[2] / ref[2], "aim": 1.1},
        "store_mib_s_of_vllm_fs": {"baseline": "vllm-fs", "ratio": kv[0] / ref[0], "aim": 1.0},
        "load_mib_s_of_vllm_fs": {"baseline": "vllm-fs", "ratio": kv[1] / ref[1], "aim": 1.0},
    }
    for label, ratio in ratios.items():
        print(f"  kvtier {label}: {ratio['ratio']:.2f}x (aim {ratio['aim']})")
    case = {"blocks_per_job": per_job, "contenders": rows, "floors": floor_rows, "ratios": ratios}
    if args.syscalls:
        case["syscalls_per_block"] = syscalls(base, per_job, n_blocks)
    return case


# Contenders whose system calls are counted, and the calls that are the harness's own (the
# poll loop's sleeps between ``get_finished_jobs`` calls).
COUNTED = ("vllm-fs", "kvtier")
HARNESS_CALLS = frozenset({"clock_nanosleep"})


def syscalls(base: Path, per_job: int, n_blocks: int) -> dict[str, Any]:
    """System calls per block stored and loaded (``benchmarks.syscalls``), in a pass of their
    own for each of ``COUNTED``: strace slows every call, so these passes are never timed."""
    out: dict[str, Any] = {}
    for name in COUNTED:
        root = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir=base))
        calls: dict[str, dict[str, int]] = {}
        try:
            bench_case(name, contenders(root)[name], per_job, n_blocks, root, calls)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out[name] = {phase: per_block(c, n_blocks, HARNESS_CALLS) for phase, c in calls.items()}
        for phase, counted in out[name].items():
            if counted["file"] is not None:
                print(
                    f"  {name} {phase}: {counted['file']:.2f} file system calls per block, "
                    f"{counted['other']:.1f} others (threads, loops, memory)"
                )
    return out


if __name__ == "__main__":
    main()
