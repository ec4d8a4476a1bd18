"""Counters shared between processes in memory-mapped files, so they survive SIGKILL.

A worker's counters (``Counters``) are written in place as it runs: when the coordinator kills
it, what it counted up to that instant is still in the page cache, and nothing is lost or
double counted. The coordinator reads them, and sets the worker's ``stop`` flag there. Other
workers read a writer's ``seq_hw`` (the oracle's high-water mark) from its file.

Fault epochs (``Epochs``): one counter per FS folder, raised by the coordinator before each
fault it injects there and again after it (odd: a fault is in progress); a worker that sees a
folder's epoch even and unchanged across an operation knows no fault touched that folder
meanwhile (the false-miss oracle's "no fault on its path").
"""

from __future__ import annotations

import mmap
import struct

__all__ = ["COUNTERS", "Counters", "Epochs", "clean"]

COUNTERS = (
    "ops",
    "lookups",
    "scheduler_lookups",
    "loads",
    "blocks_checked",
    "stores",
    "blocks_stored",
    "deletes",
    "prefetches",
    "reopens",
    "durable_stores",
    "durable_checked",
    "durable_losses",
    "durable_evicted",
    "wrong_bytes",
    "foreign_bytes",
    "deadline_overruns",
    "clean_probes",
    "protected_probes",
    "false_misses",
    "probes_unresolved",
    "probes_excluded",
    "probes_deferred",
    "fs_eio",
    "fs_hang",
    "fs_enospc",
    "leaked_threads",
    "leaked_tasks",
    "leaked_fds",
    "leaked_sockets",
    "leaked_pins",
    "leak_checks",
    "kvtier_errors",
    "open_failures",
    "open_failures_transient",
    "contract_errors",
    "seq_hw",
    "stop",
    "verified",
    "heartbeat",
)
_INDEX = {name: i for i, name in enumerate(COUNTERS)}
_Q = struct.Struct("<q")


class _Array:
    """``n`` signed 64-bit integers in a file, mapped shared."""

    def __init__(self, path: str, n: int, *, create: bool) -> None:
        if create:
            with open(path, "wb") as f:
                f.write(bytes(8 * n))
        with open(path, "r+b") as f:  # the map holds its own descriptor
            self._map = mmap.mmap(f.fileno(), 8 * n)

    def get(self, i: int) -> int:
        value: int = _Q.unpack_from(self._map, 8 * i)[0]
        return value

    def set(self, i: int, value: int) -> None:
        _Q.pack_into(self._map, 8 * i, value)

    def close(self) -> None:
        self._map.close()


class Counters(_Array):
    """One worker incarnation's counters, by name (``COUNTERS``)."""

    def __init__(self, path: str, *, create: bool = False) -> None:
        super().__init__(path, len(COUNTERS), create=create)

    def __getitem__(self, name: str) -> int:
        return self.get(_INDEX[name])

    def __setitem__(self, name: str, value: int) -> None:
        self.set(_INDEX[name], value)

    def add(self, name: str, n: int = 1) -> None:
        i = _INDEX[name]
        self.set(i, self.get(i) + n)

    def as_dict(self) -> dict[str, int]:
        return {name: self.get(i) for i, name in enumerate(COUNTERS)}


class Epochs(_Array):
    """A fault epoch per folder, in a fixed order of folder names."""

    def __init__(self, path: str, folders: list[str], *, create: bool = False) -> None:
        self.folders = list(folders)
        super().__init__(path, len(self.folders), create=create)

    def of(self, folder: str) -> int:
        return self.get(self.folders.index(folder))

    def bump(self, folder: str) -> int:
        """Raise ``folder``'s epoch by one (the faulter: odd while its fault runs)."""
        i = self.folders.index(folder)
        value = self.get(i) + 1
        self.set(i, value)
        return value


def clean(epoch: int) -> bool:
    """No fault was in progress when this epoch was read."""
    return epoch % 2 == 0
