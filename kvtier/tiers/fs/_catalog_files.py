"""The FS catalog's files in the root: read one back at open, write checkpoints and the log.

Plain functions and one small class that block; the tier calls them in worker threads. The
bytes are ``_catalog_format``'s; this module adds the file rules:

- both files live at the root under ``_layout.OWN_PREFIX`` (which the walk ignores), and are
  reached from a descriptor of the root without following a link;
- a checkpoint is written aside, made durable (``fsync`` unless the tier's policy is
  ``never``), renamed into place and the root synced, so it is whole or absent; a new log is
  made the same way, after its checkpoint, so a log never names a checkpoint that is not in
  place yet (the reader ignores a log of another generation: the one a kill -9 between the two
  renames leaves);
- a read is bounded (``Limits``) and never raises for what it finds: an unreadable, damaged
  or foreign checkpoint is a reason to walk the folder instead, an unreadable log a reason to
  use the checkpoint alone, a torn log tail the end of the log.

``_step`` and ``_write`` are where a test kills a process mid-way (the steps are named in
``STEPS``), as ``_exists._stat`` is for the existence checks.
"""

from __future__ import annotations

import array
import contextlib
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier.tiers.fs._catalog_format import (
    LOG_HEADER_SIZE,
    CatalogFormatError,
    Frame,
    Limits,
    decode_checkpoint_raw,
    decode_frames,
    decode_log_header,
    encode_checkpoint,
    encode_log_header,
)
from kvtier.tiers.fs._catalog_replay import replayed
from kvtier.tiers.fs._layout import FILE_MODE, O_CLOEXEC, O_NOFOLLOW, OWN_PREFIX
from kvtier.tiers.fs._packed import PackedOrder
from kvtier.tiers.fs._packed_build import Columns, columns_of, names_of, snapshot

__all__ = [
    "CHECKPOINT_NAME",
    "LOG_NAME",
    "STEPS",
    "JournalFiles",
    "Loaded",
    "load",
    "new_generation",
]

CHECKPOINT_NAME = f"{OWN_PREFIX}-catalog"
LOG_NAME = f"{OWN_PREFIX}-catalog-log"
_TMP_PREFIX = f"{OWN_PREFIX}-catalog-tmp-"
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | O_CLOEXEC | O_NOFOLLOW
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_NOFOLLOW
STEPS = ("checkpoint_written", "checkpoint_renamed", "log_written", "log_renamed")
"""Where ``_step`` is called: a checkpoint written aside (not renamed), renamed into place
(its log not made yet), a new log written aside, renamed into place."""


def _no_step(step: str) -> None:
    del step


_step: Callable[[str], None] = _no_step
_write = os.write


def new_generation() -> int:
    """A checkpoint's generation: random, so no two checkpoints of a folder share one."""
    return secrets.randbits(63) + 1


@dataclass(frozen=True, slots=True)
class Loaded:
    """A catalog read back: its index (least recently used first) after replaying the log
    onto the checkpoint, built packed (``_packed_build``), and where appending goes on
    (``log_end``: the end of the log's good frames; None: the log was missing or unusable, so
    a new one is made)."""

    generation: int
    order: PackedOrder
    columns: Columns  # ``order``'s entries as loaded, in no particular order (a copy)
    entries: int  # in ``order`` as loaded (the catalog takes it over and changes it)
    checkpoint_entries: int
    log_changes: int
    log_end: int | None
    log_note: str | None  # why the log was ignored or cut, for the log line

    @property
    def names(self) -> list[str]:
        """The names as loaded, oldest first (while ``order`` is not changed)."""
        return names_of(snapshot(self.order))

    @property
    def sizes(self) -> array.array[int]:
        return _array_of(self.order.sizes_in_order())


def _array_of(sizes: npt.NDArray[np.uint64]) -> array.array[int]:
    out = array.array("Q")
    out.frombytes(sizes.tobytes())
    return out


def load(root: Path, limits: Limits) -> tuple[Loaded | None, str]:
    """The catalog kept in ``root``, or None and why not (no checkpoint, a damaged one).
    Removes checkpoint and log files left half written by a writer that died."""
    try:
        root_fd = os.open(root, _ROOT_FLAGS)
    except OSError as exc:
        return None, f"cannot open the root: {exc}"
    try:
        _remove_temporaries(root_fd)
        try:
            data = _read(root_fd, CHECKPOINT_NAME, limits.max_file_bytes)
        except FileNotFoundError:
            return None, "no checkpoint"
        except (OSError, CatalogFormatError) as exc:
            return None, f"cannot read the checkpoint: {exc}"
        try:
            checkpoint = decode_checkpoint_raw(data, limits)
            del data
            sizes = np.frombuffer(checkpoint.sizes, dtype=np.uint64)
            columns = columns_of(checkpoint.names, checkpoint.count, sizes)
        except CatalogFormatError as exc:
            return None, f"damaged checkpoint: {exc}"
        return _with_log(root_fd, checkpoint.generation, columns, limits)
    finally:
        os.close(root_fd)


