"""The processes of ``benchmarks.restart``: the filler it kills, and the fresh processes that
reopen the tier after the kill.

    python -m benchmarks.restart_worker fill|reopen|memory SPEC_JSON

``SPEC_JSON`` is a ``Spec`` as JSON (``benchmarks.restart`` writes it). Credentials for S3 come
from the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), never the command
line. Each role writes its human output to stderr and its figures as one JSON line on stdout:

- ``fill``: stores the spec's blocks, touches some of them in a known order (below), then
  prints ``READY {json}`` and sleeps until the parent kills it with SIGKILL.
- ``reopen``: opens the tier in a fresh process (after the kill and the dropped page cache)
  and times it: to open, to the first HIT of a block stored before the kill, to every stored
  block answering HIT; the RSS it grew by; false HITs of keys never stored; and for the FS tier,
  the order of the next evictions.
- ``memory``: opens it again under ``tracemalloc``, beside a tier on an empty folder or prefix,
  for the bytes per indexed block.

The FS tier's LRU order at the kill is known by construction: the first ``2E`` blocks are
stored one at a time (``E``: the evictions measured), the rest in batches, then the first
``E`` are loaded one at a time in a shuffled order. Loads make a block the most recently used,
so the next ``E`` blocks to evict are blocks ``E .. 2E-1``, in that order. The filler also
reads its own catalog (``FSTier._catalog``, private) to confirm it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import json
import os
import random
import struct
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from kvtier import FSTier, LookupResult, S3Tier, SecondaryTier

__all__ = ["Spec", "block_key", "main"]

HIT = LookupResult.HIT
READY = "READY "  # the filler's line once the fill is done
# Seconds a reopened tier is given, once open() returned, until its first HIT and until every
# stored block answers HIT (S3 may learn some from the journal, one poll after open).
COMPLETE_TIMEOUT = 60.0
FALSE_HIT_PROBES = 1000


@dataclasses.dataclass
class Spec:
    """One case of the benchmark, as every process of it sees it."""

    tier: str  # "fs" or "s3"
    blocks: int
    block_bytes: int
    seed: int
    evictions: int  # E: FS only (the S3 tier never evicts for capacity)
    root: str | None = None  # FS: the tier's folder; its parent holds the empty ones
    fsync: str = "never"
    endpoint: str | None = None  # S3
    bucket: str | None = None
    prefix: str | None = None
    region: str = "us-east-1"
    # S3 filler: "listing" writes no index snapshot (the reopen lists the prefix);
    # "snapshot" waits for a snapshot taken after the fill before it reports.
    s3_open: str = "listing"
    capacity_bytes: int | None = None  # FS reopen: the bytes the filler stored

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


def block_key(seed: int, domain: bytes, i: int) -> bytes:
    """Key ``i`` of ``domain``: the key scheme's version byte and 15 bytes of BLAKE2b."""
    return (
        b"\x01"
        + hashlib.blake2b(struct.pack("<QQ", seed, i), digest_size=15, person=domain).digest()
    )


def stored_keys(spec: Spec) -> list[bytes]:
    return [block_key(spec.seed, b"stored", i) for i in range(spec.blocks)]


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def emit(figures: dict[str, Any], prefix: str = "") -> None:
    sys.stdout.write(prefix + json.dumps(figures) + "\n")
    sys.stdout.flush()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- tiers ---------------------------------------------------------------------------------------


def make_fs(spec: Spec, root: str | None = None, **options: Any) -> FSTier:
    where = root or spec.root
    assert where is not None
    return FSTier(where, fsync=spec.fsync, **options)


def make_s3(spec: Spec, prefix: str | None = None, **options: Any) -> S3Tier:
    return S3Tier(
        spec.bucket or "",
        prefix=prefix or spec.prefix or "",
        endpoint_url=spec.endpoint,
        region_name=spec.region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench-secret"),
        read_timeout=30.0,
        **options,
    )


def make_tier(spec: Spec, place: dict[str, str] | None = None, **options: Any) -> SecondaryTier:
    """The case's tier (in ``place``, a root or a prefix, instead of the spec's)."""
    place = place or {}
    if spec.tier == "fs":
        return make_fs(spec, place.get("root"), **options)
    return make_s3(spec, place.get("prefix"), **options)


