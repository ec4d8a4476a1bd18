"""How right a router's view of the nodes' KV blocks is, through everything that makes it wrong.

Several node processes (``benchmarks.residency_node``), each with a FS tier of its own and one
S3 prefix shared by all (a real SeaweedFS), publish their tiers' events
(``kvtier.integrations.kv_events.KVEventPublisher``). A router on a thread of its own (its own
event loop and sockets) builds its view only from those events, with one
``kvtier.integrations.kv_subscriber.KVEventSubscriber`` per node feeding a ``ResidencyView``:
each node's FS tier per node, the shared S3 tier once. The driver runs a mixed workload in
rounds and, in each, one of every kind of divergence:

- ``evicted``: stores past the FS capacity, one at a time (the tier evicts and announces);
  its convergence runs from the burst's first store to the last key leaving the view, and
  ``eviction_latency`` has each evicted key's own, from the store that evicted it;
- ``corrupt``: a block file damaged by hand, then loaded (found corrupt, deleted, announced);
- ``fs_deleted`` / ``s3_deleted``: ``tier.delete`` on a node; ``s3_other_store``: a block one
  node stores in the shared prefix (every node can load it);
- ``s3_removed_behind``: an object deleted in the bucket by something else (a lifecycle rule),
  then loaded by one node (a request touching it); ``s3_removed_unloaded``: the same, loaded
  by nobody (the S3 index's audit finds it, every ``--audit-every`` seconds, so it is waited
  for up to that, twice the time the slowest node's last audit took, plus ``--bound``);
  ``fs_removed_by_hand``: a block file unlinked, then loaded; ``fs_removed_unloaded``: the
  same, loaded by nobody (the owner's walk of its folder finds it, every ``--walk-every``
  seconds);
- ``node_restart``: a node killed with SIGKILL and started again (it announces what it kept);
- ``router_restart``: the router's view and sockets thrown away and made again (it asks each
  node for its full state);
- ``slow_subscriber``: the router stalls while the nodes publish past the high-water marks
  (messages are lost; the sequence shows it; replay or the full state repairs it).

For each it measures the **convergence time**: from the divergence to the router's view
agreeing with the truth about the keys involved (what each node's folder holds, what the bucket
lists), polled every few milliseconds up to ``--bound`` seconds. At the end of each round, once
the view agrees or ``--bound`` passed, it samples the whole truth against the whole view, per
tier: **precision** (believed and true / believed) and **recall** (true and believed / true);
beliefs still wrong then are older than the bound. It also samples during the rounds, with
events in flight (``in_flight``).

    python -m benchmarks.residency --quick --json       # seconds: what the tests run
    python -m benchmarks.residency --rounds 40          # every kind 40 times
    python -m benchmarks.residency --skip s3_removed_behind   # all kinds but that one

Without ``--s3-endpoint`` it starts a SeaweedFS of its own (``devtools``) and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import json_output
from kvtier.integrations.kv_subscriber import KVEventSubscriber, ResidencyView, WireEvent

KINDS = (
    *("evicted", "corrupt", "fs_deleted", "s3_deleted", "s3_other_store"),
    *("s3_removed_behind", "s3_removed_unloaded", "fs_removed_by_hand", "fs_removed_unloaded"),
    *("node_restart", "router_restart"),
    "slow_subscriber",
)
_HEX_KEY = re.compile(r"[0-9a-f]{32}")
_POLL_S = 0.005
_CALL_KEYS = 1_000  # keys per command to a node


# -- the router, on a thread of its own ---------------------------------------------------------


class Router:
    """A view built only from events, on its own thread and loop; ``stall`` makes it a slow
    subscriber for a while (its loop blocked while the sockets fill and drop)."""

    def __init__(self, endpoints: list[tuple[str, str]], rcvhwm: int) -> None:
        self.lock = threading.Lock()
        self.view = ResidencyView(len(endpoints))
        self._endpoints, self._rcvhwm = endpoints, rcvhwm
        self._stall_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.subscribers: list[KVEventSubscriber] = []
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _apply(self, node: int, events: list[WireEvent]) -> None:
        if self._stall_s:
            stall, self._stall_s = self._stall_s, 0.0
            time.sleep(stall)  # blocks this router's loop: a subscriber that falls behind
        with self.lock:
            self.view.apply(node, events)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.subscribers = [
            KVEventSubscriber(
                pub,
                replay_endpoint=replay,
                on_batch=functools.partial(self._apply, i),
                rcvhwm=self._rcvhwm,
                request_timeout=2.0,
            )
            for i, (pub, replay) in enumerate(self._endpoints)
        ]
        async with contextlib.AsyncExitStack() as stack:
            tasks = []
            for s in self.subscribers:
                await stack.enter_async_context(s)
                tasks.append(asyncio.create_task(s.run()))
            self._ready.set()
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stall(self, seconds: float) -> None:
        self._stall_s = seconds

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def snapshot(self, nodes: int) -> tuple[list[set[bytes]], set[bytes]]:
        with self.lock:
            fs = [
                {k for k in self.view.believed(i, "fs") if isinstance(k, bytes)}
                for i in range(nodes)
            ]
            s3 = {k for k in self.view.shared("s3") if isinstance(k, bytes)}
        return fs, s3

    def s3_credited_apart(self, nodes: int) -> int:
        """S3 blocks the view credits to one node alone (as a private tier), and nodes the
        shared tier is not credited to: both should stay 0."""
        with self.lock:
            alone = sum(len(self.view.believed(i, "s3")) for i in range(nodes))
            unreached = sum(not self.view.reaches(i, "s3") for i in range(nodes))
        return alone + unreached

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.subscribers:
            for name in (
                "missed",
                "replayed",
                "resets",
                "restarts",
                "replays_asked",
                "full_states_asked",
            ):
                out[name] = out.get(name, 0) + getattr(s.statistics, name)
            out["repairs_failed"] = out.get("repairs_failed", 0) + s.repairs_failed
            out["bad_messages"] = out.get("bad_messages", 0) + s.bad_messages
        return out


# -- the nodes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Node:
    """One node process and what it needs to start again on the same ports and folder."""

    index: int
    root: str
    pub: str
    replay: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    ops: int = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.residency_node",
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"node {self.index} did not start")

    async def call(self, op: str, tier: str = "fs", keys: list[bytes] = ()) -> int:  # type: ignore[assignment]
        answer = await self.ask({"op": op, "tier": tier, "keys": [k.hex() for k in keys]})
        self.ops += len(keys)
        return int(answer["ok"])

    async def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one command; its answer (waited for a minute)."""
        assert (
            self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        )
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        answer: dict[str, Any] = json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 60))
        return answer

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                await self.kill()