def _with_log(
    root_fd: int, gen: int, columns: Columns, limits: Limits
) -> tuple[Loaded | None, str]:
    note: str | None = None
    frames: list[Frame] = []
    log_end: int | None = None
    try:
        data = _read(root_fd, LOG_NAME, limits.max_file_bytes, cut=True)
        if decode_log_header(data) != gen:
            note = "the log belongs to an older checkpoint: ignored"
        else:
            frames, log_end = decode_frames(data, LOG_HEADER_SIZE, gen, 2 * limits.max_entries)
            if log_end != len(data):
                note = f"the log's last {len(data) - log_end} bytes were torn or damaged: cut"
    except FileNotFoundError:
        note = "no log"
    except (OSError, CatalogFormatError) as exc:
        note = f"the log is unusable ({exc}): ignored"
    changes = sum(len(f.ops) for f in frames)
    try:
        order, built = replayed(columns, frames, limits.max_entries)
    except CatalogFormatError as exc:
        return None, f"damaged log: {exc}"
    loaded = Loaded(gen, order, built, len(order), len(columns), changes, log_end, note)
    return loaded, "loaded"


def _read(root_fd: int, name: str, most: int, *, cut: bool = False) -> bytes:
    """The file ``name`` at the root, at most ``most`` bytes of it (more is an error, or with
    ``cut`` what follows is not read)."""
    fd = os.open(name, _READ_FLAGS, dir_fd=root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CatalogFormatError(f"{name} is not a regular file")
        if st.st_size > most and not cut:
            raise CatalogFormatError(f"{name} holds {st.st_size} bytes, past {most}")
        want = min(st.st_size, most)
        parts: list[bytes] = []
        got = 0
        while got < want:
            part = os.read(fd, min(want - got, 64 << 20))
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        os.close(fd)


def _remove_temporaries(root_fd: int) -> None:
    with os.scandir(root_fd) as entries:
        stale = [e.name for e in entries if e.name.startswith(_TMP_PREFIX)]
    for name in stale:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=root_fd)


class JournalFiles:
    """The writing side, used by one worker thread at a time (``_catalog_journal``): the
    current log's descriptor and how to replace checkpoint and log."""

    def __init__(self, root: Path, durable: bool, limits: Limits | None = None) -> None:
        self.root = root
        self.durable = durable
        self._limits = limits or Limits()
        self._fd: int | None = None

    def checkpoint(self, generation: int, names: Sequence[str], sizes: array.array[int]) -> None:
        """Put a checkpoint of ``generation`` in place, then a new, empty log for it."""
        data = encode_checkpoint(generation, names, sizes)
        self.close()
        root_fd = os.open(self.root, _ROOT_FLAGS)
        try:
            self._replace(root_fd, CHECKPOINT_NAME, data, "checkpoint")
            self._fd = self._new_log(root_fd, generation)
        finally:
            os.close(root_fd)

    def append(self, generation: int, resume_end: int | None, frames: Sequence[bytes]) -> None:
        """Append ``frames`` to the log of ``generation``: the open one, or the one in place
        cut after its last good frame (``resume_end``), or a new one (None)."""
        if self._fd is None:
            root_fd = os.open(self.root, _ROOT_FLAGS)
            try:
                if resume_end is None:
                    self._fd = self._new_log(root_fd, generation)
                else:
                    fd = os.open(LOG_NAME, os.O_WRONLY | O_CLOEXEC | O_NOFOLLOW, dir_fd=root_fd)
                    try:
                        os.ftruncate(fd, resume_end)
                        os.lseek(fd, resume_end, os.SEEK_SET)
                    except BaseException:
                        os.close(fd)
                        raise
                    self._fd = fd
            finally:
                os.close(root_fd)
        try:
            for frame in frames:
                _write_all(self._fd, frame)
            if self.durable:
                os.fdatasync(self._fd)
        except BaseException:
            self.close()  # a frame may be torn: the next writes go to a new log
            raise

    def compact(
        self, previous: int, resume_end: int | None, frames: Sequence[bytes], generation: int
    ) -> int:
        """Append ``frames`` to the log of ``previous``, read checkpoint and log back, and
        put their replay in place as the checkpoint of ``generation`` with a new log; how
        many entries it holds. ``CatalogFormatError`` when they do not read back whole (the
        caller copies the catalog instead)."""
        if frames or self._fd is None:
            self.append(previous, resume_end, frames)
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        loaded, why = load(self.root, self._limits)
        if loaded is None or loaded.generation != previous or loaded.log_end != size:
            note = why if loaded is None else loaded.log_note
            raise CatalogFormatError(f"the catalog did not read back whole: {note}")
        self.checkpoint(generation, loaded.names, loaded.sizes)
        return loaded.entries

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _new_log(self, root_fd: int, generation: int) -> int:
        self._replace(root_fd, LOG_NAME, encode_log_header(generation), "log")
        fd = os.open(LOG_NAME, os.O_WRONLY | O_CLOEXEC | O_NOFOLLOW, dir_fd=root_fd)
        os.lseek(fd, 0, os.SEEK_END)
        return fd

    def _replace(self, root_fd: int, name: str, data: bytes, step: str) -> None:
        tmp = f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, _NEW_FLAGS, FILE_MODE, dir_fd=root_fd)
        try:
            try:
                _write_all(fd, data)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _step(f"{step}_written")
            os.rename(tmp, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=root_fd)
            raise
        if self.durable:
            os.fsync(root_fd)
        _step(f"{step}_renamed")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[_write(fd, view) :]
