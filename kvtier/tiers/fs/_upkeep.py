"""The folder's checks on the event loop: ``Upkeep`` runs ``FolderKeeper.check`` and acts on it.

A running ``FSTier`` checks its folder every ``CHECK_SECONDS`` (and a store checks it in its
own worker thread when it makes a shard folder, see ``_keeper``). What a check found is acted
on here, on the loop, where the tier's state lives: what was written back is said once per
burst, an owner that found another process on its folder stops answering lookups from its
index (``share``), and a folder that became another tier's is not used any more (the tier
goes degraded: stores try to take the root again and fail as ``unavailable`` while it is
not theirs).

The periodic loop survives every failure: a check that raises or hangs is logged once per
burst and counted (``Ledger.folder_check_failures``), and the next one runs on time.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from kvtier.tiers.fs._blocks import BlockFiles
from kvtier.tiers.fs._keeper import CHECK_SECONDS
from kvtier.tiers.fs._ledger import Ledger

__all__ = ["Upkeep"]


class Upkeep:
    """Checks one FS tier's folder and acts on what the checks find."""

    def __init__(
        self, files: BlockFiles, ledger: Ledger, timeout: float, share: Callable[[str], None]
    ) -> None:
        """``timeout``: the bound on one check (a hung mount); ``share(why)``: the tier stops
        answering lookups from its index."""
        self._files = files
        self._ledger = ledger
        self._timeout = timeout
        self._share = share

    async def run(self) -> None:
        """Check every ``CHECK_SECONDS`` until cancelled (the tier's close)."""
        while True:
            await anyio.sleep(CHECK_SECONDS)
            try:
                await self.check()
            except Exception as exc:  # a loop that serves the tier lives on
                self._ledger.folder_check_failed(exc)

    async def check(self) -> None:
        """Check the folder once, then act on what was found."""
        files = self._files
        keeper = files.keeper
        if self._ledger.catalog.ready:  # a degraded tier takes its root again at a store
            with anyio.fail_after(self._timeout):
                await files.calls.run(lambda _: keeper.check(), limiter=files.checks)
        self.follow()

    def follow(self) -> None:
        """Act on the reports the checks queued (the periodic one's, or a store's)."""
        reports, ledger = self._files.keeper.reports, self._ledger
        while reports:
            report = reports.popleft()
            if report.restored:
                ledger.warn(
                    "restored",
                    "%s: %s lost %s while in use (emptied?): written back",
                    ledger.name,
                    self._files.root,
                    ", ".join(report.restored),
                )
            if report.failed:
                ledger.folder_check_failed(OSError(report.failed))
            if report.gave_up:
                self._share(report.gave_up)
            if report.refused:
                ledger.catalog.ready = False
                ledger.refused(report.refused, "check")
