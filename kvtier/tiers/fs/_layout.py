"""The FS tier's folder layout: names, shard folders, the format marker, and the one walk.

``<root>/<2 hex>/<2 hex>/<name>`` plus ``<root>/kvtier-fs.json`` (and, for a tier given a cache
identity, ``<root>/.kvtier-fs-identity.json``: ``kvtier.common._identity``): a block's file name is
its key in hex (or ``h`` + a hash of a key too long for one name), and its two shard folders are
the name's *last* four hex digits (keys start with a version byte, so the first digits would
put every block in one folder). Folders are 0700 and files 0600. A file being written is
``.tmp-<host>-<pid>-<random>-<name>`` beside its final place.

This module is the one place that knows that layout. ``FSTier`` (through ``_write`` and
``_read``) and the ``kvtier`` command line both reach the folder through here, with one
posture: below the root, folders and files are opened one level at a time from a directory
descriptor with ``O_NOFOLLOW`` (a block file for reading in one ``openat2`` call that the
kernel keeps beneath the root and off every link, ``open_block``), so a shard folder, block
file or marker that is a symbolic link (planted by whoever can write to a shared folder) is
never followed: not for a read, a write, a removal or a walk, even when it is swapped in while
a walk runs. (The batched existence checks ``stat`` a block's ``path_of`` instead, one call per
key: a link there can only make a key look present, and the load that follows refuses the
link.) The root itself may be a link: naming it is the operator's choice. Plain functions;
they block, so the tier calls them in worker threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import hashlib
import itertools
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.common._format import ALIGNED_FORMAT_VERSION, FORMAT_VERSION
from kvtier.tiers.fs._beneath import RESOLVE_NO_LINKS, UNSUPPORTED, Openat2

__all__ = [
    "BLOCK_FORMATS",
    "DIR_MODE",
    "FILE_MODE",
    "HOST_TAG",
    "IDENTITY_NAME",
    "LAYOUT_VERSION",
    "MARKER",
    "MARKER_NAME",
    "OWN_PREFIX",
    "O_CLOEXEC",
    "O_DIRECT",
    "O_NOFOLLOW",
    "READ_FLAGS",
    "SHARD_FOLDERS",
    "STALE_TMP_SECONDS",
    "TMP_PREFIX",
    "Entry",
    "IncompatibleRoot",
    "Item",
    "Kind",
    "Pruning",
    "ShardFolders",
    "fsync_folder",
    "is_block_name",
    "is_shard_name",
    "key_of",
    "name_of",
    "open_block",
    "open_folder",
    "open_maybe_direct",
    "open_shard",
    "path_of",
    "remove_if_same",
    "remove_made",
    "shard_path",
    "tmp_name",
    "walk",
]

LAYOUT_VERSION = 1
MARKER_NAME = "kvtier-fs.json"
MARKER = {"format": "kvtier-fs", "layout": LAYOUT_VERSION, "block_format": ALIGNED_FORMAT_VERSION}
# Block formats a folder may hold: a folder marked with the older one is read as it is and its
# marker moved to the newer one at open (so an older kvtier, which cannot read the new blocks,
# refuses the folder instead of removing them as corrupt).
BLOCK_FORMATS = (FORMAT_VERSION, ALIGNED_FORMAT_VERSION)
# A temporary file from another host (or from before a reboot) whose writer we cannot ask about
# is removed once it is this old: no store takes anywhere near an hour.
STALE_TMP_SECONDS = 3600.0
TMP_PREFIX = ".tmp-"
OWN_PREFIX = ".kvtier-fs"  # the marker's temporary file, the lock and the O_DIRECT probe
IDENTITY_NAME = (
    f"{OWN_PREFIX}-identity.json"  # the cache identity manifest (kvtier.common._identity)
)
_SHARD = re.compile(r"[0-9a-f]{2}")
SHARD_FOLDERS = 256 * 256
"""Second-level shard folders a root can hold (two levels of two hex digits)."""
_NAME = re.compile(r"[0-9a-f]{2,200}|h[0-9a-f]{64}")
_MAX_HEX_KEY = 100  # longer keys are named by a hash so a file name stays under NAME_MAX
DIR_MODE = 0o700
FILE_MODE = 0o600
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC
_DIR_FLAGS = _ROOT_FLAGS | O_NOFOLLOW
# How a block file (or the marker) is opened for reading: never through a link.
READ_FLAGS = os.O_RDONLY | O_CLOEXEC | O_NOFOLLOW
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none
# Off for the process once the kernel refuses it: then every open walks one level at a time.
_OPENAT2 = Openat2()


def _host_tag() -> str:
    """Names this host and boot, so a new process can tell a dead local writer's temporary
    file (pid gone) from one that another machine on a shared filesystem is still writing."""
    boot = b""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()
    return hashlib.blake2b(socket.gethostname().encode() + b"/" + boot, digest_size=4).hexdigest()


HOST_TAG = _host_tag()


class IncompatibleRoot(Exception):
    """The root was written by another format, or is not a kvtier folder; never touched."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A block file found when a root is opened."""

    name: str
    size: int
    mtime: float