def empty_place(spec: Spec, name: str) -> dict[str, str]:
    """Where a tier of the case with nothing in it lives: a folder beside the root, or a
    prefix under the case's own."""
    if spec.tier == "fs":
        assert spec.root is not None
        return {"root": str(Path(spec.root).parent / name)}
    return {"prefix": f"{spec.prefix}/{name}"}


def indexed(tier: SecondaryTier) -> int:
    """The blocks the tier's index holds."""
    if isinstance(tier, S3Tier):
        return tier.statistics().index_keys
    return tier.statistics().blocks


async def store_round(
    tier: SecondaryTier, keys: list[bytes], payload: memoryview, *, batch: int, tasks: int
) -> list[bytes]:
    """``keys`` in batches of ``batch``, ``tasks`` batches at a time; the keys that failed."""
    failed: list[bytes] = []
    chunks = iter(range(0, len(keys), batch))
    done, last = 0, time.monotonic()

    async def worker() -> None:
        nonlocal done, last
        for start in chunks:
            part = keys[start : start + batch]
            results = await tier.store_many(part, [payload] * len(part), timeout=120.0)
            failed.extend(k for k, r in zip(part, results, strict=True) if r is not None)
            done += len(part)
            if time.monotonic() - last > 10:
                last = time.monotonic()
                log(f"restart: {tier.name}: stored {done} of {len(keys)}")

    async with anyio.create_task_group() as tg:
        for _ in range(tasks):
            tg.start_soon(worker)
    return failed


async def store_all(
    tier: SecondaryTier, keys: Sequence[bytes], payload: memoryview, *, batch: int, tasks: int
) -> None:
    """Every one of ``keys``; a batch's failures are stored again (three more rounds)."""
    pending = list(keys)
    for attempt in range(4):
        pending = await store_round(tier, pending, payload, batch=batch, tasks=tasks)
        if not pending:
            return
        log(f"restart: {tier.name}: {len(pending)} stores failed (round {attempt + 1})")
    raise RuntimeError(f"{len(pending)} blocks could not be stored")


# -- fill ------------------------------------------------------------------------------------------


async def fill(spec: Spec) -> None:
    keys = stored_keys(spec)
    payload = memoryview(os.urandom(spec.block_bytes))
    if spec.tier == "fs":
        figures = await fill_fs(spec, make_fs(spec), keys, payload)
    else:  # "listing": no snapshot, so the reopen lists the prefix; "snapshot": one soon
        listing = spec.s3_open == "listing"
        options = {"index_snapshots": False} if listing else {"index_snapshot_every": 2.0}
        figures = await fill_s3(spec, make_s3(spec, **options), keys, payload)
    emit(figures, READY)
    await anyio.sleep_forever()  # the parent kills this process with SIGKILL


async def fill_fs(
    spec: Spec, tier: FSTier, keys: list[bytes], payload: memoryview
) -> dict[str, Any]:
    e = spec.evictions
    started = time.perf_counter()
    await tier.open()  # never closed: the process dies with it open, as a crashed engine's
    for key in keys[: 2 * e]:  # one at a time: their LRU order is their store order
        await tier.store(key, payload)
    await store_all(tier, keys[2 * e :], payload, batch=512, tasks=2)
    fill_s = time.perf_counter() - started
    # Touch the first E in a shuffled order: they become the most recently used.
    touched = list(range(e))
    random.Random(spec.seed).shuffle(touched)
    dst = memoryview(bytearray(spec.block_bytes))
    for i in touched:
        await tier.load(keys[i], dst)
    # The tier writes what its catalog noted once a second (a log, not a checkpoint): the
    # kill comes once that write holds the touches, as for an engine killed a second later.
    written = await catalog_written(tier, within=10.0)
    expected = [k.hex() for k in keys[e : 2 * e]]
    catalog = getattr(tier, "_catalog", None)  # private: only to confirm the construction
    confirmed = None if catalog is None else catalog.names()[:e] == expected
    stats = tier.statistics()
    log(
        f"restart: fs: filled {stats.blocks} blocks in {fill_s:.1f} s; "
        f"LRU order confirmed: {confirmed}"
    )
    return {
        "fill_s": fill_s,
        "catalog_written": written,
        "blocks": stats.blocks,
        "bytes_stored": stats.bytes_stored,
        "lru_order_confirmed": confirmed,
    }


