"""Fixtures of the pool tests: the CUDA stand-in (``devtools.fake_cuda``), stopped at teardown.
A module that runs on real CUDA as well binds ``fake`` to its own runtime instead."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.fake_cuda import FakeCuda


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    """The CUDA stand-in with two GPUs; at teardown its gates open (a failed test may have
    left copies parked) and its stream threads stop."""
    cuda = FakeCuda(devices=2)
    yield cuda
    cuda.release_all()
    cuda.close()
