"""Who uses an FS tier's folder, and whether one of them may answer lookups from its index.

Every process that uses a folder holds a *read* lock on the first byte of the folder itself
and of the lock file in it (``fcntl`` open file description locks, which the kernel drops
when the process ends, kill -9 included). Read locks never stand in each other's way, so
every user takes them and every user sees the others: asked whether a write lock could be
placed (``F_OFD_GETLK``), the kernel names a lock that another open file holds.

A process *owns* the folder, as its only writer whose index is the truth (``_index``), while
it sees nobody else there: at open, and at every check after (``FSTier`` checks its folder
periodically and whenever a store has to make a shard folder). Two openers cannot both
conclude that they are alone: each takes its lock before it looks. An owner that finds
another user stops owning for the rest of its open (its index does not hold what the other
writes) and checks the disk for keys it does not know, as every shared writer does.

Why two locks: the folder cannot be deleted and re-created under a running tier unseen (its
inode is checked against the path), and ``rm -rf cache/*`` removes the lock file but not the
folder, so a process whose lock file was deleted is still seen by the next opener. Where
folders take no lock (NFS maps locks to byte-range locks on open files, and a folder is not
opened for that), the lock file carries it alone: a check finds the file removed or replaced
(the path no longer names the inode it locked), and locks the new one, so whichever process
took the folder meanwhile sees this one at its next check, and neither owns it any more.
NFS v4 honours the file's lock across hosts. Where nothing can be locked, nobody can prove
to be alone: openers check the disk, unless the configuration vouches for an exclusive
folder (``shared=False``).

What each setting of ``shared`` does:

- ``"auto"`` (the default): the owner while no other process uses the folder; else one of
  its writers.
- ``False``: the owner, or an error at open naming the folder when another process uses it.
  A process that joins later is seen all the same, and the owner then checks the disk.
- ``True``: always one of its writers (seen by the others, so nobody owns it meanwhile).

A kvtier from before these locks holds the lock file with ``flock``, which these locks do
not see on a local file system: run one version per folder.

Synchronous and thread-safe for one caller at a time; ``FSTier`` calls it in worker threads
through its ``FolderKeeper`` (``_keeper``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvtier.tiers.fs._layout import FILE_MODE, O_CLOEXEC, O_NOFOLLOW

__all__ = ["LOCK_NAME", "Claim", "FolderBusy", "Sharing", "claim", "in_use"]

Sharing = bool | Literal["auto"]
LOCK_NAME = ".kvtier-fs.lock"  # the layout's own prefix: not a block, not a foreign file

# ``struct flock`` on 64-bit Linux: type, whence, start, length, pid (0 for these locks).
_FLOCK = struct.Struct("hhqqi4x")
_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
_GETLK = getattr(fcntl, "F_OFD_GETLK", None)
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC
_FILE_FLAGS = os.O_RDWR | os.O_CREAT | O_CLOEXEC | O_NOFOLLOW
_PEEK_FLAGS = os.O_RDONLY | O_CLOEXEC | O_NOFOLLOW  # asking about a lock file, never making it
# Another open file holds a write lock there: a process that locks the file exclusively.
_HELD = frozenset({errno.EAGAIN, errno.EACCES})
# How often a lock is taken again when its path turned out to name another inode meanwhile.
_TRIES = 3


class FolderBusy(Exception):
    """``shared=False`` and another process uses the folder."""


class _Held(Exception):
    """Another process holds the lock exclusively (a write lock)."""


@dataclass(slots=True)
class _Lock:
    """One read lock: the open file that holds it, the inode it is on and the path that
    named that inode when it was taken."""

    fd: int
    inode: tuple[int, int]
    path: Path
    folder: bool

    def others(self) -> bool:
        """Whether another open file (another user) holds a lock here."""
        return _locked(self.fd)

    def moved(self) -> bool:
        """Whether the path no longer names the locked inode (removed, or replaced)."""
        try:
            st = os.stat(self.path, follow_symlinks=self.folder)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.inode


@dataclass(slots=True)
class Claim:
    """What this process may assume about the folder until it lets go: whether it owns it
    (and why, for the log) and the locks that make it seen."""

    owner: bool
    why: str
    locks: list[_Lock] = field(default_factory=list)
    # One check or release at a time; a released claim is never checked (or locked) again.
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: bool = False

    def check(self) -> tuple[list[str], str | None]:
        """Lock again what was removed or replaced, then look for other users: the names
        locked again, and why this process stopped owning the folder (None when it did
        not). Raises ``OSError`` when a lock cannot be taken again."""
        with self._mutex:
            if self._released:
                return [], None
            return self._check()

    def _check(self) -> tuple[list[str], str | None]:
        renewed: list[str] = []
        for i, lock in enumerate(self.locks):
            if not lock.moved():
                continue
            if lock.folder and not os.path.isdir(lock.path):
                continue  # the root itself is gone: nothing to lock until it is back
            try:
                self.locks[i] = _take(lock.path, folder=lock.folder)
            except _Held:  # keep the lock we hold; another process holds the new one
                if self.owner:
                    self.owner, self.why = False, "another process holds its lock"
                    return renewed, self.why
                continue
            os.close(lock.fd)
            renewed.append(lock.path.name)
        if self.owner and any(lock.others() for lock in self.locks):
            self.owner, self.why = False, "another process uses it now"
            return renewed, self.why
        return renewed, None

    def others(self) -> bool:
        """Whether another process uses the folder now (holds a lock beside this one's)."""
        with self._mutex:
            return not self._released and any(lock.others() for lock in self.locks)

    def release(self) -> None:
        """Let go of the locks (closing the files drops them)."""
        with self._mutex:
            self._released = True
            locks, self.locks = self.locks, []
            for lock in locks:
                os.close(lock.fd)


def claim(root: Path, shared: Sharing) -> Claim:
    """Take ``root``'s locks and decide as ``shared`` asks; raise ``FolderBusy``
    (``shared=False`` only) when another process uses the folder."""
    locks: list[_Lock] = []
    refused: list[str] = []
    try:
        for what, take in (("the folder", _lock_folder), ("its lock file", _lock_file)):
            try:
                locks.append(take(root))
            except _Held:
                return _busy(root, shared, locks, "another process holds its lock")
            except OSError as exc:
                refused.append(f"{what}: {exc.strerror or exc}")
    except BaseException:
        Claim(False, "", locks).release()
        raise
    if not locks:
        return _unlocked(shared, f"it takes no lock ({'; '.join(refused)})")
    held = Claim(False, "shared with other processes (shared=True)", locks)
    if shared is True:
        return held
    if any(lock.others() for lock in locks):
        return _busy(root, shared, locks, "shared with other processes")
    held.owner, held.why = True, "the only process using it"
    return held


def in_use(root: Path, held: Claim | None = None) -> bool:
    """Whether another process uses ``root``: holds a lock on the folder or on its lock file.
    Asked without taking a lock or making the lock file, so a folder that turns out not to
    be kvtier's is left as it was; through ``held``'s locks when this process holds a claim
    (its own locks are not another user's)."""
    if held is not None:
        return held.others()
    if _GETLK is None:
        return False
    for path, flags in ((root, _FOLDER_FLAGS), (root / LOCK_NAME, _PEEK_FLAGS)):
        try:
            fd = os.open(path, flags)
        except OSError:  # no lock file: nobody locks it
            continue
        try:
            if _locked(fd):
                return True
        except OSError:  # takes no lock (a folder on NFS): nobody holds one
            continue
        finally:
            os.close(fd)
    return False


def _locked(fd: int) -> bool:
    """Whether an open file other than ``fd`` holds a lock on the first byte of its file."""
    assert _GETLK is not None
    asked = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    found = fcntl.fcntl(fd, _GETLK, asked)
    return bool(_FLOCK.unpack(found)[0] != fcntl.F_UNLCK)


def _busy(root: Path, shared: Sharing, locks: list[_Lock], why: str) -> Claim:
    """Another process uses the folder: one writer of several, or refused."""
    held = Claim(False, why, locks)
    if shared is False:
        held.release()
        raise FolderBusy(
            f"{root} is in use by another process (it holds the folder's lock), and "
            "shared=False needs the folder to itself: stop the other process, or set "
            'shared="auto" (join as one of several writers)'
        )
    return held


def _lock_folder(root: Path) -> _Lock:
    """A read lock on the folder itself (``OSError`` where folders take none: NFS)."""
    return _take(root, folder=True)


def _lock_file(root: Path) -> _Lock:
    """A read lock on the folder's lock file, made if it is missing."""
    return _take(root / LOCK_NAME, folder=False)


def _take(path: Path, *, folder: bool) -> _Lock:
    """Open ``path`` and take a read lock on its first byte; raises ``_Held`` when another
    process holds a write lock there, ``OSError`` when it cannot be locked. A file replaced
    while it was being locked is locked again, so the lock is on what the path names."""
    if _SETLK is None:
        raise OSError(errno.ENOSYS, "this platform has no open file description locks")
    for _ in range(_TRIES):
        fd = os.open(path, _FOLDER_FLAGS if folder else _FILE_FLAGS, FILE_MODE)
        try:
            try:
                fcntl.fcntl(fd, _SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 1, 0))
            except OSError as exc:
                if exc.errno in _HELD:
                    raise _Held from exc
                raise
            st = os.fstat(fd)
            lock = _Lock(fd, (st.st_dev, st.st_ino), path, folder)
            if not lock.moved():
                return lock
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.ESTALE, f"{path} kept being replaced while it was locked")


def _unlocked(shared: Sharing, why: str) -> Claim:
    """No lock to be had: only the configuration can vouch for an exclusive folder."""
    if shared is False:
        return Claim(True, f"shared=False, unchecked: {why}")
    return Claim(False, why)
