"""Fixtures shared by every test folder: keys, a manual clock, the run's one SeaweedFS (and a
server of its own for a test that kills it), and a runner for the example and benchmark
scripts. Classes the tests also name in annotations live in ``tests/support.py``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from devtools.weed_server import WeedServer, find_weed, serve_own, serve_session
from tests.support import ManualClock, fresh_keys

RunScript = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def keys() -> list[bytes]:
    """Sixteen chained keys in a namespace of their own, so tests never share blocks."""
    return fresh_keys(16)


@pytest.fixture
def clock() -> ManualClock:
    """A clock at 0.0 that the test moves by hand."""
    return ManualClock()


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
