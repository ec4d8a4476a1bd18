"""Restart after a crash: how soon a tier that was killed with SIGKILL serves its blocks again.

    python -m benchmarks.restart --quick            # fs 10^5 and s3 2*10^4 blocks of 4 KiB
    python -m benchmarks.restart                    # fs 10^6 and s3 10^5 blocks
    python -m benchmarks.restart --tier fs --blocks 200000 --json

For each case a filler process (``benchmarks.restart_worker fill``) stores N blocks of
``--block-bytes`` and reports that the fill is done; this process then kills it with SIGKILL,
drops the page cache where it may (``os.sync()``, then ``3`` into
``/proc/sys/vm/drop_caches``; without the permission the run goes on and says so), and a fresh
process reopens the tier (``reopen``). It reports:

- ``open_s``: from building the tier to ``open()`` returning (``empty_open_s``: the same for
  a tier on an empty folder or prefix, in the fresh ``memory`` process: the floor);
- ``first_hit_s``: to the first HIT of a block stored before the kill (polled every
  millisecond from the moment the tier is built, while ``open()`` runs);
- ``index_complete_s``: to the start of the round of lookups in which every block stored
  before the kill answered HIT (``stored_blocks_missing`` counts those that never did within
  60 s after ``open()`` returned). For S3 also ``index_listing_complete``
  (``S3TierStatistics``) and whether the index came from a listing of the prefix or an index
  snapshot (``opened_from``);
- memory per indexed block, two ways: ``traced_bytes_per_block`` from a third fresh process
  (``memory``) under ``tracemalloc``: the traced bytes the full tier's ``open()`` added, less
  those a second tier on an empty folder or prefix added (the fixed cost of a tier: client,
  threads, buffers), divided by the blocks indexed (``traced_raw_bytes_per_block`` without
  that subtraction); and ``rss_bytes_per_block``, the reopening process's RSS growth over the
  open (fixed costs and allocator slack included) divided by the same;
- ``false_hits``: of 1,000 keys never stored, those that answer HIT;
- FS only, ``evictions``: the reopened tier, its capacity set to the bytes the filler stored,
  stores E new blocks (E = 1,000, at most N/2) one at a time and notes which block each store
  evicted (the tier's ``evicted`` events). The filler had stored blocks 0..2E-1 one at a time,
  the rest in batches, then loaded blocks 0..E-1 in a shuffled order, so before the kill the
  next E to evict were blocks E..2E-1, in that order (confirmed from the filler's own catalog:
  ``lru_order_confirmed``). ``order_match``: the fraction of the E evictions that evicted
  exactly the expected block at its place in that order; ``set_match``: the fraction of them
  among the expected E, in any order; ``touched_evicted``: the fraction that were blocks the
  filler had loaded just before the kill. The S3 tier never evicts for capacity (a bucket's
  lifecycle rules do), so it has none.

S3 runs two cases on a SeaweedFS: ``s3_listing`` (the filler writes no index snapshot, so
the reopened tier lists the prefix and reads every pack's table) and ``s3_snapshot`` (the
filler, with ``index_snapshot_every=2``, waits until an index snapshot taken after the fill is
in the bucket before it reports; the reopened tier, with the defaults, loads it). Without
``--s3-endpoint`` the benchmark starts its own SeaweedFS on 127.0.0.1 (``devtools``) and stops
it at the end; with one, it uses the bucket given (``--s3-bucket``, which must exist) under a
fresh prefix, and deletes what it wrote there at the end. The FS cases write in a temporary
folder under ``--dir`` (on the disk: not tmpfs, or dropping the page cache means nothing),
removed at the end. The filler stores with ``fsync="never"`` (``--fsync``): a killed process
loses nothing a store returned under any policy, and the fill is not what is measured.

Nothing is asserted: the figures describe today's behaviour, printed beside the aims (first
HIT within 2 s at 10^6 blocks, at most 128 bytes per block, at least 99% of the eviction
order kept). ``--json`` prints one JSON object: ``settings``, ``aims``, ``notes`` and, per
case under ``cases``, the figures above with the fill's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from benchmarks.common import add_json_flag, drop_page_cache, json_output, settings
from benchmarks.restart_worker import READY, Spec
from kvtier.common._settings import parse_size

ROOT = Path(__file__).resolve().parents[1]
AIMS = {"first_hit_s_at_1e6_blocks": 2.0, "bytes_per_block": 128, "eviction_order_match": 0.99}
FULL_BLOCKS = {"fs": 1_000_000, "s3": 100_000}
QUICK_BLOCKS = {"fs": 100_000, "s3": 20_000}
EVICTIONS = 1000
FILL_TIMEOUT = 3 * 3600.0  # seconds a filler may take to report
REOPEN_TIMEOUT = 1800.0  # seconds a reopening process may take


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fs 10^5, s3 2*10^4 blocks")
    parser.add_argument(
        "--blocks", type=int, help="blocks per case (default: fs 10^6, s3 10^5; --quick less)"
    )
    parser.add_argument(
        "--block-bytes", type=parse_size, default=4096, help="payload bytes per block (4KiB)"
    )
    parser.add_argument("--tier", choices=("fs", "s3", "both"), default="both")
    parser.add_argument(
        "--s3-open",
        choices=("listing", "snapshot", "both"),
        default="both",
        help="the S3 cases: reopen from a listing of the prefix, from an index snapshot, or both",
    )
    parser.add_argument("--evictions", type=int, default=EVICTIONS, help="FS: evictions checked")
    parser.add_argument("--fsync", default="never", help="the FS filler's fsync policy")
    parser.add_argument(
        "--dir", default="/var/tmp", help="where the FS cases make their temporary folder"
    )
    parser.add_argument("--seed", type=int, default=1)
    s3 = parser.add_argument_group("the object store (default: a SeaweedFS of the run's own)")
    s3.add_argument("--s3-endpoint", help="an S3 endpoint URL; its bucket must exist")
    s3.add_argument("--s3-bucket", default="kvtier-restart")
    s3.add_argument("--s3-region", default=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.blocks is not None and args.blocks < 2:
        parser.error("--blocks must be at least 2")
    return args


# -- the processes -----------------------------------------------------------------------------


def worker_command(role: str, spec: Spec) -> list[str]:
    return [sys.executable, "-m", "benchmarks.restart_worker", role, spec.to_json()]


def _lines(stream: IO[str], into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def fill_and_kill(spec: Spec, env: dict[str, str]) -> dict[str, Any]:
    """Run the filler until it reports, then SIGKILL it; its report."""
    proc = subprocess.Popen(
        worker_command("fill", spec), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + FILL_TIMEOUT
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"the filler did not report within {FILL_TIMEOUT} s") from None
            if line is None:
                raise RuntimeError(f"the filler exited with status {proc.wait()} before the end")
            if line.startswith(READY):
                report: dict[str, Any] = json.loads(line[len(READY) :])
                break
        proc.send_signal(signal.SIGKILL)
        status = proc.wait(timeout=30)
        report["killed_by"] = "SIGKILL" if status == -signal.SIGKILL else f"status {status}"
        return report
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_worker(role: str, spec: Spec, env: dict[str, str]) -> dict[str, Any]:
    """A fresh process in ``role``; the JSON line it printed last."""
    done = subprocess.run(
        worker_command(role, spec),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        timeout=REOPEN_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {role} process exited with status {done.returncode}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- one case --------------------------------------------------------------------------------------


def run_case(name: str, spec: Spec, env: dict[str, str], notes: list[str]) -> dict[str, Any]:
    print(f"restart: {name}: filling {spec.blocks} blocks of {spec.block_bytes} bytes", flush=True)
    filled = fill_and_kill(spec, env)
    dropped, why = drop_page_cache()
    if why is not None and why not in notes:
        notes.append(why)
    if spec.tier == "fs":
        spec.capacity_bytes = filled["bytes_stored"]  # full: every new block evicts one
    reopened = run_worker("reopen", spec, env)
    measured = run_worker("memory", spec, env)
    case: dict[str, Any] = {
        "tier": spec.tier,
        "blocks": spec.blocks,
        "block_bytes": spec.block_bytes,
        "fill_s": filled["fill_s"],
        "fill_blocks_per_s": spec.blocks / filled["fill_s"],
        "killed_by": filled["killed_by"],
        "page_cache_dropped": dropped,
        **{k: v for k, v in reopened.items() if k != "evictions"},
        "empty_open_s": measured["empty_open_s"],
        "memory_blocks_indexed": measured["blocks_indexed"],
        "traced_bytes_per_block": measured["traced_bytes_per_block"],
        "traced_raw_bytes_per_block": measured["traced_raw_bytes_per_block"],
        "memory_method": "tracemalloc: open's traced bytes less an empty tier's, per block",
        "memory_opened_from": measured["opened_from"],
        "evictions": None,
    }
    if spec.tier == "fs":
        case["evictions"] = {
            **reopened["evictions"],
            "lru_order_confirmed": filled["lru_order_confirmed"],
        }
    else:
        case["s3_open"] = spec.s3_open
        case["snapshot_wait_s"] = filled.get("snapshot_wait_s")
        case["packs_written"] = filled.get("packs_written")
    return case


def describe(name: str, case: dict[str, Any]) -> None:
    def s(value: float | None) -> str:
        return "never" if value is None else f"{value:.3f} s"

    print(
        f"\n{name}: {case['blocks']:,} blocks of {case['block_bytes']} bytes, filled in "
        f"{case['fill_s']:.1f} s ({case['fill_blocks_per_s']:,.0f}/s), killed by "
        f"{case['killed_by']}, page cache dropped: {case['page_cache_dropped']}"
    )
    if case["tier"] == "s3":
        print(
            f"  opened from a {case['opened_from']} (asked: {case['s3_open']}), listing complete "
            f"at open: {case['index_listing_complete']}"
        )
    print(
        f"  open {s(case['open_s'])}, first HIT {s(case['first_hit_s'])} (aim at 10^6 blocks: "
        f"{AIMS['first_hit_s_at_1e6_blocks']} s), index complete {s(case['index_complete_s'])}"
        f" ({case['stored_blocks_missing']} stored blocks missing); an empty tier opens in "
        f"{s(case['empty_open_s'])}"
    )
    print(
        f"  memory per indexed block ({case['memory_blocks_indexed']:,} indexed): tracemalloc "
        f"{case['traced_bytes_per_block']:.0f} B (raw {case['traced_raw_bytes_per_block']:.0f} B),"
        f" RSS delta {case['rss_bytes_per_block']:.0f} B (aim <= {AIMS['bytes_per_block']} B)"
    )
    print(f"  false HITs: {case['false_hits']} of {case['false_hit_probes']} keys never stored")
    if (ev := case["evictions"]) is not None:
        print(
            f"  next {ev['measured']} evictions: order kept {ev['order_match']:.1%} (aim >= "
            f"{AIMS['eviction_order_match']:.0%}), same blocks {ev['set_match']:.1%}, blocks "
            f"touched before the kill evicted {ev['touched_evicted']:.1%} (filler's LRU order "
            f"confirmed: {ev['lru_order_confirmed']})"
        )


# -- the run ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def object_store(args: argparse.Namespace, prefix: str) -> Iterator[dict[str, str]]:
    """The endpoint and bucket, with credentials in the environment: the given store (what
    the run wrote under ``prefix`` deleted at the end) or a SeaweedFS of the run's own."""
    from devtools.weed_server import ACCESS_KEY, SECRET_KEY, WeedServer, ensure_bucket

    creds = {
        "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
    }
    if args.s3_endpoint is not None:
        try:
            yield {"endpoint": args.s3_endpoint, "bucket": args.s3_bucket, **creds}
        finally:
            delete_prefix(args.s3_endpoint, args.s3_bucket, args.s3_region, prefix, creds)
        return
    import anyio

    with WeedServer() as server:  # stopped, and its folder removed, at the end
        anyio.run(ensure_bucket, server.endpoint_url, args.s3_bucket)
        yield {"endpoint": server.endpoint_url, "bucket": args.s3_bucket, **creds}


