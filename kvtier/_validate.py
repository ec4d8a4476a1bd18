"""The plain argument checks, kept here for the modules that still import them from this
name; they live in ``kvtier._settings`` with the one set of value parsers."""

from __future__ import annotations

from kvtier._settings import positive_int, positive_number

__all__ = ["positive_int", "positive_number"]