async def catalog_written(tier: FSTier, within: float) -> bool:
    """Wait until the tier has written every change its catalog noted (polled: there is no
    event for it); whether it did within ``within`` seconds."""
    deadline = time.perf_counter() + within
    while tier.statistics().catalog_unwritten_changes:
        if time.perf_counter() > deadline:
            return False
        await anyio.sleep(0.05)
    return True


async def fill_s3(
    spec: Spec, tier: S3Tier, keys: list[bytes], payload: memoryview
) -> dict[str, Any]:
    started = time.perf_counter()
    await tier.open()
    await store_all(tier, keys, payload, batch=64, tasks=8)
    fill_s = time.perf_counter() - started
    snapshot_s = None
    if spec.s3_open == "snapshot":
        done_wall = time.time()
        await tier.refresh_index()  # publish the last keys in the journal too
        snapshot_s = await wait_for_snapshot(spec, done_wall, within=60.0)
    stats = tier.statistics()
    log(
        f"restart: {spec.prefix}: filled {spec.blocks} blocks in {fill_s:.1f} s "
        f"(index {stats.index_keys})"
    )
    return {
        "fill_s": fill_s,
        "blocks": spec.blocks,
        "packs_written": stats.packs_written,
        "snapshot_wait_s": snapshot_s,
    }


async def wait_for_snapshot(spec: Spec, after_wall: float, *, within: float) -> float | None:
    """Seconds until an index snapshot manifest written after ``after_wall`` is listed under
    the prefix (None: none within ``within`` seconds)."""
    from aiobotocore.session import get_session

    folder = f"{spec.prefix}/_kvtier_snapshots/"
    started = time.perf_counter()
    client = get_session().create_client(
        "s3",
        endpoint_url=spec.endpoint,
        region_name=spec.region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench-secret"),
    )
    async with client as s3:
        while time.perf_counter() - started < within:
            page = await s3.list_objects_v2(Bucket=spec.bucket, Prefix=folder)
            for item in page.get("Contents", ()):
                name = item["Key"].rsplit("/", 1)[-1]
                # LastModified has whole seconds: written in a later second than the fill ended
                if (
                    name.startswith("gen-")
                    and item["LastModified"].timestamp() >= int(after_wall) + 1
                ):
                    return time.perf_counter() - started
            await anyio.sleep(0.5)
    log(f"restart: {spec.prefix}: no index snapshot within {within:.0f} s")
    return None


# -- reopen ----------------------------------------------------------------------------------------


def probe_keys(keys: list[bytes]) -> dict[str, bytes]:
    """The keys whose first HIT is timed: the first and the last stored, the one a snapshot
    sorted by key holds last, and one the filler's batches left inside a pack (not its first
    key, so no object carries its name: S3's ``probe_in_pack`` says whether it was)."""
    return {
        "first_stored": keys[0],
        "last_stored": keys[-1],
        "last_sorted": max(keys),
        "packed": keys[-2],
    }


def in_pack(tier: S3Tier, key: bytes) -> bool:
    """Whether the index holds ``key`` inside a pack whose name is another key's (read from
    the tier's private index: no statistic says it)."""
    where = tier._index.location(key)
    return where is not None and key.hex() not in where.pack


async def first_hit(tier: SecondaryTier, key: bytes, t0: float) -> float:
    """Seconds from ``t0`` until ``lookup(key)`` answers HIT, polled every millisecond."""
    while True:  # polled: a lookup answer has no event to wait on
        if tier.lookup(key) is HIT:
            return time.perf_counter() - t0
        await anyio.sleep(0.001)


async def all_hit(
    tier: SecondaryTier, keys: list[bytes], t0: float, within: float
) -> tuple[float | None, int]:
    """Seconds from ``t0`` to the start of the round of lookups in which the last of ``keys``
    answered HIT (None: not within ``within`` seconds from now), and how many never did."""
    deadline = time.perf_counter() + within
    pending = keys
    while True:
        round_started = time.perf_counter()
        lookup = tier.lookup
        pending = [k for k in pending if lookup(k) is not HIT]
        if not pending:
            return round_started - t0, 0
        if time.perf_counter() > deadline:
            return None, len(pending)
        await anyio.sleep(0.05)


