"""Shared fixtures. Tier-specific fixtures live in the test modules that use them."""

from __future__ import annotations

import os

import pytest

import kvtier


@pytest.fixture
def block_bytes() -> int:
    return 4096


@pytest.fixture
def make_block(block_bytes: int):  # type: ignore[no-untyped-def]
    def make() -> bytes:
        return os.urandom(block_bytes)

    return make


@pytest.fixture
def keys() -> list[bytes]:
    return kvtier.block_keys(list(range(64)), 4, namespace=os.urandom(8))
