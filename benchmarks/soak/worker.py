"""One soak worker: a process with its own ``TieringManager`` over a host pool, an FSTier and an
S3Tier, running the seeded workload and judging every byte it loads.

``python -m benchmarks.soak.worker SPEC.json``; the coordinator writes the spec (settings, this
worker's index, incarnation, folder, node, the S3 endpoint) and reads what the worker leaves:

- ``w<i>.<inc>.counters``: its counters (``shared.Counters``), written in place, so a SIGKILL
  loses nothing counted;
- ``w<i>.<inc>.log``: its op log, one line per operation, written before the operation runs;
  oracle violations are logged with the key and what was found;
- ``w<i>.durable``: blocks the FS tier acknowledged (``S hexkey epoch began``: the folder's
  fault epoch and the monotonic time when the store began) and deletes
  (``D hexkey``), for the durability check after a SIGKILL.

Exit status 0: stopped; 3: a clean restart asked for by the workload.

The oracles it applies itself (the coordinator only adds them up):

- **bytes**: every block a load returns is judged (``oracle.judge``): wrong or foreign bytes;
- **deadlines**: ``OffloadScheduler.lookup`` returning later than its timeout + margin, a
  ``load`` later than ``load_deadline`` + margin (wall time), a synchronous lookup or scan
  taking more than the margin of this thread's CPU time (it never waits, so only the time it
  computes is its own: on a loaded machine the wall time also holds other processes' turns);
- **false misses**: a probe of a *clean* key: a private key this worker stored (in this
  process: a close and reopen keeps what it knows, a SIGKILL or restart starts afresh, and a
  delete of the key forgets it), whose block file is on disk (a ``stat``, the ground truth)
  before and after the probe and was first seen there at least the settle time before it,
  with no fault on its path since its store (the folder's fault log, ``fs_faults.FaultView``:
  its file, its shard folders, the whole folder) and no injected EIO or hang on a call on its
  file (``fs_calls``). Keys in the protected shards (``fs_faults.protected``), which no
  targeted fault aims at, are probed first: elsewhere nearly every key is hit within seconds.
  The settle time is derived from the manager's ``failure_ttl`` and the FS tier's
  ``miss_ttl`` (a failed promotion or a miss of an earlier copy is remembered that long, as
  documented) plus a margin. It is asked through the scheduler with a deadline past
  the promotion timeout; a final MISS (other than ``primary_full``) is a false miss, an
  answer still pending is counted apart; a disk-full eviction removes the file, which the
  stat after the probe sees, so evictions are never taken for false misses;
- **durability**: after a SIGKILL, the coordinator hands the next incarnation the acknowledged
  blocks no fault can have touched; each must still be found with the right bytes;
- **leaks**: after each close, threads, tasks, fds, sockets and pins beyond what was there
  before the open (``leaks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvtier
from benchmarks.soak.fs_calls import CallControl, CallFaults
from benchmarks.soak.fs_faults import FaultView, fault_log_path, protected
from benchmarks.soak.leaks import Resources
from benchmarks.soak.oracle import Verdict, judge, make_version, payload
from benchmarks.soak.settings import SoakSettings, layout
from benchmarks.soak.shared import Counters, Epochs
from benchmarks.soak.workload import Keys, choose_op

__all__ = ["Spec", "main"]

RESTART = 3
_CANDIDATES = 4000
# Seconds added to kvtier's own TTLs before a key is judged (thread hops, a loaded machine).
_SETTLE_MARGIN = 0.75
# A fault logged up to this long before a store began still counts as after it (a fault is
# logged before it is made, and a store's files are written a little after it begins).
_FAULT_MARGIN = 1.0
# A stored key whose file has not appeared on disk after this long is forgotten (its
# background write failed or was refused).
_NEVER_WRITTEN = 30.0
# Candidates one probe looks at, at most, for one that is ready.
_LOOKS = 12


@dataclass
class Candidate:
    """A private key the false-miss oracle may judge: when its store began, and when its
    block file was first seen on disk after that (0: not yet)."""

    stored: float
    seen: float = 0.0


@dataclass(frozen=True)
class Spec:
    """What the coordinator tells one worker incarnation."""

    settings: SoakSettings
    index: int
    incarnation: int
    run_dir: str
    folder: str  # the folder's name (its fault epoch)
    folder_path: str
    folders: list[str]
    node: str
    clock_skew: float
    endpoint: str
    bucket: str
    prefix: str
    verify: list[str]  # hex keys to find first (the durability check)
    verify_at: float = 0.0  # when the coordinator made that list (time.monotonic)

    @classmethod
    def load(cls, path: str) -> Spec:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
        data["settings"] = SoakSettings.from_json(data["settings"])
        return cls(**data)

    def path(self, what: str, incarnation: int | None = None, index: int | None = None) -> str:
        inc = self.incarnation if incarnation is None else incarnation
        i = self.index if index is None else index
        return os.path.join(self.run_dir, f"w{i}.{inc}.{what}")


def skew_clock(tier: kvtier.S3Tier, seconds: float) -> None:
    """Put this node's S3 journal clock ``seconds`` off the machine's. kvtier has no public
    hook for the journal's wall clock (its ``clock`` argument is the monotonic one of the
    TTLs), so this sets the one private attribute the tier's own tests set; without it (a
    kvtier that renamed it) the node runs unskewed."""
    sync = getattr(tier, "_sync", None)
    if seconds and sync is not None and hasattr(sync, "_wall"):
        sync._wall = lambda: time.time() + seconds


class Run:
    """One worker incarnation."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        s = self.s = spec.settings
        self.slot = spec.index * 256 + spec.incarnation
        self.rng = random.Random(s.worker_seed(spec.index, spec.incarnation))
        self.counters = Counters(spec.path("counters"), create=True)
        self.epochs = Epochs(os.path.join(spec.run_dir, "epochs"), spec.folders)
        self.keys = Keys(s, spec.index)
        self.log = open(spec.path("log"), "a", buffering=1)  # noqa: SIM115 - one per process
        self.durable = open(  # noqa: SIM115 - one per process
            os.path.join(spec.run_dir, f"w{spec.index}.durable"), "a", buffering=1
        )
        self.seq = 0
        self._writers: dict[int, Counters | None] = {}
        # The false-miss oracle's candidates: private keys in protected shards (no targeted
        # fault aims at them, ``fs_faults.protected``), probed first, and the others.
        self.candidates: dict[bytes, Candidate] = {}
        self.exposed: dict[bytes, Candidate] = {}
        self.fault_view = FaultView(fault_log_path(spec.run_dir, spec.folder))
        self.calls = CallFaults(
            CallControl(os.path.join(spec.run_dir, "calls"), s.workers),
            spec.index,
            self.counters,
        )
        self.settle = 0.0  # set from the first manager's settings (``build``)
        self.ops_total = 0
        self.next_restart = s.restart_every // 2 + self.rng.randrange(max(s.restart_every, 1))
        self.handles: list[kvtier.PrefetchHandle] = []
        # The worker slots on this worker's folder (whose stores may evict its blocks).
        self.peers = [w.index for w in layout(s.workers) if w.folder == spec.folder]

    # -- the oracle's view of what writers could have stored ------------------------------

    def written(self, slot: int, seq: int) -> bool:
        if slot == self.slot:
            return 0 < seq <= self.seq
        if slot not in self._writers:
            path = self.spec.path("counters", incarnation=slot % 256, index=slot // 256)
            self._writers[slot] = Counters(path) if os.path.exists(path) else None
        writer = self._writers[slot]
        return writer is not None and 0 < seq <= writer["seq_hw"]

    def new_payloads(self, keys: tuple[bytes, ...] | list[bytes]) -> np.ndarray:
        blocks = np.empty((len(keys), self.s.block_bytes), dtype=np.uint8)
        for i, key in enumerate(keys):
            self.seq += 1
            blocks[i] = np.frombuffer(
                payload(key, make_version(self.slot, self.seq), self.s.block_bytes), np.uint8
            )
        self.counters["seq_hw"] = self.seq  # before kvtier sees any of them
        return blocks

    def check(self, keys: list[bytes] | tuple[bytes, ...], out: np.ndarray, n: int) -> None:
        for i in range(n):
            verdict = judge(keys[i], out[i].data, self.written)
            self.counters.add("blocks_checked")
            if verdict is Verdict.OK:
                continue
            self.counters.add("wrong_bytes" if verdict is Verdict.WRONG else "foreign_bytes")
            self.note(f"ORACLE {verdict.value} key={keys[i].hex()} head={bytes(out[i][:48]).hex()}")

    def note(self, line: str) -> None:
        self.log.write(f"{time.time():.3f} {line}\n")

    def overrun(self, what: str, elapsed: float, deadline: float) -> None:
        if elapsed > deadline + self.s.deadline_margin:
            self.counters.add("deadline_overruns")
            self.note(f"OVERRUN {what} {elapsed:.3f}s > {deadline:.3f}s")

    @property
    def stopping(self) -> bool:
        return self.counters["stop"] != 0

    # -- building and running managers ------------------------------------------------------

    def build(self) -> tuple[kvtier.TieringManager, kvtier.HostPool]:
        s, spec = self.s, self.spec
        pool = kvtier.HostPool(s.pool_blocks, s.block_bytes)
        shared: Any = "auto" if spec.folder != "shared" or s.shared_mode == "auto" else True
        fs = kvtier.FSTier(spec.folder_path, name="fs", fsync=s.fsync, shared=shared)
        s3 = kvtier.S3Tier(
            spec.bucket,
            name="s3",
            prefix=spec.prefix,
            endpoint_url=spec.endpoint,
            region_name="us-east-1",
            aws_access_key_id="soak",
            aws_secret_access_key="soak-secret",
            connect_timeout=1.0,
            read_timeout=s.s3_read_timeout,
            breaker_reset=1.0,
            index_refresh=s.index_refresh,
            index_audit_every=s.index_audit_every,
            index_lookback=30.0,
            index_snapshots=True,
            index_snapshot_every=5.0,
            index_digests=True,
        )
        skew_clock(s3, spec.clock_skew)
        manager = kvtier.TieringManager(
            pool,
            [fs, s3],
            promotion_timeout=s.promotion_timeout,
            store_timeout=s.store_timeout,
            close_timeout=3.0,
            open_timeout=60.0,
        )
        self.settle = max(manager.config.failure_ttl, fs.config.miss_ttl) + _SETTLE_MARGIN
        return manager, pool

    async def run(self) -> int:
        self.note(
            f"START worker={self.spec.index} inc={self.spec.incarnation} pid={os.getpid()} "
            f"kvtier={kvtier.__file__}"
        )
        if not self.calls.install():
            self.note("NO_CALL_FAULTS kvtier has no _write._writev / _read._preadv to wrap")
        first = True
        while not self.stopping:
            before = Resources.now()
            manager, pool = self.build()
            try:
                await manager.__aenter__()
            except Exception as exc:
                # A tier whose open meets an injected fault (an S3 error or timeout, a full
                # disk) raises today: counted apart, as what kvtier does not yet do (open
                # such a tier as unavailable and retry it in the background). Any other
                # open that raises (a folder refused, a bug) is a finding. The blocks a
                # restart must find are looked for at the first open that succeeds.
                transient = _transient(exc)
                self.counters.add("open_failures_transient" if transient else "open_failures")
                self.note(
                    f"OPEN_FAILED{'_TRANSIENT' if transient else ''} {type(exc).__name__}: {exc}"
                )
                self.note(" | ".join(traceback.format_exc().splitlines()[-20:]))
                await asyncio.sleep(1.0)
                await self.check_leaks(before, pool)
                continue
            async with contextlib.AsyncExitStack() as opened:
                opened.push_async_exit(manager)
                scheduler = kvtier.OffloadScheduler(manager, max_wait=5.0)
                if first:
                    await self.verify_durable(manager)
                    first = False
                self.counters["verified"] = 1
                await self.session(manager, scheduler)
                for handle in self.handles:
                    handle.cancel()
                self.handles.clear()
            await self.check_leaks(before, pool)
            if self.ops_total >= self.next_restart and not self.stopping:
                self.note("RESTART")
                return RESTART
        self.note("STOP")
        return 0

    async def session(
        self, manager: kvtier.TieringManager, scheduler: kvtier.OffloadScheduler
    ) -> None:
        s = self.s
        left = s.reopen_every // 2 + self.rng.randrange(max(s.reopen_every, 1))
        while left > 0 and not self.stopping:
            self.counters.add("heartbeat")
            if self.rng.random() < s.burst_rate:
                rngs = [random.Random(self.rng.getrandbits(64)) for _ in range(s.burst_size)]
                ops = [choose_op(r) for r in rngs]
                self.note(f"BURST {' '.join(ops)}")
                async with asyncio.TaskGroup() as group:
                    for op, rng in zip(ops, rngs, strict=True):
                        group.create_task(self.op(op, rng, manager, scheduler))
                left -= len(ops)
            else:
                await self.op(choose_op(self.rng), self.rng, manager, scheduler)
                left -= 1
        self.note("CLOSE")

    async def op(
        self,
        name: str,
        rng: random.Random,
        manager: kvtier.TieringManager,
        scheduler: kvtier.OffloadScheduler,
    ) -> None:
        self.counters.add("ops")
        self.ops_total += 1
        try:
            await _OPS[name](self, rng, manager, scheduler)
        except kvtier.KVTierError as exc:
            self.counters.add("kvtier_errors")
            self.note(f"ERROR {name} {type(exc).__name__}: {exc}")
        except Exception as exc:
            self.counters.add("contract_errors")
            self.note(f"CONTRACT {name} {type(exc).__name__}: {exc!r}")
            self.note(" | ".join(traceback.format_exc().splitlines()[-6:]))

    # -- operations ------------------------------------------------------------------------

    async def do_lookup(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick(rng)
        self.note(f"lookup {chain.kind}{chain.number}")
        start = time.thread_time()  # CPU: a lookup never waits, so preemption is not its
        if rng.random() < 0.5:
            sched.maximal_prefix_lookup(list(chain.keys))
        else:
            manager.lookup(chain.keys[0])
        self.overrun("lookup", time.thread_time() - start, 0.0)
        self.counters.add("lookups")

    async def do_lookup_run(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        """A scheduler's step: many synchronous lookups in a row, each one operation."""
        chains = [self.keys.pick(rng) for _ in range(self.s.lookup_run)]
        self.note(f"lookup_run {' '.join(f'{c.kind}{c.number}' for c in chains)}")
        for chain in chains:
            start = time.thread_time()
            sched.maximal_prefix_lookup(list(chain.keys))
            self.overrun("lookup", time.thread_time() - start, 0.0)
        self.counters.add("lookups", len(chains))
        self.counters.add("ops", len(chains) - 1)

    async def do_scheduler_lookup(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick(rng)
        timeout = self.s.lookup_timeout * (0.2 + rng.random())
        self.note(f"scheduler_lookup {chain.kind}{chain.number} {timeout:.3f}")
        start = time.perf_counter()
        n = await sched.lookup(list(chain.keys), timeout=timeout)
        self.overrun("scheduler_lookup", time.perf_counter() - start, timeout)
        self.counters.add("scheduler_lookups")
        if n:
            await self.load_checked(manager, chain.keys[:n])

    async def load_checked(
        self, manager: kvtier.TieringManager, keys: tuple[bytes, ...] | list[bytes]
    ) -> int:
        out = np.empty((len(keys), self.s.block_bytes), dtype=np.uint8)
        start = time.perf_counter()
        n = await manager.load(list(keys), out)
        self.overrun("load", time.perf_counter() - start, self.s.load_deadline)
        self.counters.add("loads")
        self.check(keys, out, n)
        return n

    async def do_load(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick(rng)
        self.note(f"load {chain.kind}{chain.number}")
        await self.load_checked(manager, chain.keys)

    async def do_store(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick(rng)
        began = time.monotonic()
        blocks = self.new_payloads(chain.keys)
        self.note(f"store {chain.kind}{chain.number} seq={self.seq}")
        if chain.private:  # a new version: what was known of the old one no longer holds
            self.remember(chain.keys, began)
        placed = await manager.store(list(chain.keys), blocks)
        self.counters.add("stores")
        self.counters.add("blocks_stored", placed)

    def remember(self, keys: tuple[bytes, ...] | list[bytes], began: float) -> None:
        for key in keys:
            self.forget(key)
            pool = self.candidates if protected(key.hex()) else self.exposed
            pool[key] = Candidate(began)
            while len(pool) > _CANDIDATES:
                del pool[next(iter(pool))]

    def forget(self, key: bytes) -> None:
        self.candidates.pop(key, None)
        self.exposed.pop(key, None)

    def candidate(self, key: bytes) -> Candidate | None:
        return self.candidates.get(key) or self.exposed.get(key)

    async def do_delete(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick_private(rng) if rng.random() < 0.7 else self.keys.pick(rng)
        key = rng.choice(chain.keys)
        tier = manager.tiers[rng.randrange(len(manager.tiers))]
        self.note(f"delete {chain.kind}{chain.number} {key.hex()} {tier.name}")
        self.forget(key)
        if tier.name == "fs":
            self.durable.write(f"D {key.hex()}\n")
        await tier.delete(key)
        self.counters.add("deletes")

    async def do_prefetch(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick(rng)
        self.note(f"prefetch {chain.kind}{chain.number}")
        self.handles.append(sched.prefetch(list(chain.keys), deadline=1.0, ttl=3.0))
        self.counters.add("prefetches")
        if len(self.handles) > 16:
            self.handles.pop(0).cancel()

    async def do_durable_store(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        chain = self.keys.pick_private(rng)
        key = rng.choice(chain.keys)
        epoch = self.epochs.of(self.spec.folder)
        began = time.monotonic()
        block = self.new_payloads([key])[0]
        self.note(f"durable_store {key.hex()} seq={self.seq}")
        self.remember([key], began)
        fs = manager.tiers[0]
        await fs.store(key, memoryview(block))
        # Acknowledged: now it must last (unless a full disk makes the tier evict it).
        self.durable.write(f"S {key.hex()} {epoch} {began:.6f}\n")
        self.counters.add("durable_stores")

    def block_file(self, key: bytes) -> str:
        """Where the FS tier keeps ``key``'s block (``kvtier.tiers.fs._layout``: the key in hex
        under its last four hex digits), for the oracle's own look at the disk."""
        name = key.hex()
        return os.path.join(self.spec.folder_path, name[-4:-2], name[-2:], name)

    def on_disk(self, key: bytes) -> bool:
        try:
            os.stat(self.block_file(key))  # a stat on a local disk: microseconds
        except OSError:
            return False
        return True

    def untouched(self, key: bytes, candidate: Candidate) -> bool:
        """No FS fault and no injected call fault reached ``key``'s path since its store."""
        since = candidate.stored - _FAULT_MARGIN
        self.fault_view.poll()
        name = key.hex()
        return self.fault_view.last_on(name) < since and not self.calls.hit_since(name, since)

    def pick_candidate(self, rng: random.Random) -> tuple[bytes, Candidate] | None:
        """A candidate ready to probe: looked for among a few of the older half (likely out
        of the pool by now) of the protected candidates first, then of the others; each
        look moves a candidate toward ready or forgets it. None when none of those is
        ready."""
        for pool, looks in ((self.candidates, _LOOKS), (self.exposed, _LOOKS // 3)):
            keys = list(pool)
            for _ in range(min(looks, len(keys))):
                key = keys[rng.randrange(len(keys) // 2 + 1)]
                candidate = pool.get(key)
                if candidate is None:
                    continue
                now = time.monotonic()
                if not self.untouched(key, candidate):
                    pool.pop(key, None)
                    self.counters.add("probes_excluded")
                    continue
                if not self.on_disk(key):
                    if candidate.seen or now - candidate.stored > _NEVER_WRITTEN:
                        pool.pop(key, None)  # evicted, or its write failed
                    continue
                if not candidate.seen:
                    candidate.seen = now
                if now - candidate.seen >= self.settle:
                    return key, candidate
        self.counters.add("probes_deferred")
        return None

    async def do_probe(
        self, rng: random.Random, manager: kvtier.TieringManager, sched: kvtier.OffloadScheduler
    ) -> None:
        picked = self.pick_candidate(rng)
        if picked is None:
            return
        key, candidate = picked
        self.note(f"probe {key.hex()}")
        timeout = self.s.promotion_timeout + 2.0
        start = time.perf_counter()
        n = await sched.lookup([key], timeout=timeout)
        self.overrun("probe", time.perf_counter() - start, timeout)
        answer = manager.lookup(key) if n == 0 else kvtier.LookupResult.HIT
        reason = manager.last_miss_reason
        if answer is kvtier.LookupResult.MISS:
            await asyncio.sleep(0.5)  # let an eviction's unlink in flight land before the stat
        if (
            self.candidate(key) is not candidate
            or not self.untouched(key, candidate)
            or not self.on_disk(key)
        ):
            self.counters.add("probes_excluded")  # a fault, delete or eviction came meanwhile
            return
        self.counters.add("clean_probes")
        if protected(key.hex()):
            self.counters.add("protected_probes")
        if n:
            await self.load_checked(manager, [key])
        elif answer is kvtier.LookupResult.MISS and reason != "primary_full":
            self.counters.add("false_misses")
            self.note(
                f"FALSE_MISS {key.hex()} reason={reason} stored={candidate.stored:.3f} "
                f"seen={candidate.seen:.3f} now={time.monotonic():.3f}"
            )
        elif answer is not kvtier.LookupResult.MISS:
            self.counters.add("probes_unresolved")
            self.note(f"UNRESOLVED {key.hex()} {answer.name}")

    # -- durability and leaks ----------------------------------------------------------------

    async def verify_durable(self, manager: kvtier.TieringManager) -> None:
        """Find every block the coordinator says must have survived the SIGKILL."""
        if not self.spec.verify:
            return
        self.note(f"VERIFY {len(self.spec.verify)}")
        limit = asyncio.Semaphore(16)

        async def one(hex_key: str) -> None:
            key = bytes.fromhex(hex_key)
            async with limit:
                try:
                    answer = await manager.wait_settled(key, timeout=self.s.promotion_timeout + 5)
                except TimeoutError:
                    answer = kvtier.LookupResult.RETRY
                reason = manager.last_miss_reason
                n = (
                    await self.load_checked(manager, [key])
                    if answer is kvtier.LookupResult.HIT
                    else 0
                )
            if n == 0 and self.calls.control.last_enospc(self.peers) >= self.spec.verify_at:
                # A store on this folder met a full disk since the list was made: the tier
                # may have evicted the block to make room, as it should.
                self.counters.add("durable_evicted")
                self.note(f"DURABLE_EVICTED {hex_key} answer={answer.name} reason={reason}")
                return
            self.counters.add("durable_checked")
            if n == 0:
                self.counters.add("durable_losses")
                self.note(f"DURABLE_LOSS {hex_key} answer={answer.name} reason={reason}")

        async with asyncio.TaskGroup() as group:
            for hex_key in self.spec.verify:
                group.create_task(one(hex_key))

    async def check_leaks(self, before: Resources, pool: kvtier.HostPool) -> None:
        """After a close: wait up to 2 s for what closing releases late (a transport closes a
        loop turn after its close), then count what is still held beyond ``before``. A call
        hung by the injector holds its thread and descriptor until it returns (the tier walked
        away from it, as designed), so that is waited for first."""
        await self.calls.wait_unhung(self.s.hang_seconds + 2.0)
        growth: dict[str, int] = {}
        for _ in range(40):
            after = Resources.now()
            growth = before.growth(after)
            if not any(growth.values()):
                break
            await asyncio.sleep(0.05)
        if growth.get("fds") or growth.get("sockets"):
            self.note(f"LEAKED_FDS {before.new_fds(after)}")
        stats = pool.statistics()
        growth["pins"] = stats.pinned + stats.writing
        if growth["pins"]:
            self.note(f"LEAKED_SLOTS pinned={stats.pinned} writing={stats.writing}")
        self.counters.add("leak_checks")
        self.counters.add("reopens")
        for what, n in growth.items():
            if n:
                self.counters.add(f"leaked_{what}", n)
                self.note(f"LEAK {what} +{n}")


_Op = Callable[
    [Run, random.Random, kvtier.TieringManager, kvtier.OffloadScheduler],
    Any,
]
_OPS: dict[str, _Op] = {
    "lookup": Run.do_lookup,
    "lookup_run": Run.do_lookup_run,
    "scheduler_lookup": Run.do_scheduler_lookup,
    "store": Run.do_store,
    "load": Run.do_load,
    "delete": Run.do_delete,
    "prefetch": Run.do_prefetch,
    "durable_store": Run.do_durable_store,
    "probe": Run.do_probe,
}


def _transient(exc: BaseException) -> bool:
    """An open that failed on a fault the soak injects and that passes by itself: the S3
    endpoint unavailable or slow, or the disk full."""
    if isinstance(exc, kvtier.TierUnavailableError | kvtier.TierTimeoutError):
        return True
    cause = exc.__cause__
    return isinstance(exc, kvtier.UnusableRootError) and (
        isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
    )


def main(argv: list[str]) -> int:
    spec = Spec.load(argv[0])
    return asyncio.run(Run(spec).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