# -- names -------------------------------------------------------------------------------------


def name_of(key: bytes) -> str:
    """File name of ``key``: its hex (only ``[0-9a-f]``, so it can never name a path outside the
    root), or ``h`` + a hash of it for keys too long for one file name."""
    if len(key) <= _MAX_HEX_KEY:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def key_of(name: str) -> bytes | None:
    """The key a file name stands for, when the name says it (hashed names do not)."""
    return None if name.startswith("h") else bytes.fromhex(name)


def is_block_name(name: str) -> bool:
    """Whether ``name`` is one that ``name_of`` gives."""
    return _NAME.fullmatch(name) is not None


def tmp_name(name: str) -> str:
    """A unique temporary name for a block file being written: it says which host and process
    writes it, so opening a root can tell when its writer is gone, and is unique within the
    process by a counter (no system call per block: the pid is kept, and renewed in a forked
    child; the file is created exclusively anyway)."""
    return f"{TMP_PREFIX}{HOST_TAG}-{_pid}-{next(_tmp_numbers):08x}-{name}"


_pid = os.getpid()
_tmp_numbers = itertools.count(int.from_bytes(secrets.token_bytes(4)) & 0x7FFFFFFF)


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def _shard_of(name: str) -> tuple[str, str]:
    if not is_block_name(name):  # belt and braces: names come from name_of only
        raise AssertionError(f"refusing unsafe block file name {name!r}")
    last = name.rjust(4, "0")[-4:]
    return last[0:2], last[2:4]


def shard_path(name: str) -> str:
    """Where the block file ``name`` lives below the root: ``ab/cd/name``."""
    first, second = _shard_of(name)
    return f"{first}/{second}/{name}"


def path_of(root: Path, name: str) -> Path:
    """Where the block file ``name`` lives (for reports and existence checks; the operations
    that read, write or delete reach it through ``open_shard`` instead)."""
    first, second = _shard_of(name)
    return root / first / second / name


# -- descriptors -------------------------------------------------------------------------------


