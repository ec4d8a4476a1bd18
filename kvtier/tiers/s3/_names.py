"""Object names under a tier's prefix: the one rule every folder and marker name follows."""

from __future__ import annotations

__all__ = ["under_prefix"]


def under_prefix(prefix: str, name: str) -> str:
    """``name`` inside ``prefix`` (an empty prefix is the bucket's root)."""
    return f"{prefix}/{name}" if prefix else name