def delete_prefix(
    endpoint: str, bucket: str, region: str, prefix: str, creds: dict[str, str]
) -> None:
    """Delete every object under ``prefix/`` (best effort: said on stderr if it fails)."""
    import anyio
    from aiobotocore.session import get_session

    async def delete() -> int:
        client = get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        )
        deleted = 0
        async with client as s3:
            paginator = s3.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=bucket, Prefix=prefix + "/"):
                names = [{"Key": item["Key"]} for item in page.get("Contents", ())]
                if names:
                    await s3.delete_objects(Bucket=bucket, Delete={"Objects": names})
                    deleted += len(names)
        return deleted

    try:
        print(f"restart: deleted {anyio.run(delete)} objects under {prefix}/", flush=True)
    except Exception as exc:  # cleanup: say so and go on
        print(f"restart: could not delete {prefix}/: {exc!r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK_BLOCKS if args.quick else FULL_BLOCKS
    tiers = ["fs", "s3"] if args.tier == "both" else [args.tier]
    s3_opens = ["listing", "snapshot"] if args.s3_open == "both" else [args.s3_open]
    with json_output(args.json) as out:
        out["settings"] = settings(
            args, "quick", "blocks", "block_bytes", "tier", "s3_open", "evictions", "fsync", "seed"
        )
        out["aims"] = AIMS
        notes: list[str] = []
        out["notes"] = notes
        cases: dict[str, Any] = {}
        out["cases"] = cases
        env = dict(os.environ)
        with contextlib.ExitStack() as stack:
            for tier in tiers:
                blocks = args.blocks or sizes[tier]
                base = Spec(
                    tier=tier,
                    blocks=blocks,
                    block_bytes=args.block_bytes,
                    seed=args.seed,
                    evictions=min(args.evictions, blocks // 2),
                    fsync=args.fsync,
                    region=args.s3_region,
                )
                if tier == "fs":
                    folder = tempfile.mkdtemp(prefix="kvtier-restart-", dir=args.dir)
                    stack.callback(shutil.rmtree, folder, ignore_errors=True)
                    base.root = os.path.join(folder, "tier")
                    cases["fs"] = run_case("fs", base, env, notes)
                    describe("fs", cases["fs"])
                    continue
                prefix = f"kvtier-restart-{uuid.uuid4().hex[:12]}"
                store = stack.enter_context(object_store(args, prefix))
                s3_env = {**env, **{k: v for k, v in store.items() if k.startswith("AWS_")}}
                for how in s3_opens:
                    spec = dataclasses.replace(base, s3_open=how)
                    spec.endpoint, spec.bucket = store["endpoint"], store["bucket"]
                    spec.prefix = f"{prefix}/{how}"
                    name = f"s3_{how}"
                    cases[name] = run_case(name, spec, s3_env, notes)
                    describe(name, cases[name])
        for note in notes:
            print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