async def reopen(spec: Spec) -> None:
    keys = stored_keys(spec)
    probes = [block_key(spec.seed, b"never-stored", i) for i in range(FALSE_HIT_PROBES)]
    figures: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if spec.tier == "fs" and spec.capacity_bytes:
        options["capacity_bytes"] = spec.capacity_bytes  # full: each new block evicts one
    if spec.tier == "s3":
        options["index_background_load"] = True  # open at once, serve while the index loads
    gc.collect()
    rss_before = rss_bytes()
    t0 = time.perf_counter()
    tier = make_tier(spec, **options)
    probes_of = probe_keys(keys)
    # Polls while open() runs: a tier could answer before it returns. Plain asyncio tasks,
    # not a task group's: the tier enters a task group of its own in open().
    watchers = {
        name: asyncio.ensure_future(first_hit(tier, key, t0)) for name, key in probes_of.items()
    }
    await tier.open()
    figures["open_s"] = time.perf_counter() - t0
    hits: dict[str, float | None] = dict.fromkeys(watchers)  # None: no HIT within the bound
    with anyio.move_on_after(COMPLETE_TIMEOUT):  # the watchers left are cancelled below
        for name, watcher in watchers.items():
            hits[name] = await watcher
    for watcher in watchers.values():
        watcher.cancel()
    figures["first_hit_s"] = hits["last_stored"]
    figures["first_hit_by_key_s"] = hits
    known = [v for v in hits.values() if v is not None]
    figures["first_hit_max_s"] = max(known) if len(known) == len(hits) else None
    if isinstance(tier, S3Tier):
        with anyio.move_on_after(COMPLETE_TIMEOUT):
            await tier.wait_index_loaded()  # until the load at open has ended
        figures["index_loaded_s"] = time.perf_counter() - t0
        stats = tier.statistics()
        figures["index_listing_complete"] = stats.index_listing_complete
        figures["opened_from"] = opened_from(tier)
        figures["blocks_listed"] = stats.index_listed
    complete_s, missing = await all_hit(tier, keys, t0, COMPLETE_TIMEOUT)
    if isinstance(tier, S3Tier):  # which probes the index found inside a pack, not naming it
        figures["probe_in_pack"] = {name: in_pack(tier, key) for name, key in probes_of.items()}
    if isinstance(tier, FSTier):  # from the catalog kept in the folder, or a walk of it
        figures["catalog_from_checkpoint"] = tier.statistics().catalog_from_checkpoint
        figures["catalog_complete_s"] = await catalog_complete(tier, t0, COMPLETE_TIMEOUT)
    figures["index_complete_s"] = complete_s
    figures["stored_blocks_missing"] = missing
    figures["blocks_indexed"] = blocks = indexed(tier)
    gc.collect()
    figures["rss_delta_bytes"] = grown = rss_bytes() - rss_before
    figures["rss_bytes_per_block"] = grown / blocks if blocks else None
    figures["false_hits"] = sum(tier.lookup(k) is HIT for k in probes)
    figures["false_hit_probes"] = len(probes)
    if isinstance(tier, FSTier) and spec.capacity_bytes:
        figures["evictions"] = await evictions(spec, tier, keys)
    await tier.aclose()
    log(f"restart: {tier.name}: reopened: {json.dumps(figures)}")
    emit(figures)


async def catalog_complete(tier: FSTier, t0: float, within: float) -> float | None:
    """Seconds from ``t0`` until the FS tier says its catalog is in line with the folder
    (None: not within ``within`` seconds from now)."""
    deadline = time.perf_counter() + within
    while not tier.statistics().catalog_complete:
        if time.perf_counter() > deadline:
            return None
        await anyio.sleep(0.01)
    return time.perf_counter() - t0


