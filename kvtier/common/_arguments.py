"""Plain checks of the arguments a constructor takes that are not settings of a config file
section: each returns the value or raises ``InvalidArgumentError`` saying what to pass."""

from __future__ import annotations

from kvtier.common._errors import InvalidArgumentError

__all__ = ["check_type", "positive_int", "positive_number"]


def check_type(value: object, kind: type, expected: str) -> None:
    """Refuse a ``value`` that is not a ``kind``, saying what was ``expected`` and what came."""
    if not isinstance(value, kind):
        raise InvalidArgumentError(f"{expected}, got {type(value).__name__}")


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
