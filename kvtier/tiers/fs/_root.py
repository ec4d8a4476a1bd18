"""Opening an FS tier's root: make it, clear what dead writers left, list its blocks, probe
O_DIRECT; and the error an unusable root is at open.

The listing of its blocks (``list_blocks``) is the walk at open when there is no catalog to
start from, and the walk that reconciles a loaded catalog with the folder, which ``stat``s
only the files the catalog does not know. Plain functions that block; the ``FolderKeeper``
(``_keeper``) and the reconcile (``_reconcile``) call them in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import time
from pathlib import Path

from kvtier.common._errors import InvalidArgumentError
from kvtier.tiers.fs._geometry import ALIGN
from kvtier.tiers.fs._layout import (
    DIR_MODE,
    FILE_MODE,
    HOST_TAG,
    MARKER,
    O_CLOEXEC,
    O_DIRECT,
    O_NOFOLLOW,
    STALE_TMP_SECONDS,
    Entry,
    Kind,
    Known,
    Pruning,
    walk,
)
from kvtier.tiers.fs._marker import check_marker

__all__ = [
    "UnusableRootError",
    "direct_refused",
    "list_blocks",
    "make_root",
    "ready_root",
    "remove_if_stale",
]

logger = logging.getLogger("kvtier.tiers.fs")


class UnusableRootError(InvalidArgumentError, OSError):
    """An FS tier's root cannot be created or written when the tier opens: a configuration
    error, raised at open with the path and the reason (an ``OSError`` too, as vLLM's own fs
    tier raises). A root that goes away later (a mount lost) is a runtime fault instead: the
    tier's operations fail as ``unavailable`` and lookups miss."""

    def __init__(self, path: Path, exc: OSError) -> None:
        code = errno.errorcode.get(exc.errno or 0, "")
        reason = f"{code}: {exc.strerror}" if code and exc.strerror else str(exc)
        self.message = (
            f"cannot use {str(path)!r} as an FS tier's root: {reason}; give a folder "
            "that this process can create and write"
        )
        InvalidArgumentError.__init__(self, self.message)
        self.path = path
        self.reason = reason
        self.errno = exc.errno
        self.strerror = exc.strerror
        self.filename = str(path)

    def __str__(self) -> str:  # OSError's would show only the errno and the path
        return self.message


def ready_root(root: Path, marker: dict[str, object] | None = None) -> None:
    """Create the root and its missing parents (``make_root``), and check or write the
    format marker."""
    make_root(root)
    check_marker(root, MARKER if marker is None else marker)


def list_blocks(
    root: Path, known: Known | None = None, pruning: Pruning | None = None
) -> list[Entry]:
    """Every block file, oldest first, or with ``known`` those it does not have (``walk``:
    a known name's file is not ``stat``-ed, so one that another writer replaced with a file
    of another size is not told apart here; the load that reads it verifies every byte, and
    a wrong file is a miss). Temporary files whose writer is gone are removed, and so are
    shard folders left empty (told to ``pruning`` when given)."""
    entries: list[Entry] = []
    now = time.time()
    for item in walk(root, known, prune=Pruning() if pruning is None else pruning):
        if item.kind is Kind.BLOCK:
            entries.append(Entry(item.parts[-1], item.size, item.mtime))
        elif item.kind is Kind.TEMPORARY:
            remove_if_stale(item.folder, item.parts[-1], now)
    entries.sort(key=lambda e: e.mtime)
    return entries


def make_root(root: Path) -> None:
    """Create ``root`` and any missing parents, saying so in the log.

    A missing parent may be a file system that is not mounted yet: creating it writes on the
    disk beneath, as vLLM's own fs tier does. The tier goes ahead (a root that a config names
    should work) and says, with a warning, which folders it had to create, so a mount that
    came late is found in the log rather than as a full system disk."""
    try:
        os.mkdir(root, DIR_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        missing = [root]
        for parent in root.parents:
            if os.path.lexists(parent):
                break
            missing.append(parent)
        os.makedirs(root, DIR_MODE, exist_ok=True)
        logger.warning(
            "created the FS tier's root %s and its missing parent folder(s) %s: if a file "
            "system should be mounted at one of them, it was not when the tier opened",
            root,
            ", ".join(str(p) for p in reversed(missing[1:])),
        )
        return
    logger.info("created the FS tier's root %s", root)


def remove_if_stale(folder: int, name: str, now: float) -> None:
    """Remove a temporary file left by a writer that is gone: one on this host whose process
    is dead, or any older than ``STALE_TMP_SECONDS``."""
    parts = name.split("-")  # .tmp-<host>-<pid>-<random>-<name>
    stale = False
    if len(parts) >= 5 and parts[1] == HOST_TAG and parts[2].isdigit():
        pid = int(parts[2])
        stale = pid != os.getpid() and not _pid_alive(pid)
    if not stale:
        with contextlib.suppress(OSError):
            mtime = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mtime
            stale = now - mtime > STALE_TMP_SECONDS
    if stale:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def direct_refused(root: Path) -> str | None:
    """Why files under ``root`` do not take O_DIRECT writes of one aligned page (tmpfs before
    Linux 6.6, some FUSE and network file systems refuse them), or None when they do."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    probe = root / f".kvtier-fs-probe-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_NOFOLLOW
    try:
        fd = os.open(probe, flags | O_DIRECT, FILE_MODE)
    except OSError as exc:
        return f"opening with O_DIRECT failed: {exc.strerror or exc}"
    try:
        with mmap.mmap(-1, ALIGN) as page:
            os.write(fd, page)
        return None
    except OSError as exc:
        return f"an O_DIRECT write failed: {exc.strerror or exc}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
