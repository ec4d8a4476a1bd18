"""Shared fixtures. Tier-specific fixtures live in the test modules that use them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvtier
from devtools.weed_server import find_weed

RunScript = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def keys() -> list[bytes]:
    """Sixteen chained keys in a namespace of their own, so tests never share blocks."""
    return kvtier.block_keys(list(range(64)), 4, namespace=os.urandom(8))


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
