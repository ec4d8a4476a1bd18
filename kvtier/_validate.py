"""Argument checks shared by every component, so a bad size or timeout gets the same clear
message wherever it is passed."""

from __future__ import annotations

from kvtier._errors import InvalidArgumentError

__all__ = ["positive_int", "positive_number"]


def positive_int(value: object, name: str, hint: str = "") -> int:
    """``value`` if it is an int above zero (not a bool); else say what ``name`` must be."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int{hint}, got {value!r}")
    return value


def positive_number(value: object, name: str, hint: str = "") -> float:
    """``value`` as a float if it is a number above zero (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidArgumentError(f"{name} must be a positive number{hint}, got {value!r}")
    return float(value)
