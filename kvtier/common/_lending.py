"""Lending a pool's slots to a tier's reads, so a promotion lands in its slot with no copy.

A promotion's tier read may be walked away from at a deadline (a hung mount must not hold the
manager), while the read goes on in a worker thread. Without more, such a read must land in a
buffer of the tier's and be copied into the slot only while the caller still waits, since
once the caller has gone the slot may hold another block. A ``Lender`` removes that copy: the
tier reads straight into the slot, and when it returns with a read still in flight it keeps
that slot (``keep``), so the pool neither reuses nor publishes it until the read is over and
the function ``keep`` returned is called, from whatever thread ends the read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["Lender", "Release"]

Release = Callable[[], None]


class Lender(Protocol):
    """Lends a batch's destination buffers (``load_many``'s ``dsts``) to a tier."""

    def keep(self, index: int) -> Release:
        """``dsts[index]`` may still be written after ``load_many`` returns (its result for
        that index is then an error): keep it out of use until the returned function is
        called, once, from any thread. Called on the event loop, before ``load_many``
        returns."""
        ...
