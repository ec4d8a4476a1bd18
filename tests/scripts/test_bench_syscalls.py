"""benchmarks/syscalls.py: the system calls a phase makes, from strace's lines, per block."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from benchmarks.syscalls import _parse, count_syscalls, per_block

TRACE = """\
101 openat2(9, "ab/cd/x", {flags=O_RDONLY}, 24 <unfinished ...>
102 futex(0x7f, FUTEX_WAKE_PRIVATE, 1) = 1
101 <... openat2 resumed>)            = 11
101 syscall_0x1c3(0xb, 0x7f, 0x7f, 0, 0, 0x6) = 0
101 preadv2(11, [{iov_base=""..., iov_len=4096}], 1, 0, 0) = 4096
101 close(11)                         = 0
102 clock_nanosleep(CLOCK_MONOTONIC, 0, {tv_sec=0, tv_nsec=200000}, NULL) = 0
101 +++ exited with 0 +++
"""


def test_each_call_counts_once_resumed_or_not() -> None:
    counts = _parse(TRACE)
    assert counts == {
        "openat2": 1,
        "futex": 1,
        "syscall_0x1c3": 1,  # cachestat, which strace 6.1 cannot name
        "preadv2": 1,
        "close": 1,
        "clock_nanosleep": 1,
    }
    got = per_block(counts, 1, frozenset({"clock_nanosleep"}))
    assert got["file"] == 4  # open, cachestat, read, close
    assert got["other"] == 1  # the futex; the harness's sleep left out
    assert got["file_by_call"]["syscall_0x1c3"] == 1


def test_nothing_counted_says_none() -> None:
    assert per_block({}, 4, frozenset()) == {"file": None, "other": None, "file_by_call": None}


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.timeout(60)
def test_a_phase_is_counted_while_it_runs(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    with count_syscalls() as counts:
        for _ in range(20):
            os.close(os.open(path, os.O_RDONLY))
    if not counts:
        pytest.skip("strace may not attach to this process here")
    assert counts.get("openat", 0) >= 20 and counts.get("close", 0) >= 20
