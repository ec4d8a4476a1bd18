"""The one-glance ``repr`` every stateful component shows (``<Kind head key=value ...>``).

Pools, tiers and the manager print their live state the same way, so a log line or a debugger
shows at a glance what is stored, pending or stuck; one formatter keeps them alike and lets each
repr name the statistics it shows instead of spelling out a format string.
"""

from __future__ import annotations

from operator import attrgetter


def describe(
    kind: str, *heads: object, stats: object = None, shown: str = "", **extra: object
) -> str:
    """``<kind heads... name=value ...>``.

    ``shown`` lists attributes of ``stats`` separated by spaces; a dotted path reads a nested
    one (``lookups.hits``) and is labelled by its last part. ``extra`` fields follow them.
    """
    parts = [kind, *(str(head) for head in heads)]
    parts.extend(f"{p.rpartition('.')[2]}={attrgetter(p)(stats)}" for p in shown.split())
    parts.extend(f"{name}={value}" for name, value in extra.items())
    return "<" + " ".join(parts) + ">"
