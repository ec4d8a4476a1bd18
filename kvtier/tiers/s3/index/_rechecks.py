"""Checking the removals other nodes publish against the bucket before the index drops a key.

Why a check and not an order (``_existence`` says more): a removal segment and a store segment of
one key, from two nodes, are ordered by their names, which say when each writer published and
by its own wall clock, not whether the delete came before the store. So a removal read from
another node's segment only *doubts* a key this index holds; once per refresh round, after
the segments are read, this module asks the bucket whether the key's block is there now:

- one HEAD of what a load would read: the key's pack when the index locates it in one; its
  own object otherwise, or when that pack is gone (a key stored again on its own after its
  pack was deleted: the index then forgets the pack's location);
- found: the block was stored again after that delete (or the delete failed); it stays a
  HIT, and nothing is told (``removals_kept`` counts it);
- not found: the key is dropped, and told as a REMOTE removed event (``forgot``), as before;
- a HEAD that fails (a timeout, the breaker open) leaves the key doubted for the next round.
  Meanwhile it answers HIT: a stale HIT costs at most one GET, which drops it.

The HEAD is sent after the removal was read, so it sees every act before the removal was
published in the object store's own order, whatever the nodes' clocks say. The checks run in
the refresh loop, never on the lookup path; they are index upkeep (``requests["head"]``).

Cost: one HEAD per key another node removed, on each node that holds that key (a cache
deletes seldom: on request, or an object found corrupt); none for keys a node does not hold.
Bounds: removal segments are untrusted input, so a round checks at most
``MAX_CHECKS_PER_ROUND`` keys (the rest wait for the next rounds), ``_PARALLEL`` at a time,
and only keys this index holds (at most ``index_max_keys`` are ever doubted at once). A forged
removal costs HEADs of keys the reader holds, never a miss.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import anyio

from kvtier.common._errors import TierError
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3.index._existence import ExistenceIndex, object_name
from kvtier.tiers.s3.index._upkeep import Upkeep

__all__ = ["MAX_CHECKS_PER_ROUND", "RemovalChecks"]

logger = logging.getLogger("kvtier.tiers.s3.index._sync")

MAX_CHECKS_PER_ROUND = 1024
_PARALLEL = 16
_NOT_FOUND = frozenset({Fault.NOT_FOUND})
# What the check of one key found: whether its block is there, and a pack location found
# gone while its own object is there.
_Found = tuple[bool, Location | None]


class RemovalChecks:
    """The checks of doubted keys for one ``IndexSync`` (see the module docstring)."""

    def __init__(
        self,
        index: ExistenceIndex,
        upkeep: Upkeep,
        *,
        forgot: Callable[[list[bytes], str], None],
    ) -> None:
        """Check ``index``'s doubted keys in the bucket and prefix of ``upkeep``;
        ``forgot(keys, why)`` is told the keys a check dropped."""
        self._index, self.name = index, upkeep.name
        self._bucket, self._prefix, self._call = upkeep.bucket, upkeep.prefix, upkeep.call
        self.requests, self._forgot = upkeep.requests, forgot
        self._log = BurstLogger(logger)
        self.checks_failed = 0  # HEADs that failed: their keys are checked again later

    async def run(self, client: Any) -> None:
        """Check up to ``MAX_CHECKS_PER_ROUND`` doubted keys, settle each in the index and
        tell the keys dropped. A key whose check did not end (it failed, or the round was
        cancelled) stays doubted."""
        batch = self._index.take_doubts(MAX_CHECKS_PER_ROUND)
        if not batch:
            return
        found: dict[bytes, _Found] = {}
        try:
            limiter = anyio.CapacityLimiter(_PARALLEL)
            async with anyio.create_task_group() as tg:
                for key, _, where in batch:
                    tg.start_soon(self._check, client, key, where, found, limiter)
        finally:
            dropped: dict[str, list[bytes]] = {}
            for key, _, _ in batch:
                exists, stale = found.get(key, (None, None))
                why = self._index.settle(key, exists, stale)
                if why is not None:
                    dropped.setdefault(why, []).append(key)
            for why, keys in dropped.items():
                self._forgot(keys, why)

    async def _check(
        self,
        client: Any,
        key: bytes,
        where: Location | None,
        found: dict[bytes, _Found],
        limiter: anyio.CapacityLimiter,
    ) -> None:
        """HEAD ``key``'s pack (if located in one), then its own object; into ``found``."""
        async with limiter:
            try:
                if where is not None and await self._exists(client, key, where.pack):
                    found[key] = (True, None)
                    return
                there = await self._exists(client, key, object_name(self._prefix, key))
            except TierError as exc:
                self.checks_failed += 1
                self._log.warning(
                    "removal-check",
                    "%s: could not check a removed block (%s); checking it again later",
                    self.name,
                    exc.reason,
                )
                return
            found[key] = (there, where if there else None)

    async def _exists(self, client: Any, key: bytes, name: str) -> bool:
        self.requests["head"] += 1
        head = functools.partial(client.head_object, Bucket=self._bucket, Key=name)
        return await self._call("journal", key, head, expected=_NOT_FOUND) is not Fault.NOT_FOUND
