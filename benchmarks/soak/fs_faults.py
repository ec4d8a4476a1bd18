"""Faults on the real FS folders, behind the tiers' backs, each counted by kind.

Kinds: a bit flipped in a block file (``bit_flip``), a file cut short (``truncate``), its
bytes replaced by garbage (``replace_garbage``) or by another key's whole block file
(``replace_foreign``: a well-formed block under the wrong name), a file deleted
(``delete_file``), a shard folder deleted (``delete_shard``), the format marker or the lock
file removed (``remove_marker``, ``remove_lock``), and everything in the folder removed
(``wipe_folder``, ``rm -rf folder/*``).

Before each fault the folder's epoch is raised (``shared.Epochs``), so workers can tell that
a fault came between two of their steps. The faulter also remembers exactly what it touched
(``FolderHistory``): the durability oracle hands a restarted worker only blocks no fault can
have reached; and it writes each fault, before making it, to the folder's fault log
(``FaultLog``: the monotonic time, which is one clock for every process on the machine, and
what it reaches: one block file, a shard folder, the whole folder, or only the marker or lock
file), which workers read (``FaultView``) to tell whether a fault reached a block's path since
they stored it (the false-miss oracle). EIO, hung calls and ENOSPC come from inside the
workers (``fs_calls``) and from the small tmpfs the coordinator mounts (``mount_tmpfs``).
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import TextIO

from benchmarks.soak.shared import Epochs

__all__ = [
    "FS_FAULTS",
    "PROTECTED_SHARDS",
    "FSFaulter",
    "FaultView",
    "FolderHistory",
    "fault_log_path",
    "mount_tmpfs",
    "protected",
    "unmount",
]

FS_FAULTS: dict[str, float] = {
    "bit_flip": 30,
    "truncate": 12,
    "replace_garbage": 8,
    "replace_foreign": 10,
    "delete_file": 15,
    "delete_shard": 4,
    "remove_marker": 2,
    "remove_lock": 2,
    "wipe_folder": 0.25,  # rare: it takes every block of the folder with it
}
# The protected shards: block files under these top-level shard folders (1/16 of them) are
# never the target of a fault aimed at one block or one shard folder, nor of an
# injected EIO or hang (``fs_calls``); faults on the whole folder (wipe, marker, lock) and
# SIGKILLs still reach them. The false-miss oracle probes them first: under a fault rate
# that reaches nearly every other block within seconds, they are the keys that stay clean
# long enough to be judged.
PROTECTED_SHARDS = frozenset(f"{i:02x}" for i in range(0x07, 0x100, 0x10))
_MARKER = "kvtier-fs.json"
_LOCK = ".kvtier-fs.lock"
_RELIST = 1.0  # seconds a folder's listing is reused (an empty one is not)
_TRIES = 3  # files tried for one file fault (a listed one may be gone by now)


def protected(name: str) -> bool:
    """Whether block file ``name`` (a key in hex) lies in a protected shard."""
    return name[-4:-2] in PROTECTED_SHARDS


def fault_log_path(run_dir: str, folder: str) -> str:
    return os.path.join(run_dir, f"faults-{folder}.log")


def mount_tmpfs(path: str, size_bytes: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` on ``path`` (made if missing); None when mounted, else
    why not (not root, no mount command, a container that forbids it): the run goes on
    without ENOSPC on that folder."""
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", path],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"rc={done.returncode}")


def unmount(path: str) -> None:
    """Unmount what ``mount_tmpfs`` mounted (lazily if something still holds it)."""
    for args in (["umount", path], ["umount", "-l", path]):
        try:
            if subprocess.run(args, capture_output=True, timeout=20, check=False).returncode == 0:
                return
        except (OSError, subprocess.SubprocessError):
            return


class FaultView:
    """A worker's view of one folder's fault log: for a block, the time of the latest fault
    that reached its file, its shard folders or the whole folder."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self.files: dict[str, float] = {}
        self.shards: list[tuple[str, float]] = []
        self.folder = -1.0

    def poll(self) -> None:
        """Read what the faulter logged since the last poll."""
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except OSError:
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            parts = line.split()
            if len(parts) != 3:
                continue
            at, what, arg = float(parts[0]), parts[1], parts[2]
            if what == "file":
                self.files[arg] = at
            elif what == "shard":
                self.shards.append((arg, at))
            elif what == "folder":
                self.folder = at

    def last_on(self, hex_name: str) -> float:
        """When a fault last reached block ``hex_name``'s path (-1: never)."""
        shard = f"{hex_name[-4:-2]}/{hex_name[-2:]}"
        last = max(self.files.get(hex_name, -1.0), self.folder)
        for rel, at in self.shards:
            if at > last and shard.startswith(rel):
                last = at
        return last

    def forget_before(self, when: float) -> None:
        """Drop shard removals older than ``when`` (no candidate is that old)."""
        self.shards = [(rel, at) for rel, at in self.shards if at >= when]


@dataclass
class FolderHistory:
    """What the faulter did to one folder: files touched (by name) and removals of whole
    shards or of everything (with the epoch each came at)."""

    touched: set[str] = field(default_factory=set)
    removed: list[tuple[str, int]] = field(default_factory=list)  # (relative path, epoch)

    def intact(self, hex_key: str, since_epoch: int) -> bool:
        """Whether no fault can have reached this key's file since the folder's epoch was
        ``since_epoch`` (a removal that began at that very epoch counts: it may have ended
        after the store)."""
        if hex_key in self.touched:
            return False
        shard = f"{hex_key[-4:-2]}/{hex_key[-2:]}"
        return not any(
            epoch >= since_epoch and shard.startswith(rel) for rel, epoch in self.removed
        )


