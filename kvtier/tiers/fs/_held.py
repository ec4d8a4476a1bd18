"""A descriptor of an FS tier's root, held while the tier runs: ``HeldRoot``.

Every block operation reaches its file from the root without following a link (``_layout``).
Opening the root by its path for each one costs an open and a close per block (and a walk
of the path's folders); with the root held, a load is ``openat2`` from the held descriptor,
the read and a close. But a held descriptor keeps naming the folder it was opened on: a root
that someone removed and made again, or replaced by a rename, would go on being read and
written through the old one. So the path is looked at again, and the descriptor replaced when
the path names another folder than the one held (another device or inode):

- at most every ``RECHECK_SECONDS`` on the way to any operation (one ``stat``, and a clock
  read per operation in between), which bounds how long a swapped folder is served;
- at once after a failure that a swapped folder explains (``moved``: a block or a shard
  folder not found, a folder removed under a store), so the operation can run again on the
  new folder.

A replaced descriptor is never closed while the tier runs: a worker thread may be using it
(reads of the attribute take no lock), and a closed number may be reused for another file.
The replaced ones (one per swap) are let go with the held one at the tier's close
(``shut``): the tier closes them once no thread abandoned at its deadline may still use
them, with any descriptor such a thread opened again after the close (``detach_if_shut``;
nothing else can: the tier is closed until ``reopened``). Thread-safe.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["RECHECK_SECONDS", "HeldRoot", "close_all"]

# How long a root swapped under the tier may still be read and written through the folder it
# replaced (or removed). A ``stat`` this often costs nothing beside the blocks moved meanwhile.
RECHECK_SECONDS = 0.25

# How the root is opened: a folder, whatever links lead to it (the configured path may be
# one), close-on-exec.
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def close_all(fds: list[int]) -> None:
    """Close descriptors ``HeldRoot.detach`` let go of."""
    for fd in fds:
        os.close(fd)


class HeldRoot:
    """The descriptor of ``path`` that the tier's operations start from (see the module)."""

    __slots__ = (
        "_checked",
        "_clock",
        "_fd",
        "_id",
        "_lock",
        "_recheck",
        "_retired",
        "_shut",
        "path",
    )

    def __init__(
        self,
        path: Path,
        *,
        recheck_seconds: float = RECHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._recheck = recheck_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._fd = -1
        self._id: tuple[int, int] = (0, 0)  # device and inode of the folder held
        self._checked = -math.inf
        self._retired: list[int] = []
        self._shut = False  # the tier closed: what opens now is for its closer to close

    def fd(self) -> int:
        """The descriptor (opened on first use), checked against the path when the last
        check is ``RECHECK_SECONDS`` old. Raises ``OSError`` (``FileNotFoundError``: the root
        is gone) when the path cannot be opened."""
        fd = self._fd
        if fd >= 0 and self._clock() - self._checked < self._recheck:
            return fd
        with self._lock:
            self._refresh()
            return self._fd

    def fresh(self) -> int:
        """The descriptor when it was checked within ``RECHECK_SECONDS``, else -1: for a
        caller that must not wait on the file system (the event loop)."""
        fd = self._fd
        if fd >= 0 and self._clock() - self._checked < self._recheck:
            return fd
        return -1

    def moved(self, used: int) -> bool:
        """After an operation that started from ``used`` failed: check the path now; whether
        the descriptor held is another than ``used`` (the path names another folder, found
        now or by another thread since: run the operation again from ``fd()``)."""
        with self._lock:
            try:
                self._refresh()
            except OSError:
                return False  # the root is gone or unreachable: the failure stands
            return self._fd != used

    def detach(self) -> list[int]:
        """Let go of every descriptor (the held one and those it replaced) and return them
        for the caller to close once no thread can use them; the next ``fd`` opens the root
        again."""
        with self._lock:
            return self._let_go()

    def shut(self) -> list[int]:
        """``detach`` at the tier's close: a descriptor a thread still running opens after
        this is left for ``detach_if_shut``."""
        with self._lock:
            self._shut = True
            return self._let_go()

    def detach_if_shut(self) -> list[int]:
        """Once no thread can use one: the descriptors opened since ``shut``, if the tier
        was not ``reopened`` meanwhile (then they are its own)."""
        with self._lock:
            return self._let_go() if self._shut else []

    def reopened(self) -> None:
        """The tier opens again: the descriptors held from now on are its own."""
        with self._lock:
            self._shut = False

    def close(self) -> None:
        """Close every descriptor now (no thread may be using one)."""
        close_all(self.detach())

    def _let_go(self) -> list[int]:
        """Under the lock: every descriptor, held and replaced, taken out."""
        fds = [*self._retired, self._fd] if self._fd >= 0 else self._retired
        self._fd, self._retired, self._checked = -1, [], -math.inf
        return fds

    def _refresh(self) -> None:
        """Under the lock: stat the path; open it again when it names another folder."""
        now = self._clock()
        st = os.stat(self.path)
        if self._fd >= 0 and (st.st_dev, st.st_ino) == self._id:
            self._checked = now
            return
        fd = os.open(self.path, _ROOT_FLAGS)
        opened = os.fstat(fd)  # what was opened, whatever the path named a moment before
        if self._fd >= 0:
            self._retired.append(self._fd)
        self._fd, self._id, self._checked = fd, (opened.st_dev, opened.st_ino), now

    def __repr__(self) -> str:
        return f"HeldRoot({str(self.path)!r}, fd={self._fd}, replaced={len(self._retired)})"
