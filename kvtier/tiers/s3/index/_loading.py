"""The S3 index's load at open, run in the background (``index_background_load``).

The tier opens once the bucket answers; the journal loop then loads the index: the newest
snapshot's manifest and directory, the journal's last lookback (small, and the newest keys:
the likeliest asked for next), then the snapshot's body or the listing
(``IndexSync.load_in_background``). While it runs the index is ``loading``: the tier asks
the bucket about keys not brought yet (the snapshot chunk that holds the key, with the
directory; a HEAD of the key's own object), and keys found gone meanwhile are not brought
back (``ExistenceIndex.load_one``).

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
        # Made at open (an event needs a running loop): the load's end, and two of its
        # steps, which lookups asked meanwhile wait for (``IndexSync.bring``).
        self._ended: anyio.Event | None = None
        self._prepared: anyio.Event | None = None  # the snapshot's directory read, or none
        self._journal: anyio.Event | None = None  # the journal's last lookback read

    @property
    def running(self) -> bool:
        return self._index.loading

    def begin(self) -> None:
        """The tier opened without its index: a load starts (``run``)."""
        self._index.begin_load()
        self._ended, self._prepared, self._journal = anyio.Event(), anyio.Event(), anyio.Event()

    def prepared(self) -> None:
        """The snapshot's directory is read, or there is none to read."""
        if self._prepared is not None:
            self._prepared.set()

    def journal_read(self) -> None:
        """The journal's last lookback is indexed (or could not be read)."""
        if self._journal is not None:
            self._journal.set()

    def end(self) -> None:
        """The load ended, or the tier closes during it (idempotent)."""
        self._index.end_load()
        for event in (self._prepared, self._journal, self._ended):
            if event is not None:
                event.set()

    async def wait(self) -> None:
        """Until the load begun at the last open has ended (at once without one)."""
        if self._ended is not None:
            await self._ended.wait()

    async def wait_prepared(self) -> None:
        """Until the snapshot's directory is read, or the load ended (at once without one)."""
        if self._prepared is not None:
            await self._prepared.wait()

    async def wait_journal_read(self) -> None:
        """Until the journal's last lookback is read, or the load ended."""
        if self._journal is not None:
            await self._journal.wait()

    async def run(
        self, load: Callable[[], Awaitable[None]], failed: Callable[[Exception], None]
    ) -> bool:
        """Run ``load`` (``IndexSync.load_in_background``: the snapshot's directory, the
        journal, then the snapshot or the listing); whether it ran to its end without an
        ``Exception`` (one is told to ``failed``, not raised: the journal loop goes on).
        Ends the load however it ends, cancelled included."""
        try:
            await load()
        except Exception as exc:
            failed(exc)
            return False
        finally:
            self.end()
        return True