def opened_from(tier: S3Tier) -> str | None:
    """How the index was filled at open, ``snapshot`` or ``listing`` (read from the tier's
    private snapshot reader, as no statistic says it; None if that is not there)."""
    snapshots = getattr(getattr(tier, "_sync", None), "snapshots", None)
    loaded = getattr(snapshots, "loaded", None)
    if not isinstance(loaded, int):
        return "listing" if snapshots is None else None  # no snapshots: it lists
    return "snapshot" if loaded else "listing"


async def evictions(spec: Spec, tier: FSTier, keys: list[bytes]) -> dict[str, Any]:
    """Store ``E`` new blocks one at a time into the full tier and note, per store, which
    block it evicted; compare with the order the filler left (blocks ``E .. 2E-1``)."""
    e = spec.evictions
    expected = keys[e : 2 * e]
    touched = set(keys[:e])
    payload = memoryview(os.urandom(spec.block_bytes))
    tier.events.drain()
    order: list[bytes] = []
    per_store: list[int] = []
    for i in range(e):
        await tier.store(block_key(spec.seed, b"after-restart", i), payload)
        evicted = [
            k for event in tier.events.drain() if event.reason == "evicted" for k in event.keys
        ]
        per_store.append(len(evicted))
        order.extend(evicted)
    order = order[:e]
    in_place = sum(a == b for a, b in zip(order, expected, strict=False))
    return {
        "measured": e,
        "evicted": len(order),
        "stores_evicting_one": sum(n == 1 for n in per_store),
        "order_match": in_place / e,
        "set_match": len(set(order) & set(expected)) / e,
        "touched_evicted": len(set(order) & touched) / e,
    }


# -- memory ----------------------------------------------------------------------------------------


async def memory(spec: Spec) -> None:
    """Traced bytes the full tier's open added, less those a tier on an empty folder or
    prefix added just before (the fixed cost of one more tier), per indexed block."""
    started = time.perf_counter()
    async with make_tier(spec, empty_place(spec, "empty-warm")):
        # Warms up what every tier of a process shares (botocore's models); how long it took
        # is the open of a tier with nothing to index, in a fresh process: open_s's floor.
        empty_open_s = time.perf_counter() - started
    tracemalloc.start()
    before = await traced()
    empty = make_tier(spec, empty_place(spec, "empty"))
    await empty.open()
    with_empty = await traced()
    # However long the listing takes under tracemalloc: the figure is per block indexed, and
    # a listing cut short by index_list_timeout would index fewer than the timed open did.
    unbounded: dict[str, Any] = {} if spec.tier == "fs" else {"index_list_timeout": 3600.0}
    full = make_tier(spec, None, **unbounded)
    await full.open()
    if isinstance(full, S3Tier):  # its load's transient buffers gone before the measure
        await full.wait_index_loaded()
    deadline = time.monotonic() + COMPLETE_TIMEOUT
    while True:  # S3: keys the journal brings, one poll after open
        if indexed(full) >= spec.blocks or time.monotonic() > deadline:
            break
        await anyio.sleep(0.05)
    blocks = indexed(full)
    with_full = await traced()
    tracemalloc.stop()
    await full.aclose()
    await empty.aclose()
    fixed, grown = with_empty - before, with_full - with_empty
    figures: dict[str, Any] = {
        "blocks_indexed": blocks,
        "empty_open_s": empty_open_s,
        "opened_from": opened_from(full) if isinstance(full, S3Tier) else None,
        "traced_bytes": grown,
        "traced_fixed_bytes": fixed,
        "traced_bytes_per_block": (grown - fixed) / blocks if blocks else None,
        "traced_raw_bytes_per_block": grown / blocks if blocks else None,
    }
    log(f"restart: {full.name}: memory: {json.dumps(figures)}")
    emit(figures)


async def traced() -> int:
    """Traced bytes once the loop and the collector have settled what just ran."""
    await anyio.sleep(0.2)
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


ROLES: dict[str, Callable[[Spec], Awaitable[None]]] = {
    "fill": fill,
    "reopen": reopen,
    "memory": memory,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ROLES:
        print(
            f"usage: python -m benchmarks.restart_worker {'|'.join(ROLES)} SPEC_JSON",
            file=sys.stderr,
        )
        return 2
    role, spec = ROLES[args[0]], Spec.from_json(args[1])
    anyio.run(role, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
