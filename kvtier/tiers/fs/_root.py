"""Opening an FS tier's root: make it, clear what dead writers left, probe O_DIRECT.

Plain functions that block; ``_io.prepare_root`` and the ``FolderKeeper`` (``_keeper``) call
them in worker threads when a tier opens its root.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from pathlib import Path

from kvtier.common._format import PAYLOAD_ALIGN
from kvtier.tiers.fs._layout import (
    DIR_MODE,
    FILE_MODE,
    HOST_TAG,
    O_CLOEXEC,
    O_NOFOLLOW,
    STALE_TMP_SECONDS,
)

__all__ = ["O_DIRECT", "direct_refused", "make_root", "remove_if_stale"]

logger = logging.getLogger("kvtier.tiers.fs")

O_DIRECT = getattr(os, "O_DIRECT", 0)


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
        with mmap.mmap(-1, PAYLOAD_ALIGN) as page:
            os.write(fd, page)
        return None
    except OSError as exc:
        return f"an O_DIRECT write failed: {exc.strerror or exc}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
