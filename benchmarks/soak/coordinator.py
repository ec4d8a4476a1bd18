"""One soak run: the servers, the workers, the faults, SIGKILLs and restarts, then the sums.

``serve()`` starts what several runs can share: a SeaweedFS on free 127.0.0.1 ports (telemetry
off, ``devtools.weed_server``) and a bucket. ``run_one`` then gives one seeded run its own S3
prefix and FS folders, puts the fault proxy (``devtools.s3_fault_proxy``) between its workers
and SeaweedFS, starts the workers, and for ``duration`` seconds injects FS faults, S3 object
faults and SIGKILLs at the settings' rates, while each worker's keeper restarts it (after a
SIGKILL, a crash, or the clean restart its workload asks for) on the same folder, handing it
the blocks it acknowledged as durable that no fault can have touched. FS faults on a folder
are paused from a SIGKILL until the restarted worker has checked those blocks. Then every
worker is told to stop, and the counters of all incarnations are added up.

Where it may (root, a ``mount`` that works), each FS folder is on a tmpfs of its own (mounted
on the folder's parent): the shared folder's small, so it fills and the tiers meet ENOSPC,
and now and then filled up by a ballast file beside the folder (``disk_fills``), the others'
large; where it may not,
the folders stay on the run folder's disk, the run says so, and ENOSPC is simply not
injected. EIO and hung calls are armed in the workers (``fs_calls``) at ``call_fault_rate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.soak.fs_calls import CallControl
from benchmarks.soak.fs_faults import FSFaulter, fault_log_path, mount_tmpfs, unmount
from benchmarks.soak.s3_faults import S3Faulter
from benchmarks.soak.settings import SoakSettings, Worker, layout
from benchmarks.soak.shared import COUNTERS, Counters, Epochs
from devtools.s3_fault_proxy import FaultProxy
from devtools.weed_server import WeedServer, ensure_bucket, raw_client

__all__ = ["RunResult", "Servers", "run_one", "serve"]

BUCKET = "kvtier-soak"
ROOT = Path(__file__).resolve().parents[2]
_VERIFY_MAX = 500  # newest durable blocks checked after a restart
_OPEN_TIMEOUT = 120.0
_STOP_TIMEOUT = 40.0
_NOT_SUMMED = {"seq_hw", "stop", "verified", "heartbeat"}
_CALL_FAULTS = ("fs_eio", "fs_hang", "fs_enospc")  # counted by the workers, reported as faults
_TICK = 0.1  # seconds between rounds of a fault loop (each round makes what is due)


@dataclass
class Servers:
    weed: WeedServer

    @property
    def endpoint(self) -> str:
        return self.weed.endpoint_url


@contextlib.asynccontextmanager
async def serve(data_dir: str) -> AsyncIterator[Servers]:
    weed = WeedServer(os.path.join(data_dir, "weed"))
    os.makedirs(weed.data_dir, exist_ok=True)
    try:
        await weed.astart()
        await ensure_bucket(weed.endpoint_url, BUCKET)
        yield Servers(weed)
    finally:
        await asyncio.to_thread(weed.stop)


@dataclass
class Keeper:
    """One worker slot: its current process and what happened to it."""

    worker: Worker
    incarnation: int = -1
    proc: asyncio.subprocess.Process | None = None
    killing: bool = False
    kills: int = 0
    restarts: int = 0
    crashes: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    settings: SoakSettings
    counters: dict[str, int]
    faults: dict[str, int]
    kills: int
    restarts: int
    crashes: list[str]
    findings: list[str]
    wall_seconds: float
    workload_seconds: float
    run_dir: str
    kvtier_paths: list[str]
    proxy_requests: int
    notes: list[str] = field(default_factory=list)


class Run:
    def __init__(self, settings: SoakSettings, servers: Servers, run_dir: str) -> None:
        self.s = settings
        self.servers = servers
        self.run_dir = run_dir
        self.prefix = f"soak-{settings.seed}"
        self.keepers = [Keeper(w) for w in layout(settings.workers)]
        names = sorted({w.folder for w in layout(settings.workers)})
        # Each folder one level below its mount point, so the ballast (``disk_fills``) sits
        # beside it on the same file system and no fault on the folder reaches it.
        self.folders = {n: os.path.join(run_dir, f"fs-{n}", "cache") for n in names}
        self.fillable: list[str] = []  # folders on a small tmpfs of their own
        self.disk_fulls = 0
        self.epochs = Epochs(os.path.join(run_dir, "epochs"), names, create=True)
        rng = random.Random(settings.seed)
        logs = {n: fault_log_path(run_dir, n) for n in names}
        self.fs = FSFaulter(self.folders, self.epochs, rng.getrandbits(63), logs)
        self.calls = CallControl(os.path.join(run_dir, "calls"), len(self.keepers), create=True)
        self.mounted: list[str] = []
        self.notes: list[str] = []
        self.s3_seed = rng.getrandbits(63)
        self.proxy = FaultProxy(
            servers.weed.s3_port,
            seed=rng.getrandbits(63),
            share=settings.proxy_fault_share,
            max_delay=0.3,
            drop_hold=settings.s3_read_timeout + 0.5,
        )
        self.kill_rng = random.Random(rng.getrandbits(63))
        self.pauses: dict[str, int] = {}
        self.stopping = False
        self.fault_errors = 0
        self.s3: S3Faulter | None = None

    # -- workers ------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)])}

    async def _spawn(self, keeper: Keeper, verify: list[str]) -> asyncio.subprocess.Process:
        keeper.incarnation += 1
        w = keeper.worker
        spec = {
            "settings": self.s.to_json(),
            "index": w.index,
            "incarnation": keeper.incarnation,
            "run_dir": self.run_dir,
            "folder": w.folder,
            "folder_path": self.folders[w.folder],
            "folders": self.epochs.folders,
            "node": w.node,
            "clock_skew": w.clock_skew,
            "endpoint": self.proxy.endpoint_url,
            "bucket": BUCKET,
            "prefix": self.prefix,
            "verify": verify,
            "verify_at": time.monotonic(),
        }
        path = os.path.join(self.run_dir, f"w{w.index}.{keeper.incarnation}.spec.json")
        with open(path, "w") as f:  # noqa: ASYNC230 - a small local file, once per start
            json.dump(spec, f)
        stderr = open(path.replace(".spec.json", ".stderr"), "wb")  # noqa: SIM115, ASYNC230
        with stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "benchmarks.soak.worker",
                path,
                cwd=self.run_dir,  # so PYTHONPATH, not the current folder, says which kvtier
                env=self._env(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
            )
        keeper.proc = proc
        return proc

    def counters_of(self, keeper: Keeper) -> Counters | None:
        path = os.path.join(self.run_dir, f"w{keeper.worker.index}.{keeper.incarnation}.counters")
        return Counters(path) if os.path.exists(path) else None

    def verify_list(self, keeper: Keeper) -> list[str]:
        """The blocks this worker's FS tier acknowledged, not deleted since, that no fault can
        have reached: each must be found by the next incarnation."""
        path = os.path.join(self.run_dir, f"w{keeper.worker.index}.durable")
        acked: dict[str, tuple[int, float]] = {}
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 4 and parts[0] == "S":
                    acked.pop(parts[1], None)
                    acked[parts[1]] = (int(parts[2]), float(parts[3]))
                elif len(parts) == 2 and parts[0] == "D":
                    acked.pop(parts[1], None)
        folder = keeper.worker.folder
        history = self.fs.history[folder]
        # A store that met a full disk may evict any block that landed before it (by design).
        full = self.calls.last_enospc([k.worker.index for k in self.keepers_on(folder)])
        keep = [
            k for k, (epoch, began) in acked.items() if history.intact(k, epoch) and began > full
        ]
        return keep[-_VERIFY_MAX:]

    def keepers_on(self, folder: str) -> list[Keeper]:
        return [k for k in self.keepers if k.worker.folder == folder]

    async def _until_verified(self, keeper: Keeper, proc: asyncio.subprocess.Process) -> None:
        folder = keeper.worker.folder
        try:
            deadline = time.monotonic() + _OPEN_TIMEOUT
            while time.monotonic() < deadline and proc.returncode is None:
                counters = self.counters_of(keeper)
                if counters is not None and counters["verified"]:
                    break
                await asyncio.sleep(0.1)
        finally:
            self.pauses[folder] -= 1
            if not self.pauses[folder]:
                self.fs.paused.discard(folder)

    async def keep(self, keeper: Keeper, opened: asyncio.Event) -> None:
        """Run this worker slot until the run stops, restarting its worker as needed."""
        verify: list[str] = []
        first = True
        while not self.stopping:
            folder = keeper.worker.folder
            self.pauses[folder] = self.pauses.get(folder, 0) + 1
            self.fs.paused.add(folder)
            proc = await self._spawn(keeper, verify)
            waiting = asyncio.create_task(self._until_verified(keeper, proc))
            if first:
                await waiting
                opened.set()
                first = False
            rc = await proc.wait()
            await waiting
            if self.stopping and not keeper.killing:
                break
            if keeper.killing:
                keeper.killing = False
                keeper.kills += 1
            elif rc == 3:
                keeper.restarts += 1
            else:
                tail = self._stderr_tail(keeper)
                keeper.crashes.append(
                    f"worker {keeper.worker.index}.{keeper.incarnation} rc={rc}: {tail}"
                )
            verify = self.verify_list(keeper)

    def _stderr_tail(self, keeper: Keeper) -> str:
        path = os.path.join(self.run_dir, f"w{keeper.worker.index}.{keeper.incarnation}.stderr")
        try:
            with open(path, "rb") as f:
                return f.read()[-1500:].decode(errors="replace")
        except OSError:
            return ""

    # -- faults -------------------------------------------------------------------------------

    async def _due(self, rng: random.Random, rate: float) -> AsyncIterator[int]:
        """Every ``_TICK`` seconds, how many faults a Poisson process of ``rate`` per second
        made due since the last round: one sleep per round, not per fault, so a loaded
        machine's late wake-ups do not lower the rate."""
        owed = 0.0
        last = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(_TICK)
            now = time.monotonic()
            owed += rate * (now - last)
            last = now
            n = 0
            while owed > 0:
                gap = rng.expovariate(1.0)
                if gap > owed:
                    break
                owed -= gap
                n += 1
            if n:
                yield n

    async def fs_faults(self) -> None:
        rng = random.Random(self.s.seed ^ 0x5F5F)
        if self.s.fs_fault_rate <= 0:
            return

        def inject(n: int) -> None:
            for _ in range(n):
                self.fs.inject()

        async for n in self._due(rng, self.s.fs_fault_rate):
            await asyncio.to_thread(inject, n)

    async def s3_faults(self) -> None:
        rng = random.Random(self.s.seed ^ 0x3333)
        if self.s.s3_fault_rate <= 0:
            return
        async with raw_client(self.servers.endpoint) as client:
            faulter = S3Faulter(client, BUCKET, self.prefix, self.s3_seed)
            self.s3 = faulter
            async for n in self._due(rng, self.s.s3_fault_rate):
                for _ in range(n):
                    try:
                        await faulter.inject()
                    except Exception:  # a race with a writer (object gone): not a fault made
                        self.fault_errors += 1

    async def call_faults(self) -> None:
        """Arm EIO and hangs in the workers that are up and have checked their blocks."""
        rng = random.Random(self.s.seed ^ 0xCA11)
        if self.s.call_fault_rate <= 0:
            return
        async for n in self._due(rng, self.s.call_fault_rate):
            for _ in range(n):
                keeper = rng.choice(self.keepers)
                counters = self.counters_of(keeper)
                if keeper.killing or counters is None or not counters["verified"]:
                    continue
                calls = 1 + rng.randrange(max(self.s.call_fault_calls, 1))
                if rng.random() < self.s.call_eio_share:
                    self.calls.arm_eio(keeper.worker.index, calls)
                else:
                    self.calls.arm_hang(keeper.worker.index, calls, self.s.hang_seconds)

    def mount(self) -> None:
        """A tmpfs per FS folder (mounted on the folder's parent) where the machine lets this
        process mount one."""
        for name, path in self.folders.items():
            size = self.s.shared_fs_bytes if name == "shared" else self.s.own_fs_bytes
            where = os.path.dirname(path)
            os.makedirs(where, exist_ok=True)
            why = mount_tmpfs(where, size) if size > 0 else "none asked for"
            os.makedirs(path, exist_ok=True)
            if why is None:
                self.mounted.append(where)
                self.notes.append(f"fs-{name}: tmpfs of {size >> 10} KiB")
                if name == "shared":
                    self.fillable.append(name)
            else:
                self.notes.append(f"fs-{name}: no tmpfs ({why}); ENOSPC not injected there")

    async def disk_fills(self) -> None:
        """Now and then, fill each small tmpfs with a ballast file beside its folder and hold
        it full a while (``fs_disk_full``): the disk another program filled. Every store there
        meets ENOSPC; the tier gives up its oldest blocks or fails the store, and lives on.
        Not while the folder's restarted worker checks its durable blocks."""
        rng = random.Random(self.s.seed ^ 0xF111)
        if self.s.disk_full_every <= 0 or not self.fillable:
            return
        while not self.stopping:
            await asyncio.sleep(self.s.disk_full_every * (0.5 + rng.random()))
            name = rng.choice(self.fillable)
            hold = self.s.disk_full_hold * (0.5 + rng.random())
            if name in self.fs.paused:
                continue
            ballast = os.path.join(os.path.dirname(self.folders[name]), "ballast")
            try:
                if await asyncio.to_thread(fill_up, ballast):
                    self.disk_fulls += 1
                await asyncio.sleep(hold)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(ballast)

    async def kills(self) -> None:
        if self.s.kill_every <= 0:
            return
        turn = 0
        while not self.stopping:
            await asyncio.sleep(self.s.kill_every * (0.7 + 0.6 * self.kill_rng.random()))
            keeper = self.keepers[turn % len(self.keepers)]
            turn += 1
            proc = keeper.proc
            if self.stopping or proc is None or proc.returncode is not None or keeper.killing:
                continue
            counters = self.counters_of(keeper)
            if counters is None or not counters["verified"]:
                continue  # still opening: a kill there tests less than one mid-operation
            keeper.killing = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> RunResult:
        started = time.monotonic()
        self.mount()
        for note in self.notes:
            print(f"soak: {note}", file=sys.stderr, flush=True)
        try:
            await self.proxy.start()
            return await self._run(started)
        finally:
            self.fs.close()
            for path in self.mounted:
                await asyncio.to_thread(unmount, path)

    async def _run(self, started: float) -> RunResult:
        try:
            opened = [asyncio.Event() for _ in self.keepers]
            keepers = [
                asyncio.create_task(self.keep(k, e))
                for k, e in zip(self.keepers, opened, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), _OPEN_TIMEOUT)
            workload_start = time.monotonic()
            faulters = [
                asyncio.create_task(self.fs_faults()),
                asyncio.create_task(self.s3_faults()),
                asyncio.create_task(self.kills()),
                asyncio.create_task(self.call_faults()),
                asyncio.create_task(self.disk_fills()),
            ]
            await asyncio.sleep(self.s.duration)
            self.stopping = True
            workload_seconds = time.monotonic() - workload_start
            for task in faulters:
                task.cancel()
            await asyncio.gather(*faulters, return_exceptions=True)
            self.proxy.enabled = False  # let the workers close cleanly
            for keeper in self.keepers:
                counters = self.counters_of(keeper)
                if counters is not None:
                    counters["stop"] = 1
            done, pending = await asyncio.wait(keepers, timeout=_STOP_TIMEOUT)
            for keeper in self.keepers:
                if keeper.proc is not None and keeper.proc.returncode is None:
                    keeper.crashes.append(
                        f"worker {keeper.worker.index}.{keeper.incarnation} did not stop "
                        f"within {_STOP_TIMEOUT:g} s: {self._stderr_tail(keeper)}"
                    )
                    keeper.proc.kill()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            await self.proxy.aclose()
        return self.result(time.monotonic() - started, workload_seconds)

    def result(self, wall: float, workload: float) -> RunResult:
        totals = dict.fromkeys(COUNTERS, 0)
        for path in glob.glob(os.path.join(self.run_dir, "w*.counters")):
            counters = Counters(path)
            for name, value in counters.as_dict().items():
                if name not in _NOT_SUMMED:
                    totals[name] += value
            counters.close()
        for name in _NOT_SUMMED:
            totals.pop(name, None)
        faults: dict[str, int] = {}
        faults.update({f"fs_{k}": v for k, v in self.fs.counts.items()})
        if self.s3 is not None:
            faults.update({f"s3_{k}": v for k, v in self.s3.counts.items()})
        faults.update({f"proxy_{k}": v for k, v in self.proxy.faults.items()})
        faults.update({k: totals[k] for k in _CALL_FAULTS if totals.get(k)})
        if self.disk_fulls:
            faults["fs_disk_full"] = self.disk_fulls
        if self.fs.skipped:
            skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(self.fs.skipped.items()))
            self.notes.append(f"FS faults due but not made: {skipped}")
        kills = sum(k.kills for k in self.keepers)
        faults["sigkill"] = kills
        findings: list[str] = []
        kvtier_paths: set[str] = set()
        for path in sorted(glob.glob(os.path.join(self.run_dir, "w*.log"))):
            with open(path, errors="replace") as f:
                for line in f:
                    if " START " in line and "kvtier=" in line:
                        kvtier_paths.add(line.rsplit("kvtier=", 1)[1].strip())
                    if any(tag in line for tag in _FINDINGS) and len(findings) < 200:
                        findings.append(f"{os.path.basename(path)}: {line.strip()}")
        return RunResult(
            settings=self.s,
            counters=totals,
            faults=dict(sorted(faults.items())),
            kills=kills,
            restarts=sum(k.restarts for k in self.keepers),
            crashes=[c for k in self.keepers for c in k.crashes],
            findings=findings,
            wall_seconds=wall,
            workload_seconds=workload,
            run_dir=self.run_dir,
            kvtier_paths=sorted(kvtier_paths),
            proxy_requests=self.proxy.requests,
            notes=self.notes,
        )


