"""Fixtures shared by every test folder: keys, a manual clock, a hung OS call, the run's one
SeaweedFS (and a server of its own for a test that kills it), a runner for the example and
benchmark scripts, and a guard against file-system calls on the event loop. Classes the tests
also name in annotations live in ``tests/support.py``."""

from __future__ import annotations

import asyncio
import builtins
import faulthandler
import io as stdio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.weed_server import WeedServer, find_weed, serve_own, serve_session
from kvtier.tiers.fs import _exists as _fs_exists
from kvtier.tiers.fs import _read as _fs_read
from kvtier.tiers.fs import _write as _fs_write
from tests.support import HUNG_FAILSAFE, BlockingCallError, Hang, ManualClock, fresh_keys

RunScript = Callable[..., subprocess.CompletedProcess[str]]


class HangWatchdog:
    """The last resort against a hang that pytest-timeout cannot break: its timer stops once
    a test has failed (and so does faulthandler's), and a teardown can then wait for ever in a
    C call (a zmq context waiting for a socket the failed test never closed). Past a test's
    deadline every thread's stack goes to the terminal and the run exits: CI fails in minutes,
    with the place of the hang, instead of at its own limit."""

    def __init__(self) -> None:
        self._report_fd = os.dup(2)  # the terminal's stderr, kept before pytest captures it
        self._deadline: float | None = None
        threading.Thread(target=self._watch, name="test-hang-watchdog", daemon=True).start()

    def arm(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                os.write(self._report_fd, b"\nA test hung past its deadline; the stacks:\n")
                faulthandler.dump_traceback(file=self._report_fd, all_threads=True)
                os._exit(1)


_WATCHDOG: list[HangWatchdog] = []


def pytest_configure(config: pytest.Config) -> None:
    _WATCHDOG.append(HangWatchdog())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Each test, its setup and teardown included, within twice its timeout and a minute."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout"))
    _WATCHDOG[0].arm(2 * limit + 60)
    try:
        yield
    finally:
        _WATCHDOG[0].disarm()


@pytest.fixture
def keys() -> list[bytes]:
    """Sixteen chained keys in a namespace of their own, so tests never share blocks."""
    return fresh_keys(16)


@pytest.fixture
def clock() -> ManualClock:
    """A clock at 0.0 that the test moves by hand."""
    return ManualClock()


@pytest.fixture
def hang() -> Iterator[Hang]:
    """A hung call for the test to wrap around an OS call; released at teardown, and by a
    failsafe timer after ``HUNG_FAILSAFE`` seconds."""
    hung = Hang()
    failsafe = threading.Timer(HUNG_FAILSAFE, hung.release.set)
    failsafe.start()
    yield hung
    hung.release.set()
    failsafe.cancel()


@pytest.fixture(scope="session")
def weed_server() -> Iterator[WeedServer]:
    """The run's one SeaweedFS (``weed server`` with its S3 gateway) on 127.0.0.1, with the
    bucket ``devtools.weed_server.BUCKET``; started when a test first asks for it. Tests keep
    apart by prefix."""
    yield from serve_session()


@pytest.fixture
async def own_weed() -> AsyncIterator[WeedServer]:
    """A SeaweedFS of the test's own, which it may kill and restart (same ports, same data)."""
    async for server in serve_own():
        yield server


@pytest.fixture
def run_script() -> RunScript:
    """Run a script (an example or benchmark that starts its own SeaweedFS) with this
    interpreter: skipped when ``weed`` is not installed, failed on a non-zero exit."""
    try:
        find_weed()
    except RuntimeError as exc:
        pytest.skip(str(exc))

    def run(script: Path, *args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    return run


# -- a guard against blocking calls on the event loop ------------------------------------------

_OS_CALLS = [
    *("open", "read", "write", "pread", "preadv", "writev", "stat", "lstat", "fstat"),
    *("fsync", "fdatasync", "rename", "replace", "unlink", "remove", "mkdir", "makedirs"),
    *("rmdir", "scandir", "listdir", "utime"),
]


@pytest.fixture
def no_blocking(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """Fail the test if any file-system call runs on a thread with a running event loop."""
    caught: list[str] = []

    def guard(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return fn(*args, **kwargs)  # a worker thread: fine
            caught.append(label)
            raise BlockingCallError(f"{label} called on the event loop thread")

        return guarded

    for name in _OS_CALLS:
        monkeypatch.setattr(os, name, guard(getattr(os, name), f"os.{name}"))
    monkeypatch.setattr(builtins, "open", guard(builtins.open, "open"))
    monkeypatch.setattr(stdio, "open", guard(stdio.open, "io.open"))
    monkeypatch.setattr(_fs_write, "_writev", guard(_fs_write._writev, "os.writev"))
    monkeypatch.setattr(_fs_read, "_preadv", guard(_fs_read._preadv, "os.preadv"))
    monkeypatch.setattr(_fs_exists, "_stat", guard(_fs_exists._stat, "os.stat"))
    yield caught
    assert not caught, f"blocking calls on the event loop: {sorted(set(caught))}"
