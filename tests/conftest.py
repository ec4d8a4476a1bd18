"""Shared fixtures. Tier-specific fixtures live in the test modules that use them."""

from __future__ import annotations

import os

import pytest

import kvtier


@pytest.fixture
def keys() -> list[bytes]:
    """Sixteen chained keys in a namespace of their own, so tests never share blocks."""
    return kvtier.block_keys(list(range(64)), 4, namespace=os.urandom(8))
