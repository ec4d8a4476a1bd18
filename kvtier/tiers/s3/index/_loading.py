"""The S3 index's load at open, run in the background (``index_background_load``).

The tier opens once the bucket answers; the journal loop then loads the index: the journal's
last lookback first (small, and the newest keys: the likeliest asked for next), then the
snapshot or the listing (``IndexSync.list_at_open``). While it runs the index is ``loading``:
the tier asks the bucket about keys not brought yet, and keys found gone meanwhile are not
brought back (``ExistenceIndex.load_one``).

``IndexLoad`` is the one place that says when the load ends, whatever ends it (complete, cut
short by ``index_list_timeout``, failed, or the tier closing during it): the index stops
asking the bucket and whoever waits for the load (``S3Tier.wait_index_loaded``) returns, so
a close never leaves a waiter hanging.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from kvtier.tiers.s3.index._existence import ExistenceIndex

__all__ = ["IndexLoad"]


class IndexLoad:
    """Whether a background load runs, and an event for those waiting for its end."""

    def __init__(self, index: ExistenceIndex) -> None:
        self._index = index
        self._ended: anyio.Event | None = None  # made at open: an event needs a running loop

    @property
    def running(self) -> bool:
        return self._index.loading

    def begin(self) -> None:
        """The tier opened without its index: a load starts (``run``)."""
        self._index.begin_load()
        self._ended = anyio.Event()

    def end(self) -> None:
        """The load ended, or the tier closes during it (idempotent)."""
        self._index.end_load()
        if self._ended is not None:
            self._ended.set()

    async def wait(self) -> None:
        """Until the load begun at the last open has ended (at once without one)."""
        if self._ended is not None:
            await self._ended.wait()

    async def run(
        self,
        journal: Callable[[], Awaitable[None]] | None,
        listing: Callable[[], Awaitable[None]],
        failed: Callable[[Exception], None],
    ) -> bool:
        """Read the ``journal`` (when the tier reads it), then the snapshot or ``listing``;
        whether the load ran to its end without an ``Exception`` (one is told to ``failed``,
        not raised: the journal loop goes on). Ends the load however it ends, cancelled
        included."""
        try:
            if journal is not None:
                await journal()
            await listing()
        except Exception as exc:
            failed(exc)
            return False
        finally:
            self.end()
        return True
