"""What every ``kvtier`` command shares: exit codes, the usage error, byte counts in words."""

from __future__ import annotations

__all__ = ["EXIT_BAD_DATA", "EXIT_OK", "EXIT_USAGE", "UsageError", "human_bytes"]

EXIT_OK = 0
EXIT_BAD_DATA = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Wrong arguments or a folder that is not a kvtier FS tier: exit code 2."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