# -- the truth -------------------------------------------------------------------------------


def fs_truth(root: str) -> set[bytes]:
    """The blocks a node's folder holds: its block files, named by their key's hex."""
    found: set[bytes] = set()
    for _, _, files in os.walk(root):
        found.update(bytes.fromhex(name) for name in files if _HEX_KEY.fullmatch(name))
    return found


def fs_path(root: str, key: bytes) -> str | None:
    for folder, _, files in os.walk(root):
        if key.hex() in files:
            return os.path.join(folder, key.hex())
    return None


def damage(path: str) -> None:
    """Flip the last byte of a block file, as a disk fault would."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


class Bucket:
    """The shared prefix as the object store lists it, and deletes behind kvtier's back."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self._name = re.compile(re.escape(prefix) + r"/[0-9a-f]{2}/([0-9a-f]{32})")

    async def truth(self) -> set[bytes]:
        found: set[bytes] = set()
        paginator = self.client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            for obj in page.get("Contents", ()):
                if m := self._name.fullmatch(obj["Key"]):
                    found.add(bytes.fromhex(m.group(1)))
        return found

    async def remove(self, key: bytes) -> None:
        name = f"{self.prefix}/{key.hex()[:2]}/{key.hex()}"
        await self.client.delete_object(Bucket=self.bucket, Key=name)


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Sampled agreement of one tier: believed, true, and both, summed over samples."""

    believed: int = 0
    true: int = 0
    both: int = 0
    samples: int = 0
    wrong_samples: int = 0

    def add(self, believed: set[bytes], true: set[bytes]) -> None:
        both = len(believed & true)
        self.believed += len(believed)
        self.true += len(true)
        self.both += both
        self.samples += 1
        self.wrong_samples += believed != true

    def figures(self) -> dict[str, Any]:
        return {
            "precision": self.both / self.believed if self.believed else 1.0,
            "recall": self.both / self.true if self.true else 1.0,
            "samples": self.samples,
            "samples_with_a_wrong_belief": self.wrong_samples,
            "believed": self.believed,
            "true": self.true,
        }


@dataclass
class Run:
    args: argparse.Namespace
    nodes: list[Node]
    bucket: Bucket
    router: Router
    rng: random.Random
    converged: dict[str, list[float | None]] = field(default_factory=lambda: {k: [] for k in KINDS})
    settled: dict[str, Tally] = field(default_factory=lambda: {"fs": Tally(), "s3": Tally()})
    in_flight: dict[str, Tally] = field(default_factory=lambda: {"fs": Tally(), "s3": Tally()})
    router_stats: list[dict[str, int]] = field(default_factory=list)
    left_wrong: dict[str, dict[str, int]] = field(default_factory=dict)  # past the bound, by kind
    # The divergence that last touched a key, to say which one left a key wrong (a key no
    # divergence touched is "stored": a plain store of the workload).
    touched: dict[bytes, str] = field(default_factory=dict)
    wrong_by_cause: dict[str, int] = field(default_factory=dict)  # at the end of each round
    # S3 keys wrong at the end of the last round: a whole-view divergence of this round is
    # also judged apart from them (what it changed itself), in ``by_tier``.
    carried: set[bytes] = field(default_factory=set)
    by_tier: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    counter: int = 0
    evictions: list[float] = field(default_factory=list)  # each evicted key's latency, at most
    stated_bounds: list[float] = field(default_factory=list)  # s3_removed_unloaded's waits
    s3_stored: dict[int, list[list[bytes]]] = field(default_factory=dict)  # by node, by round
    s3_credited_apart: int = 0  # the most seen at a sample (see Router.s3_credited_apart)

    def new_keys(self, n: int) -> list[bytes]:
        self.counter += n
        return [os.urandom(16) for _ in range(n)]

    async def truth(self) -> tuple[list[set[bytes]], set[bytes]]:
        fs = [await asyncio.to_thread(fs_truth, n.root) for n in self.nodes]
        return fs, await self.bucket.truth()

    async def agree(self) -> bool:
        (fs, s3), (vfs, vs3) = await self.truth(), self.router.snapshot(len(self.nodes))
        return fs == vfs and s3 == vs3

    async def until(
        self, check: Callable[[], bool], started: float, bound: float | None = None
    ) -> float | None:
        """Seconds from ``started`` until ``check()`` holds; None past ``bound`` (default
        ``--bound``)."""
        while time.perf_counter() - started < (self.args.bound if bound is None else bound):
            if check():
                return time.perf_counter() - started
            await asyncio.sleep(_POLL_S)
        return None

    async def until_gone(
        self, node: int, gone: set[bytes], started: list[float], t0: float
    ) -> float | None:
        """Seconds from ``t0`` until the view holds none of ``gone`` (None past ``--bound``),
        noting each key's own latency in ``evictions``: the k-th key to leave the view was
        the k-th evicted (events go out in order), by the k-th of the stores that evicted
        (the last ``len(gone)``); so its latency is at most its arrival less that store's
        start."""
        arrived: dict[bytes, float] = {}
        while time.perf_counter() - t0 < self.args.bound:
            believed = self.router.snapshot(len(self.nodes))[0][node]
            now = time.monotonic()
            for key in gone - believed - arrived.keys():
                arrived[key] = now
            if len(arrived) == len(gone):
                break
            await asyncio.sleep(_POLL_S)
        if len(arrived) == len(gone) <= len(started):  # blocks of one size: the stores
            # filled the room left first, then each evicted one block
            times = sorted(arrived.values())
            evicting = sorted(started)[len(started) - len(gone) :]
            self.evictions.extend(a - s for a, s in zip(times, evicting, strict=True))
        else:  # each from the burst's start, an upper bound
            self.evictions.extend(a - started[0] for a in arrived.values())
        return time.perf_counter() - t0 if len(arrived) == len(gone) else None

    async def until_agree(self, started: float, kind: str) -> float | None:
        """Seconds until the whole view agrees (None past the bound); also when each tier
        did (``by_tier``; S3 apart from keys an earlier round left wrong, ``carried``)."""
        fs_at: float | None = None
        s3_at: float | None = None
        took: float | None = None
        while (now := time.perf_counter() - started) < self.args.bound:
            (fs, s3), (vfs, vs3) = await self.truth(), self.router.snapshot(len(self.nodes))
            if fs_at is None and fs == vfs:
                fs_at = now
            if s3_at is None and not (s3 ^ vs3) - self.carried:
                s3_at = now
            if fs == vfs and s3 == vs3:
                took = now
                break
            await asyncio.sleep(_POLL_S)
        by_tier = self.by_tier.setdefault(kind, {"fs": [], "s3_apart_from_carried": []})
        by_tier["fs"].append(fs_at)
        by_tier["s3_apart_from_carried"].append(s3_at)
        if took is not None:
            if kind == "end_of_round":
                self.carried = set()
            return took
        (fs, s3), (vfs, vs3) = await self.truth(), self.router.snapshot(len(self.nodes))
        if kind == "end_of_round":
            self.carried = s3 ^ vs3
        left = self.left_wrong.setdefault(kind, {})
        for name, count in (
            ("fs_believed_not_true", sum(len(v - t) for v, t in zip(vfs, fs, strict=True))),
            ("fs_true_not_believed", sum(len(t - v) for v, t in zip(vfs, fs, strict=True))),
            ("s3_believed_not_true", len(vs3 - s3)),
            ("s3_true_not_believed", len(s3 - vs3)),
        ):
            left[name] = left.get(name, 0) + count
        if kind == "end_of_round":
            for tier, wrong in (
                ("fs", set().union(*(v ^ t for v, t in zip(vfs, fs, strict=True)))),
                ("s3", vs3 ^ s3),
            ):
                for key in wrong:
                    cause = f"{tier}:{self.touched.get(key, 'stored')}"
                    self.wrong_by_cause[cause] = self.wrong_by_cause.get(cause, 0) + 1
        return None

    def believed_fs(self, node: int, key: bytes) -> bool:
        return key in self.router.snapshot(len(self.nodes))[0][node]

    def believed_s3(self, key: bytes) -> bool:
        return key in self.router.snapshot(len(self.nodes))[1]

    async def sample(self, tallies: dict[str, Tally]) -> None:
        (fs, s3), (vfs, vs3) = await self.truth(), self.router.snapshot(len(self.nodes))
        for true, believed in zip(fs, vfs, strict=True):
            tallies["fs"].add(believed, true)
        tallies["s3"].add(vs3, s3)
        apart = self.router.s3_credited_apart(len(self.nodes))
        self.s3_credited_apart = max(self.s3_credited_apart, apart)


async def background(run: Run, node: Node) -> None:
    """A node's share of a round: FS stores past its capacity (evictions), S3 stores (and,
    with ``--s3-keep-rounds``, deletes of its S3 stores of that many rounds before), loads;
    sent ``_CALL_KEYS`` keys at a time (each command's answer is waited for a minute)."""
    a = run.args
    stored = run.s3_stored.setdefault(node.index, [])
    stored.append([])
    for tier, count in (("fs", a.fs_stores), ("s3", a.s3_stores)):
        for start in range(0, count, _CALL_KEYS):
            keys = run.new_keys(min(_CALL_KEYS, count - start))
            await node.call("store", tier, keys)
            if tier == "s3":
                stored[-1].extend(keys)
    if a.s3_keep_rounds and len(stored) > a.s3_keep_rounds:  # the shared prefix stays bounded
        old = stored.pop(0)
        for start in range(0, len(old), _CALL_KEYS):
            await node.call("delete", "s3", old[start : start + _CALL_KEYS])
    held = sorted(await asyncio.to_thread(fs_truth, node.root))
    await node.call("load", "fs", run.rng.sample(held, min(len(held), a.loads)))


async def diverge(run: Run, kind: str) -> None:
    """Make one divergence of ``kind`` and record how long the view took to agree again."""
    rng, nodes = run.rng, run.nodes
    node = rng.choice(nodes)
    other = nodes[(node.index + 1) % len(nodes)]
    t0 = time.perf_counter()
    took: float | None
    if kind == "evicted":
        before = await asyncio.to_thread(fs_truth, node.root)
        keys = run.new_keys(run.args.fs_blocks)  # pushes all out, one store at a time
        cmd = {"op": "store", "tier": "fs", "keys": [k.hex() for k in keys], "timed": True}
        started: list[float] = (await node.ask(cmd))["started"]
        node.ops += len(keys)
        gone = before - await asyncio.to_thread(fs_truth, node.root)
        took = await run.until_gone(node.index, gone, started, t0)
    elif kind in ("corrupt", "fs_removed_by_hand", "fs_removed_unloaded", "fs_deleted"):
        key = rng.choice(sorted(await asyncio.to_thread(fs_truth, node.root)))
        run.touched[key] = kind
        t0 = time.perf_counter()
        path = fs_path(node.root, key)
        assert path is not None
        bound = None
        if kind == "corrupt":
            await asyncio.to_thread(damage, path)
        elif kind in ("fs_removed_by_hand", "fs_removed_unloaded"):
            os.unlink(path)
        if kind == "fs_removed_unloaded":  # nobody loads it: the owner's next walk finds it
            bound = run.args.walk_every + run.args.bound
        else:
            await node.call("delete" if kind == "fs_deleted" else "load", "fs", [key])
        took = await run.until(lambda: not run.believed_fs(node.index, key), t0, bound)
    elif kind in ("s3_deleted", "s3_removed_behind", "s3_removed_unloaded"):
        key = rng.choice(sorted(await run.bucket.truth()))
        run.touched[key] = kind
        t0 = time.perf_counter()
        bound = None
        if kind == "s3_removed_behind":
            await run.bucket.remove(key)
            await other.call("load", "s3", [key])  # the next request touching it, on one node
        elif kind == "s3_removed_unloaded":
            await run.bucket.remove(key)  # and nobody loads it: an audit that lists it after
            # the removal finds it: the one running may have passed it, and the next starts at
            # the next interval, so the stated bound counts two audits' time (the longest a
            # node last took) besides the interval
            audit = max([(await n.ask({"op": "audit_seconds"}))["seconds"] for n in nodes])
            bound = run.args.audit_every + 2 * audit + run.args.bound
            run.stated_bounds.append(bound)
        else:
            await other.call("delete", "s3", [key])
        took = await run.until(lambda: not run.believed_s3(key), t0, bound)
    elif kind == "s3_other_store":
        (key,) = run.new_keys(1)
        run.touched[key] = kind
        await node.call("store", "s3", [key])
        took = await run.until(lambda: run.believed_s3(key), t0)
    elif kind == "node_restart":
        await node.kill()
        await node.start()
        took = await run.until_agree(t0, kind)
    elif kind == "router_restart":
        run.router_stats.append(run.router.stats())
        run.router.close()
        run.router = Router([(n.pub, n.replay) for n in nodes], run.args.rcvhwm)
        took = await run.until_agree(t0, kind)
    else:  # slow_subscriber
        run.router.stall(run.args.stall)
        for n in nodes:
            await n.call("store", "fs", run.new_keys(run.args.fs_blocks // 2))
        await asyncio.sleep(run.args.stall)
        t0 = time.perf_counter()  # from when it reads again
        took = await run.until_agree(t0, kind)
    run.converged[kind].append(took)


async def run_all(args: argparse.Namespace, endpoint: str, bucket: str) -> dict[str, Any]:
    from aiobotocore.session import get_session

    prefix = f"residency-{os.getpid()}-{int(time.time())}"
    folder = tempfile.mkdtemp(prefix="kvtier-residency-")
    nodes = []
    for i in range(args.nodes):
        root, pub, replay = os.path.join(folder, f"node{i}"), free_port(), free_port()
        argv = [
            *("--root", root, "--pub", f"tcp://127.0.0.1:{pub}"),
            *("--replay", f"tcp://127.0.0.1:{replay}", "--s3-endpoint", endpoint),
            *("--bucket", bucket, "--prefix", prefix, "--fs-blocks", str(args.fs_blocks)),
            *("--index-refresh", str(args.index_refresh), "--hwm", str(args.hwm)),
            *("--audit-every", str(args.audit_every), "--walk-every", str(args.walk_every)),
        ]
        nodes.append(Node(i, root, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", argv))
    client_cm = get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench-secret",
    )
    started = time.perf_counter()
    try:
        async with client_cm as client:
            await asyncio.gather(*(n.start() for n in nodes))
            router = Router([(n.pub, n.replay) for n in nodes], args.rcvhwm)
            run = Run(args, nodes, Bucket(client, bucket, prefix), router, random.Random(args.seed))
            try:
                for n in nodes:  # something in every tier before the first divergence
                    await background(run, n)
                for round_ in range(args.rounds):
                    for n in nodes:
                        await background(run, n)
                        await run.sample(run.in_flight)
                    for kind in KINDS:
                        if kind not in args.skip:
                            await diverge(run, kind)
                    await run.until_agree(time.perf_counter(), "end_of_round")
                    await run.sample(run.settled)
                    print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
            finally:
                run.router_stats.append(run.router.stats())
                run.router.close()
                await asyncio.gather(*(n.stop() for n in nodes))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return summary(run, time.perf_counter() - started)


def summary(run: Run, wall: float) -> dict[str, Any]:
    def times(values: Sequence[float | None]) -> dict[str, Any]:
        done = sorted(v for v in values if v is not None)
        return {
            "count": len(values),
            "converged": len(done),
            "p50_s": done[len(done) // 2] if done else None,
            "max_s": done[-1] if done else None,
        }

    stats: dict[str, int] = {}
    for s in run.router_stats:
        for k, v in s.items():
            stats[k] = stats.get(k, 0) + v
    return {
        "block_operations": sum(n.ops for n in run.nodes),
        "wall_s": wall,
        "settled": {tier: t.figures() for tier, t in run.settled.items()},
        "in_flight": {tier: t.figures() for tier, t in run.in_flight.items()},
        "precision": {tier: t.figures()["precision"] for tier, t in run.settled.items()},
        "recall": {tier: t.figures()["recall"] for tier, t in run.settled.items()},
        "convergence": {kind: times(v) for kind, v in run.converged.items()},
        "eviction_latency": times(run.evictions),
        "s3_removed_unloaded_stated_bound_max_s": max(run.stated_bounds, default=None),
        "convergence_by_tier": {
            kind: {tier: times(v) for tier, v in tiers.items()}
            for kind, tiers in run.by_tier.items()
        },
        "router": stats,
        "s3_blocks_credited_to_one_node_or_nodes_not_credited": run.s3_credited_apart,
        "left_wrong_past_the_bound": run.left_wrong,
        "wrong_at_end_of_round_by_cause": run.wrong_by_cause,
    }


def report(out: dict[str, Any]) -> None:
    print(f"{out['block_operations']:,} block operations in {out['wall_s']:.1f} s", file=sys.stderr)
    for name in ("settled", "in_flight"):
        for tier, f in out[name].items():
            print(
                f"{name:>9} {tier}: precision {f['precision']:.4%} recall {f['recall']:.4%} "
                f"({f['samples']} samples, {f['samples_with_a_wrong_belief']} with a wrong belief)",
                file=sys.stderr,
            )
    for kind, c in out["convergence"].items():
        p50 = "-" if c["p50_s"] is None else f"{c['p50_s'] * 1000:.0f} ms"
        top = "-" if c["max_s"] is None else f"{c['max_s'] * 1000:.0f} ms"
        print(
            f"{kind:>20}: {c['converged']}/{c['count']} converged, p50 {p50}, max {top}",
            file=sys.stderr,
        )
    for kind, tiers in out["convergence_by_tier"].items():
        cells = ", ".join(
            f"{tier} {c['converged']}/{c['count']}"
            + ("" if c["p50_s"] is None else f" (p50 {c['p50_s'] * 1000:.0f} ms)")
            for tier, c in tiers.items()
        )
        print(f"{kind:>20}: by tier: {cells}", file=sys.stderr)
    if (stated := out["s3_removed_unloaded_stated_bound_max_s"]) is not None:
        print(f"s3_removed_unloaded waited up to {stated:.2f} s at most", file=sys.stderr)
    if (each := out["eviction_latency"])["count"]:
        print(
            f"each eviction to the view: p50 {each['p50_s'] * 1000:.0f} ms, "
            f"max {each['max_s'] * 1000:.0f} ms ({each['count']} keys)",
            file=sys.stderr,
        )
    print(f"router: {out['router']}", file=sys.stderr)
    apart = out["s3_blocks_credited_to_one_node_or_nodes_not_credited"]
    print(
        f"shared S3 blocks credited to one node alone, or nodes not credited: {apart}",
        file=sys.stderr,
    )
    print(f"wrong past the bound: {out['left_wrong_past_the_bound']}", file=sys.stderr)
    print(
        f"wrong at the end of a round, by what last touched the key: "
        f"{out['wrong_at_end_of_round_by_cause']}",
        file=sys.stderr,
    )


@contextlib.contextmanager
def object_store(args: argparse.Namespace) -> Iterator[str]:
    """The given endpoint, or a SeaweedFS of the run's own (stopped after)."""
    if args.s3_endpoint is not None:
        yield args.s3_endpoint
        return
    import anyio

    from devtools.weed_server import WeedServer, ensure_bucket

    with WeedServer() as server:
        anyio.run(ensure_bucket, server.endpoint_url, args.s3_bucket)
        yield server.endpoint_url


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few rounds, for the tests")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument(
        "--rounds", type=int, help="rounds; each makes every divergence once (20, quick 1)"
    )
    p.add_argument("--fs-blocks", type=int, default=48, help="each node's FS capacity in blocks")
    p.add_argument("--fs-stores", type=int, default=24, help="FS stores per node per round")
    p.add_argument("--s3-stores", type=int, default=8, help="S3 stores per node per round")
    p.add_argument("--loads", type=int, default=8, help="FS loads per node per round")
    p.add_argument(
        "--s3-keep-rounds",
        type=int,
        default=0,
        help="each node deletes its S3 stores of this many rounds before (0: keeps them all, "
        "and the shared prefix grows every round)",
    )
    p.add_argument("--index-refresh", type=float, default=0.5, help="the S3 tiers' journal period")
    p.add_argument(
        "--audit-every",
        type=float,
        default=2.0,
        help="the S3 tiers' index_audit_every (one node lists the shared prefix this often)",
    )
    p.add_argument(
        "--walk-every",
        type=float,
        default=2.0,
        help="the FS tiers' walk_interval (each owner walks its folder this often)",
    )
    p.add_argument("--bound", type=float, default=3.0, help="how long to wait for agreement")
    p.add_argument("--stall", type=float, default=0.5, help="how long the slow subscriber stalls")
    p.add_argument("--hwm", type=int, default=8, help="the publishers' send high-water mark")
    p.add_argument("--rcvhwm", type=int, default=8, help="the router's receive high-water mark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip",
        type=lambda text: set(filter(None, text.split(","))),
        default=set(),
        metavar="KIND,...",
        help="divergences not to make (to see what the others leave wrong on their own)",
    )
    p.add_argument("--s3-endpoint", help="an S3 endpoint (default: a SeaweedFS of its own)")
    p.add_argument("--s3-bucket", default="kvtier-bench")
    args = p.parse_args(argv)
    if unknown := args.skip - set(KINDS):
        p.error(f"--skip: unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with json_output(args.json) as out, object_store(args) as endpoint:
        out.update(asyncio.run(run_all(args, endpoint, args.s3_bucket)))
        out["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "skip")}
        out["settings"]["skip"] = sorted(args.skip)
        report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