_FINDINGS = (
    " ORACLE ",
    " DURABLE_LOSS ",
    " FALSE_MISS ",
    " LEAK",
    " CONTRACT ",
    " OVERRUN ",
    " OPEN_FAILED ",
)


def fill_up(path: str) -> bool:
    """Write zeros to ``path`` until its file system is full; whether any were written."""
    chunk = bytes(1 << 20)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                n = os.write(fd, chunk)
            except OSError:
                break  # ENOSPC: full
            if n <= 0:
                break
            written += n
            if n < len(chunk):
                chunk = chunk[:n]  # the last pages: go on until a write fails
    finally:
        os.close(fd)
    return written > 0


async def run_one(settings: SoakSettings, servers: Servers, run_dir: str) -> RunResult:
    os.makedirs(run_dir, exist_ok=True)
    return await Run(settings, servers, run_dir).run()


def op_logs(run_dir: str, tail: int) -> dict[str, list[str]]:
    """Each worker incarnation's op log, its last ``tail`` lines."""
    logs: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "w*.log"))):
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
        logs[os.path.basename(path)] = lines[-tail:]
    return logs


def as_json(result: RunResult) -> dict[str, Any]:
    return {
        "seed": result.settings.seed,
        "counters": result.counters,
        "faults": result.faults,
        "kills": result.kills,
        "restarts": result.restarts,
        "crashes": result.crashes,
        "findings": result.findings,
        "wall_seconds": result.wall_seconds,
        "workload_seconds": result.workload_seconds,
        "run_dir": result.run_dir,
        "kvtier": result.kvtier_paths,
        "proxy_requests": result.proxy_requests,
        "notes": result.notes,
    }
