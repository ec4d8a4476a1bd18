"""How the index's upkeep (journal reads, removal checks) reaches the bucket: one record that
``IndexSync`` makes once and hands to each helper, so they send and count alike."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kvtier.tiers.s3._requests import Call

__all__ = ["Upkeep"]


@dataclass(frozen=True, slots=True)
class Upkeep:
    """The tier's name (for logs), the bucket and prefix, the request sender, and the
    counter of requests by kind that the journal loop's helpers share."""

    name: str
    bucket: str
    prefix: str
    call: Call
    requests: collections.Counter[str]
