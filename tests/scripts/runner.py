"""What the script tests share: a script run (its one JSON object and its stderr), the object
store a script is pointed at, and what a figure must look like."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    """What a script run left: its one JSON object and its stderr (the human output)."""

    out: dict[str, Any]
    stderr: str


@dataclass(frozen=True)
class Store:
    """The object store a script is pointed at."""

    endpoint: str
    bucket: str
    pid: int

    def flags(self, *, pid: bool = True) -> list[str]:
        """``--s3-endpoint``, ``--s3-bucket`` and (with ``pid``) ``--s3-server-pid``."""
        given = ["--s3-endpoint", self.endpoint, "--s3-bucket", self.bucket]
        return [*given, "--s3-server-pid", str(self.pid)] if pid else given


def positive(value: Any) -> bool:
    """A positive finite number (JSON has no NaN or infinity: the scripts write null)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e300