class FSFaulter:
    """Injects one fault at a time into one of ``folders`` (name -> path), from a thread."""

    def __init__(
        self, folders: dict[str, str], epochs: Epochs, seed: int, logs: dict[str, str]
    ) -> None:
        self.folders = folders
        self._logs: dict[str, TextIO] = {
            name: open(path, "a", buffering=1)  # noqa: SIM115 - held for the run
            for name, path in logs.items()
        }
        self.epochs = epochs
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.history = {name: FolderHistory() for name in folders}
        self.paused: set[str] = set()
        self._files: dict[str, tuple[float, list[str]]] = {}
        self._kinds = list(FS_FAULTS)
        self._weights = [FS_FAULTS[k] for k in self._kinds]

    def close(self) -> None:
        for log in self._logs.values():
            log.close()

    def _log(self, name: str, what: str, arg: str) -> None:
        """Log a fault before making it (what: file, shard, folder or meta)."""
        self._logs[name].write(f"{time.monotonic():.6f} {what} {arg}\n")

    def _blocks(self, name: str) -> list[str]:
        """The folder's block files outside the protected shards (listed at most once a
        ``_RELIST``; an empty listing is not kept)."""
        listed = self._files.get(name)
        if listed is not None and time.monotonic() - listed[0] < _RELIST:
            return listed[1]
        root = self.folders[name]
        files: list[str] = []
        for a in _subdirs(root):
            if a in PROTECTED_SHARDS:
                continue
            for b in _subdirs(os.path.join(root, a)):
                folder = os.path.join(root, a, b)
                try:
                    files.extend(os.path.join(folder, f) for f in os.listdir(folder) if f[0] != ".")
                except OSError:
                    continue
        if files:
            self._files[name] = (time.monotonic(), files)
        return files

    def _target(self, name: str) -> str | None:
        """A listed block file that still exists (a listed one may be gone by now: evicted,
        deleted, replaced), relisting once when the listing has gone stale; None if none."""
        for _ in range(2):
            files = self._blocks(name)
            for _ in range(_TRIES if files else 0):
                path = self.rng.choice(files)
                if os.path.exists(path):
                    return path
            self._files.pop(name, None)
        return None

    def inject(self) -> str | None:
        """One fault of a seeded kind on a seeded folder; its kind, or None if there was
        nothing to fault (no block files outside the protected shards, or every folder
        paused; counted in ``skipped``). The folder's epoch is odd while the fault runs."""
        names = sorted(n for n in self.folders if n not in self.paused)
        if not names:
            self.skipped["paused"] += 1
            return None
        name = self.rng.choice(names)
        try:
            return self._inject(name)
        finally:
            if self.epochs.of(name) % 2:
                self.epochs.bump(name)

    def _inject(self, name: str) -> str | None:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        root = self.folders[name]
        history = self.history[name]
        if kind in ("remove_marker", "remove_lock", "wipe_folder"):
            epoch = self.epochs.bump(name)
            self._log(name, "folder" if kind == "wipe_folder" else "meta", kind)
            if kind == "wipe_folder":
                history.removed.append(("", epoch))
                for entry in _entries(root):
                    _remove(os.path.join(root, entry))
                self._files.pop(name, None)
            else:
                _remove(os.path.join(root, _MARKER if kind == "remove_marker" else _LOCK))
            self.counts[kind] += 1
            return kind
        path = self._target(name)
        if path is None:
            self.skipped["no_file"] += 1
            return None
        rel = os.path.relpath(path, root)
        epoch = self.epochs.bump(name)
        if kind == "delete_shard":
            shard = rel.split(os.sep)[0] if self.rng.random() < 0.3 else os.path.dirname(rel)
            history.removed.append((shard.replace(os.sep, "/"), epoch))
            self._log(name, "shard", shard.replace(os.sep, "/"))
            _remove(os.path.join(root, shard))
            self._files.pop(name, None)
        else:
            history.touched.add(os.path.basename(path))
            self._log(name, "file", os.path.basename(path))
            if not self._file_fault(kind, path, self._blocks(name)):
                self.skipped["gone"] += 1
                return None
        self.counts[kind] += 1
        return kind

    def _file_fault(self, kind: str, path: str, files: list[str]) -> bool:
        try:
            size = os.path.getsize(path)
            if kind == "delete_file":
                os.unlink(path)
            elif kind == "bit_flip" and size:
                with open(path, "r+b") as f:
                    at = self.rng.randrange(size)
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
            elif kind == "truncate" and size:
                os.truncate(path, self.rng.randrange(size))
            elif kind == "replace_garbage":
                with open(path, "r+b") as f:
                    f.write(self.rng.randbytes(max(size, 1)))
            elif kind == "replace_foreign":
                other = self.rng.choice(files) if files else path
                if other == path:
                    return False
                with open(other, "rb") as f:
                    data = f.read()
                with open(path, "wb") as f:
                    f.write(data)
            else:
                return False
        except OSError:
            return False  # gone meanwhile (the tier evicted or replaced it)
        return True


def _subdirs(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _entries(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
