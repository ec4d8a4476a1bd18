"""A separate process that uses an FSTier, for the kill -9 and shared-folder tests.

``python tests/fs_worker.py store ROOT NS BLOCK_BYTES FSYNC``: stores blocks 0, 1, 2, ... for
ever, printing ``stored N`` after each one returns; the test kills it with SIGKILL.

``python tests/fs_worker.py mix ROOT NS BLOCK_BYTES CAPACITY KEYS OPS SEED``: stores and loads
overlapping keys under a small capacity while another process does the same, verifies every
load against the expected bytes, and prints one JSON summary line.

``python tests/fs_worker.py serve ROOT NS BLOCK_BYTES SHARED [OPTIONS]``: opens a tier
(``SHARED``: ``auto``, ``true`` or ``false``), prints ``opened owner=<True|False>`` (or
``refused <message>`` and exits), then answers one command per line on stdin: ``store I``
(prints ``stored I``), ``check`` (checks the folder, prints ``owner <True|False>``) and
``quit`` (closes, prints ``closed``). Options: ``--key SECRET`` (an integrity key),
``--hold-marker`` (print ``holding`` just before writing a new folder's marker, and go on
when stdin says ``go``), ``--no-folder-lock`` (the folder itself takes no lock, as on NFS).
``Served`` drives one from a test.

The bytes of block ``i`` are derived from ``(NS, i)``, so any process can check them.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.streams.buffered

from kvtier import BlockNotFoundError, CorruptBlockError, InvalidArgumentError, TierError
from kvtier.tiers.fs import FSTier, _marker, _ownership


def key_of(ns: str, i: int) -> bytes:
    return b"\x01" + hashlib.blake2b(f"{ns}/{i}".encode(), digest_size=15).digest()


def payload_of(ns: str, i: int, block_bytes: int) -> bytes:
    return hashlib.shake_128(f"{ns}/{i}/payload".encode()).digest(block_bytes)


def key_and_data(
    ns: str, block_bytes: int
) -> tuple[Callable[[int], bytes], Callable[[int], bytes]]:
    """``key(i)`` and ``data(i)`` of namespace ``ns``: the blocks a test module stores."""
    return functools.partial(key_of, ns), functools.partial(_payload, ns, block_bytes)


def _payload(ns: str, block_bytes: int, i: int) -> bytes:
    return payload_of(ns, i, block_bytes)


async def store_forever(root: str, ns: str, block_bytes: int, fsync: str) -> None:
    async with FSTier(root, fsync=fsync) as tier:
        i = 0
        while True:
            await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, block_bytes)))
            print(f"stored {i}", flush=True)
            i += 1


async def mix(
    root: str, ns: str, block_bytes: int, capacity: int, keys: int, ops: int, seed: int
) -> None:
    rng = random.Random(seed)
    counts = {"stored": 0, "loaded": 0, "missed": 0, "corrupt": 0, "wrong": 0}
    errors: list[str] = []
    dst = bytearray(block_bytes)
    async with FSTier(root, capacity_bytes=capacity, fsync="never") as tier:
        for _ in range(ops):
            i = rng.randrange(keys)
            try:
                if rng.random() < 0.5:
                    await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, block_bytes)))
                    counts["stored"] += 1
                else:
                    await tier.load(key_of(ns, i), memoryview(dst))
                    if dst == payload_of(ns, i, block_bytes):
                        counts["loaded"] += 1
                    else:
                        counts["wrong"] += 1
            except BlockNotFoundError:
                counts["missed"] += 1
            except CorruptBlockError:
                counts["corrupt"] += 1
            except TierError as exc:
                errors.append(repr(exc))
    print(json.dumps({**counts, "errors": errors}), flush=True)


def _hold_marker() -> None:
    """Stop just before a new folder's marker is written (after the folder was found empty),
    until the test says ``go``: two openers held so both race to write it."""
    real = _marker._write_new
    held = False

    def holding(path: Path, data: bytes) -> None:
        nonlocal held
        if not held and path.name.startswith(".kvtier-fs.json"):
            held = True
            print("holding", flush=True)
            if sys.stdin.readline().strip() != "go":
                raise SystemExit("expected go")
        real(path, data)

    _marker._write_new = holding


def _no_folder_lock() -> None:
    """The folder itself refuses a lock, as a folder on NFS does: the lock file alone."""

    def refused(root: Path) -> Any:
        raise OSError(errno.ENOLCK, "no locks on folders here")

    _ownership._lock_folder = refused


async def serve(root: str, ns: str, block_bytes: int, shared: str, options: list[str]) -> None:
    sharing: Any = {"auto": "auto", "true": True, "false": False}[shared]
    secret = options[options.index("--key") + 1] if "--key" in options else None
    if "--hold-marker" in options:
        _hold_marker()
    if "--no-folder-lock" in options:
        _no_folder_lock()
    tier = FSTier(root, shared=sharing, integrity_key=secret)
    try:
        await tier.open()
    except InvalidArgumentError as exc:
        print(f"refused {exc}", flush=True)
        await tier.aclose()
        return
    print(f"opened owner={tier.owner}", flush=True)
    async with tier:
        while True:
            line = (await anyio.to_thread.run_sync(sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                break
            if line[0] == "store":
                i = int(line[1])
                await tier.store(key_of(ns, i), memoryview(payload_of(ns, i, block_bytes)))
                print(f"stored {i}", flush=True)
            elif line[0] == "check":
                await tier._check_folder()
                print(f"owner {tier.owner}", flush=True)
    print("closed", flush=True)


class Served:
    """A ``serve`` worker process, driven line by line from a test."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._stdin = process.stdin
        self._lines = anyio.streams.buffered.BufferedByteReceiveStream(process.stdout)

    async def line(self) -> str:
        """The worker's next line (at most 60 s away: a hung worker fails the test)."""
        with anyio.fail_after(60):
            return (await self._lines.receive_until(b"\n", 1 << 16)).decode()

    async def ask(self, command: str) -> str:
        """Send ``command``; the worker's answer."""
        await self._stdin.send(f"{command}\n".encode())
        return await self.line()

    async def quit(self) -> None:
        """Close the worker's tier and wait for the process to end."""
        assert await self.ask("quit") == "closed"
        with anyio.fail_after(60):
            assert await self.process.wait() == 0


@asynccontextmanager
async def served(root: Path, *args: str, ns: str = "w", block: int = 4096) -> AsyncIterator[Served]:
    """A ``serve`` worker on ``root`` (``args``: ``SHARED`` and options); killed at the end if
    it is still running."""
    command = [sys.executable, __file__, "serve", str(root), ns, str(block), *args]
    async with await anyio.open_process(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as process:
        try:
            yield Served(process)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


def main(argv: list[str]) -> None:
    mode, root, ns, block_bytes = argv[0], argv[1], argv[2], int(argv[3])
    if mode == "store":
        anyio.run(store_forever, root, ns, block_bytes, argv[4])
    elif mode == "serve":
        anyio.run(serve, root, ns, block_bytes, argv[4], argv[5:])
    elif mode == "mix":
        capacity, keys, ops, seed = (int(a) for a in argv[4:8])
        anyio.run(mix, root, ns, block_bytes, capacity, keys, ops, seed)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
