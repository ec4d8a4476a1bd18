"""Freezing live counters into a component's statistics dataclass.

Components count in plain attributes (an ``+= 1`` on the hot path) and hand out frozen
statistics on demand; reading the counters by the statistics' own field names keeps the two in
step without a hand-written keyword list per component.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def snapshot(stats_type: type[T], counters: object, prefix: str = "", **given: Any) -> T:
    """A ``stats_type`` whose fields are ``given`` where named there, else read from
    ``counters`` as the attribute ``prefix + field name``."""
    values = dict(given)
    for item in fields(stats_type):  # type: ignore[arg-type]
        if item.name not in values:
            values[item.name] = getattr(counters, prefix + item.name)
    return stats_type(**values)
