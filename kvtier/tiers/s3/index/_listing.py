"""Listing the prefix: every block object and pack under it, each handed to a ``keep`` function
(the existence index's ``load_one`` at open; the audit's tally in ``_audit``).

One LIST page after another (bounded by ``index_list_timeout``, progress in the log every few
seconds), then each listed pack's table, with one small ranged GET each (two for a table past
``TABLE_PROBE_BYTES``), ``_TABLE_READS`` at a time. What the bucket holds is untrusted: a
name that is neither a block object's nor a pack's of this prefix is skipped, and a pack table
that does not parse is ignored (``_pack_format``) and logged once per burst. A listing cut short by
its bound still opens the tier: blocks not listed answer MISS until written again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import anyio

from kvtier.common._errors import TierError
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._pack_format import (
    Location,
    PackTableError,
    is_pack_name,
)
from kvtier.tiers.s3._pack_table import read_table
from kvtier.tiers.s3._requests import Call
from kvtier.tiers.s3.index._existence import key_from_object
from kvtier.tiers.s3.index._journal_format import journal_prefix

__all__ = ["Listing"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY = 5.0  # seconds between progress lines of a long listing
_TABLE_READS = 16  # pack tables read at once


@dataclass(eq=False, repr=False)
class Listing:
    """One listing: what it found so far, and when to say so in the log. ``keep(key, where)``
    takes each block found (``where``: its pack section, None for its own object) and says
    whether it counts in ``found``."""

    keep: Callable[[bytes, Location | None], bool]
    call: Call
    client: Any
    _: KW_ONLY
    name: str
    bucket: str
    prefix: str
    doing: str = "indexing"  # what the progress lines say the listing is for
    found: int = field(default=0, init=False)
    pages: int = field(default=0, init=False)
    _log: BurstLogger = field(default_factory=lambda: BurstLogger(logger), init=False)
    _started: float = field(default_factory=lambda: time.monotonic(), init=False)
    _reported: float = field(init=False)
    _where: str = field(init=False)

    def __post_init__(self) -> None:
        self._where = f"s3://{self.bucket}/{self.prefix}"
        self._reported = self._started

    async def run(self, index_list_timeout: float) -> bool:
        """Hand every block object and packed block under the prefix to ``keep`` within
        ``index_list_timeout`` seconds; whether the listing completed."""
        with anyio.move_on_after(index_list_timeout) as scope:
            packs = await self.list_pages()
            await self.read_tables(packs)
        return not scope.cancelled_caught

    def _progress_due(self) -> float | None:
        """Seconds since the start if a progress line is due now, else None."""
        now = time.monotonic()
        if now - self._reported < _PROGRESS_EVERY:
            return None
        self._reported = now
        return now - self._started

    async def list_pages(self) -> list[str]:
        """List every page, indexing block objects as they come; the packs' names."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "MaxKeys": 1000}
        if self.prefix:
            kwargs["Prefix"] = self.prefix + "/"
        journal = journal_prefix(self.prefix)
        packs: list[str] = []
        while True:
            page = await self.call(
                "list", None, functools.partial(self.client.list_objects_v2, **kwargs)
            )
            assert not isinstance(page, Fault)
            self.pages += 1
            for item in page.get("Contents", ()):
                name = item["Key"]
                if name.startswith(journal):
                    continue
                if is_pack_name(name, self.prefix):
                    packs.append(name)
                    continue
                key = key_from_object(name, self.prefix)
                if key is not None and self.keep(key, None):
                    self.found += 1
            if (elapsed := self._progress_due()) is not None:
                logger.info(
                    "%s: %s %s: %d blocks after %.0f s (%d pages)",
                    self.name,
                    self.doing,
                    self._where,
                    self.found,
                    elapsed,
                    self.pages,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return packs
            kwargs["ContinuationToken"] = token

    async def read_tables(self, packs: list[str]) -> None:
        """Hand the keys of the listed ``packs`` to ``keep`` from their tables,
        ``_TABLE_READS`` at a time."""
        done = 0
        pending = iter(packs)

        async def reader() -> None:
            nonlocal done
            for name in pending:
                keep = self.keep
                self.found += sum(keep(key, where) for key, where in await self._read_table(name))
                done += 1
                if (elapsed := self._progress_due()) is not None:
                    logger.info(
                        "%s: %s %s: read %d of %d pack tables after %.0f s",
                        self.name,
                        self.doing,
                        self._where,
                        done,
                        len(packs),
                        elapsed,
                    )

        async with anyio.create_task_group() as tg:
            for _ in range(min(_TABLE_READS, len(packs))):
                tg.start_soon(reader)

    async def _read_table(self, name: str) -> list[tuple[bytes, Location | None]]:
        try:
            return list(await read_table(self.call, self.client, self.bucket, name, "list"))
        except PackTableError as exc:
            self._log.warning("pack", "%s: ignoring pack %s: %s", self.name, name, exc)
        except TierError as exc:  # its keys miss until a journal or a store names them
            self._log.warning(
                "pack-table", "%s: could not read pack %s (%s)", self.name, name, exc.reason
            )
        return []

    def report(self, *, complete: bool, timeout: float) -> None:
        if not complete:
            logger.warning(
                "%s: listing %s stopped after %.0f s (index_list_timeout) with %d blocks "
                "indexed; blocks not listed answer MISS until written again",
                self.name,
                self._where,
                timeout,
                self.found,
            )
            return
        logger.info(
            "%s: indexed %d blocks of %s in %.2f s (%d pages)",
            self.name,
            self.found,
            self._where,
            time.monotonic() - self._started,
            self.pages,
        )
