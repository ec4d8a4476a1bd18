"""System calls a benchmark phase makes, traced by ``strace`` attached to the process.

A count is what the kernel was asked, whatever asked it: the tier's worker threads, its event
loop, the harness's own polling. So a phase is counted in a pass of its own (strace slows every
call it sees: a counted pass is never a timed one), and ``per_block`` splits the calls into
the ones that touch files (what a reader or writer of blocks makes per block) and the rest
(waking threads and loops, sleeping, memory), each divided by the blocks moved.

Where ``strace`` is missing (or may not attach) the counts are None, said once, and the
benchmark's figures go on without them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["FILE_CALLS", "count_syscalls", "per_block"]

# The calls that open, read, write, name or close files and folders (``cachestat`` and
# ``openat2`` show by number where strace does not know them).
FILE_CALLS = frozenset(
    {
        "open",
        "openat",
        "openat2",
        "syscall_0x1b5",  # openat2 (437)
        "syscall_0x1c3",  # cachestat (451)
        "cachestat",
        "close",
        "read",
        "pread64",
        "readv",
        "preadv",
        "preadv2",
        "write",
        "pwrite64",
        "writev",
        "pwritev",
        "pwritev2",
        "fstat",
        "newfstatat",
        "statx",
        "stat",
        "lstat",
        "fcntl",
        "rename",
        "renameat",
        "renameat2",
        "link",
        "linkat",
        "unlink",
        "unlinkat",
        "mkdir",
        "mkdirat",
        "fsync",
        "fdatasync",
        "getdents64",
        "fadvise64",
        "lseek",
    }
)


_CALL = re.compile(r"^\d+ +(\w+)\(", re.MULTILINE)


@contextlib.contextmanager
def count_syscalls() -> Iterator[dict[str, int]]:
    """Count this process's system calls (every thread) while the body runs: the dict it
    yields is filled, by call name, once the body is done (left empty where strace cannot
    count)."""
    counts: dict[str, int] = {}
    strace = shutil.which("strace")
    if strace is None:
        yield counts
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-strace-") as folder:
        out = Path(folder) / "counts"
        # Every call on a line of its own (``-c``'s table leaves out calls strace cannot
        # name, such as ``cachestat`` before strace 6.5): counted by name from the lines.
        command = [strace, "-f", "-s", "0", "-e", "verbose=none", "-o", str(out)]
        proc = subprocess.Popen(
            [*command, "-p", str(os.getpid())],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        attached = "attached" in proc.stderr.readline()  # strace: Process N attached ...
        try:
            yield counts
        finally:
            proc.send_signal(signal.SIGINT)
            _, errors = proc.communicate()
            if attached and out.exists():
                counts.update(_parse(out.read_text()))
            else:
                print(f"system calls not counted: {errors.strip()}", file=sys.stderr)


def _parse(trace: str) -> dict[str, int]:
    """Calls by name from strace's lines (``PID name(args...``; a call that another thread's
    line interrupted resumes on a line of its own, which is not counted again)."""
    counts: dict[str, int] = {}
    for match in _CALL.finditer(trace):
        counts[match[1]] = counts.get(match[1], 0) + 1
    return counts


def per_block(counts: dict[str, int], blocks: int, ignore: frozenset[str]) -> dict[str, Any]:
    """Calls per block moved: those that touch files, the rest (less ``ignore``, the
    harness's own), and the file calls by name; None where nothing was counted."""
    if not counts:
        return {"file": None, "other": None, "file_by_call": None}
    files = {name: n / blocks for name, n in sorted(counts.items()) if name in FILE_CALLS}
    other = sum(n for name, n in counts.items() if name not in FILE_CALLS | ignore)
    return {"file": sum(files.values()), "other": other / blocks, "file_by_call": files}
