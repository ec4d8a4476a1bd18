"""Who writes an FS tier's folder: a lock that lets a lone writer answer lookups from its index.

A process that holds the folder's lock exclusively is the folder's only writer, so its index is
the truth and ``lookup()`` never touches the disk (``_index``). Processes that share a folder
hold the lock shared and check the disk for keys they do not know (``AsyncLookupManager``).

The lock is ``flock(2)`` on a file in the folder. The kernel drops it when the process ends,
kill -9 included, so a dead owner never keeps the folder from the next one; NFS v4 honours it
across hosts (Linux maps ``flock`` to NFS byte-range locks). Where a file system has no locks,
nobody can prove to be alone: openers check the disk, unless the configuration vouches for an
exclusive folder (``shared=False``).

What each setting of ``shared`` does when the folder is busy:

- ``"auto"`` (the default): the owner when the lock is free; else a shared writer (an owner
  elsewhere then does not see this process's blocks: lost hits, never wrong bytes).
- ``False``: the owner, or an error at open naming the folder when another process holds it.
- ``True``: always a shared writer, so a later ``"auto"`` opener does not take the folder.

Synchronous; ``FSTier`` runs it in a worker thread at open.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtier.tiers.fs._layout import FILE_MODE, O_CLOEXEC, O_NOFOLLOW

__all__ = ["LOCK_NAME", "Claim", "FolderBusy", "Sharing", "claim"]

Sharing = bool | Literal["auto"]
LOCK_NAME = ".kvtier-fs.lock"  # the layout's own prefix: not a block, not a foreign file


class FolderBusy(Exception):
    """``shared=False`` and another process holds the folder."""


@dataclass(slots=True)
class Claim:
    """What this process may assume about the folder until it lets go."""

    owner: bool
    why: str
    fd: int | None = None

    def release(self) -> None:
        """Let go of the lock (closing the file drops it)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def claim(root: Path, shared: Sharing) -> Claim:
    """Take ``root``'s lock as ``shared`` asks; raise ``FolderBusy`` (``shared=False`` only)."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | O_CLOEXEC | O_NOFOLLOW, FILE_MODE)
    except OSError as exc:
        return _unlocked(shared, f"cannot open its lock file ({exc.strerror or exc})")
    try:
        held = _lock(fd, shared)
    except OSError as exc:
        os.close(fd)
        return _unlocked(shared, f"its file system refused a lock ({exc.strerror or exc})")
    except BaseException:
        os.close(fd)
        raise
    if held is None:
        os.close(fd)
        if shared is False:
            raise FolderBusy(
                f"{root} is in use by another process (it holds the folder's lock), and "
                "shared=False needs the folder to itself: stop the other process, or set "
                'shared="auto" (join as one of several writers)'
            )
        return Claim(False, "another process owns it")
    if held == fcntl.LOCK_EX:
        return Claim(True, "the only process using it", fd)
    return Claim(False, "shared with other processes", fd)


def _lock(fd: int, shared: Sharing) -> int | None:
    """The lock taken (``LOCK_EX`` or ``LOCK_SH``), or None when another process's stands in
    the way (an exclusive one, or any for ``shared=False``)."""
    if shared is not True and _try(fd, fcntl.LOCK_EX):
        return fcntl.LOCK_EX
    if shared is not False and _try(fd, fcntl.LOCK_SH):
        return fcntl.LOCK_SH
    return None


def _try(fd: int, how: int) -> bool:
    """Take the lock without waiting; False when another process holds it."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _unlocked(shared: Sharing, why: str) -> Claim:
    """No lock to be had: only the configuration can vouch for an exclusive folder."""
    if shared is False:
        return Claim(True, f"shared=False, unchecked: {why}")
    return Claim(False, why)