def open_shard(
    root: Path,
    name: str,
    *,
    create: bool = False,
    made: list[int] | None = None,
    root_fd: int | None = None,
) -> int:
    """A descriptor of ``name``'s shard folder, reached from ``root`` (or the descriptor
    ``root_fd`` of it, which stays open) without following a link: one ``openat2`` call
    where the kernel has it, else one level at a time. A link there raises ``OSError``
    (ELOOP); a missing level ``FileNotFoundError`` unless ``create``; the depth (0, 1) of
    each level made is appended to ``made`` (even when a later step fails), for
    ``remove_made``. The caller closes the descriptor."""
    if root_fd is not None and _OPENAT2.on:
        first, second = _shard_of(name)
        fd = _OPENAT2.open(root_fd, f"{first}/{second}".encode(), _DIR_FLAGS, RESOLVE_NO_LINKS)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.ENOTDIR:
            raise OSError(errno.ELOOP, f"a shard of {name} is not a folder")
        if err == errno.ENOENT and not create:
            raise FileNotFoundError(err, os.strerror(err), name)
        if err in UNSUPPORTED:
            _OPENAT2.off()
        elif err != errno.ENOENT:
            raise OSError(err, os.strerror(err), name)
        # else missing, to be made: the walk below makes what is missing
    fd = os.open(root, _ROOT_FLAGS) if root_fd is None else root_fd
    try:
        for depth, level in enumerate(_shard_of(name)):
            try:
                try:
                    inner = os.open(level, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    # mkdir only where the level is missing: on a populated root an
                    # existing level costs no failing syscall and no exception.
                    try:
                        os.mkdir(level, DIR_MODE, dir_fd=fd)
                    except FileExistsError:
                        pass
                    else:
                        if made is not None:
                            made.append(depth)
                    inner = os.open(level, _DIR_FLAGS, dir_fd=fd)
            except NotADirectoryError as exc:
                raise OSError(errno.ELOOP, f"shard {level} is not a folder") from exc
            if fd != root_fd:
                os.close(fd)
            fd = inner
    except BaseException:
        if fd != root_fd:
            os.close(fd)
        raise
    return fd


def remove_made(root: Path, name: str, made: list[int]) -> None:
    """Remove the shard folders of ``name`` that a failed store made (``open_shard``'s
    ``made``), innermost first, if they are still empty: only ``rmdir``, which leaves a
    folder that another writer has put a file in meanwhile, and never through a link."""
    if not made:
        return
    first, second = _shard_of(name)
    with contextlib.suppress(OSError):
        root_fd = os.open(root, _ROOT_FLAGS)
        try:
            if 1 in made and (first_fd := open_folder(first, root_fd)) is not None:
                try:
                    os.rmdir(second, dir_fd=first_fd)
                finally:
                    os.close(first_fd)
            if 0 in made:
                os.rmdir(first, dir_fd=root_fd)
        finally:
            os.close(root_fd)


def open_block(root: Path, name: str, flags: int, *, root_fd: int | None = None) -> int:
    """A descriptor of the block file ``name`` opened with ``flags`` (the caller closes it),
    reached from ``root`` (or the descriptor ``root_fd`` of it, which stays open) as
    ``open_shard`` reaches its folder: beneath the root, through no link. One ``openat2``
    call where the kernel has it, else the walk. ``FileNotFoundError`` when the file or its
    shard is missing, ``OSError`` (ELOOP) for a link or a file where a shard folder should
    be, and (EINVAL) when the file system refuses ``O_DIRECT``."""
    if _OPENAT2.on:
        dir_fd = os.open(root, _ROOT_FLAGS) if root_fd is None else root_fd
        try:
            fd = _OPENAT2.open(dir_fd, os.fsencode(shard_path(name)), flags, RESOLVE_NO_LINKS)
        finally:
            if dir_fd != root_fd:
                os.close(dir_fd)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.ENOTDIR:
            raise OSError(errno.ELOOP, f"a shard of {name} is not a folder")
        if err == errno.ENOENT:
            raise FileNotFoundError(err, os.strerror(err), name)
        if err not in UNSUPPORTED or (err == errno.EINVAL and flags & O_DIRECT):
            raise OSError(err, os.strerror(err), name)
        _OPENAT2.off()  # this kernel (or a filter in front of it) never takes it
    dir_fd = open_shard(root, name, root_fd=root_fd)
    try:
        return os.open(name, flags, FILE_MODE, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def open_maybe_direct(opener: Callable[[int], int], flags: int, direct: bool) -> tuple[int, bool]:
    """``opener(flags)`` with O_DIRECT when asked and the file system takes it (EINVAL: it
    does not); the descriptor and whether it has O_DIRECT."""
    if direct and O_DIRECT:
        try:
            return opener(flags | O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return opener(flags), False


def open_folder(name: str, dir_fd: int) -> int | None:
    """A descriptor of the folder ``name`` in ``dir_fd``, or None if it is gone or is not a
    real folder (a link is never followed)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


class ShardFolders:
    """Descriptors of shard folders for a pass over many blocks, opened level by level from
    the root's descriptor without following links; the last one is kept open, so blocks
    taken shard by shard (as ``walk`` gives them) open each folder once."""

    def __init__(self, root: Path) -> None:
        self._root_fd = os.open(root, _ROOT_FLAGS)
        self._shard: tuple[str, str] | None = None
        self._fd: int | None = None

    def fd(self, shard: tuple[str, str]) -> int | None:
        """The descriptor of ``shard``, or None when it is gone or is a link."""
        if shard != self._shard:
            self._close_shard()
            self._shard = shard
            first = open_folder(shard[0], self._root_fd)
            if first is not None:
                try:
                    self._fd = open_folder(shard[1], first)
                finally:
                    os.close(first)
        return self._fd

    def _close_shard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def close(self) -> None:
        self._close_shard()
        os.close(self._root_fd)


def remove_if_same(dir_fd: int, name: str, fd: int) -> bool:
    """Unlink ``name`` only if it is still the file open as ``fd``, so a good block another
    process published there in the meantime survives. False when it was not (or was gone)."""
    mine = os.fstat(fd)
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            return False
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the walk ----------------------------------------------------------------------------------


class Kind(enum.Enum):
    SHARD = "shard"  # a second-level shard folder, about to be walked
    BLOCK = "block"  # a regular file named as ``name_of`` names blocks
    TEMPORARY = "temporary"  # a block file being written, or left by a writer that died
    FOREIGN = "foreign"  # anything else: not kvtier's, never followed, read or removed


@dataclass(frozen=True, slots=True)
class Item:
    """One thing the walk found. ``parts``: its path below the root, one part per level.
    ``folder``: a descriptor of the folder that holds it, valid until the walk moves on.
    ``size``, ``mtime``: a ``BLOCK``'s, from its ``stat`` (0 for every other kind)."""

    kind: Kind
    parts: tuple[str, ...]
    folder: int
    size: int = 0
    mtime: float = 0.0


Known = Callable[[Sequence[str]], list[bool]]
"""Asked the names of one shard folder's regular files, says which the caller already has."""


@dataclass(slots=True)
class Pruning:
    """What a walk with ``prune`` removed: empty shard folders, and the CPU time the removals
    took (the stores that made the folders owed it; the walk's own cost is the rest, a
    folder that was not empty included). ``first``: try to remove each shard folder before
    opening it, one call where opening and listing an empty one cost several; worth it
    where most are empty (a tier holding far fewer blocks than there are shard folders),
    while in a full folder each try is a call that fails. Otherwise a folder is removed
    when its listing was empty."""

    first: bool = False
    folders: int = 0
    cpu_seconds: float = 0.0

    def remove_if_empty(self, name: str, dir_fd: int) -> bool:
        """Remove the folder ``name`` if it is empty (``rmdir`` removes nothing else, and
        never follows a link); whether it was removed."""
        started = time.thread_time()
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except OSError:
            return False
        self.cpu_seconds += time.thread_time() - started
        self.folders += 1
        return True


def walk(
    root: Path, known: Known | None = None, *, prune: Pruning | None = None
) -> Generator[Item, None, None]:
    """Everything under ``root`` by the layout, in name order, through descriptors opened
    without following links (a link anywhere below the root is ``FOREIGN``). The marker and
    kvtier's own dot files at the root are not reported.

    With ``prune``, shard folders found empty are removed (a first-level one once nothing is
    left in it): a small tier under churn leaves behind a folder for nearly every shard a
    block ever passed through, and each walk would otherwise visit them all for good.
    ``rmdir`` removes only an empty folder, so one a store has just put a file in stays; a
    store whose folder went between its open and its write makes it again (``_write``).

    With ``known``, each shard folder's regular files (told by the type its entries give,
    with no ``stat``) are asked of it at once, and those it has are not reported: on a cold
    page cache the ``stat`` of every file is much of what a walk of many blocks costs. Only
    where the file system gives no type is a file ``stat``-ed to tell (``os.DirEntry``
    does it). A name ``known`` has that is not a regular file (a folder, a link) is never
    asked, so it is reported as any other would be."""
    root_fd = os.open(root, _ROOT_FLAGS)
    try:
        for first, is_dir in _entries(root_fd):
            first_fd = open_folder(first, root_fd) if is_dir and is_shard_name(first) else None
            if first_fd is None:
                if first != MARKER_NAME and not first.startswith(OWN_PREFIX):
                    yield Item(Kind.FOREIGN, (first,), root_fd)
                continue
            try:
                emptied = yield from _walk_first(first, first_fd, known, prune)
            finally:
                os.close(first_fd)
            if emptied and prune is not None:
                prune.remove_if_empty(first, root_fd)
    finally:
        os.close(root_fd)


def _walk_first(
    first: str, first_fd: int, known: Known | None, prune: Pruning | None
) -> Generator[Item, None, bool]:
    """The items below one first-level shard folder; returns whether ``prune`` left it
    holding nothing."""
    left = 0
    for second, second_is_dir in _entries(first_fd):
        ok = second_is_dir and is_shard_name(second)
        if ok and prune is not None and prune.first and prune.remove_if_empty(second, first_fd):
            continue
        second_fd = open_folder(second, first_fd) if ok else None
        if second_fd is None:
            left += 1
            yield Item(Kind.FOREIGN, (first, second), first_fd)
            continue
        try:
            yield Item(Kind.SHARD, (first, second), first_fd)
            empty = yield from _walk_shard((first, second), second_fd, known)
        finally:
            os.close(second_fd)
        if not (empty and prune is not None and prune.remove_if_empty(second, first_fd)):
            left += 1
    return left == 0


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is one a shard folder has (two hex digits)."""
    return _SHARD.fullmatch(name) is not None


def _entries(dir_fd: int) -> list[tuple[str, bool]]:
    """``(name, is a real folder)`` for each entry, links never followed, sorted."""
    with os.scandir(dir_fd) as it:
        return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)


def _walk_shard(
    shard: tuple[str, str], fd: int, known: Known | None
) -> Generator[Item, None, bool]:
    """The shard's items; returns whether the folder held nothing at all."""
    with os.scandir(fd) as listing:
        entries = list(listing)
    if not entries:
        return True
    if known is not None:
        # The entry's type, or an lstat where the file system gives none (then a file
        # removed meanwhile is not a file either); a link is never followed.
        files = [
            entry.name
            for entry in entries
            if not entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False)
        ]
        held = {name for name, is_held in zip(files, known(files), strict=True) if is_held}
        entries = [entry for entry in entries if entry.name not in held]
    for entry in entries:
        parts = (*shard, entry.name)
        if entry.name.startswith(TMP_PREFIX):
            yield Item(Kind.TEMPORARY, parts, fd)
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we looked
        if is_block_name(entry.name) and stat.S_ISREG(st.st_mode):
            yield Item(Kind.BLOCK, parts, fd, st.st_size, st.st_mtime)
        else:
            yield Item(Kind.FOREIGN, parts, fd)
    return False
