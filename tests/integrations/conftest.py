"""What the event tests share: a zmq context that never outlives its test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq


@pytest.fixture
def context() -> Iterator[Any]:
    """A zmq context whose sockets all close at the end, also those a failed test left open
    (``term`` would wait for them for ever and hang the run)."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
