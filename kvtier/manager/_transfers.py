"""``store`` and ``load``: copying blocks into the pool and out of it.

A store reserves a slot per new key (skipping keys already present and keys no slot is free
or evictable for), copies the blocks in under ``store_timeout`` and commits them, or frees
every slot it reserved if anything fails; the manager then writes the placed keys through.
A load pins the leading READY blocks, copies them out to the engine's buffers and unpins
them, whatever happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio

from kvtier.common._buffers import BlockBuffer, check_keys, split_blocks
from kvtier.common._errors import LifecycleError
from kvtier.manager._statistics import StoreCounts
from kvtier.manager._watch import Watchers
from kvtier.pools._base import PrimaryPool

__all__ = ["Transfers"]


class Transfers:
    """Copies blocks into and out of the pool, and counts them."""

    __slots__ = (
        "_dtype",
        "_pool",
        "_timeout",
        "_watchers",
        "loaded",
        "skipped_full",
        "skipped_present",
        "stored",
    )

    def __init__(
        self, pool: PrimaryPool, watchers: Watchers, *, timeout: float, dtype: str | None
    ) -> None:
        self._pool = pool
        self._watchers = watchers
        self._timeout = timeout
        self._dtype = dtype
        self.stored = self.skipped_present = self.skipped_full = self.loaded = 0

    async def store(
        self, keys: Sequence[bytes], blocks: Any, still_open: Callable[[], bool]
    ) -> list[bytes]:
        """Place ``blocks`` in the pool under the ``keys`` not there yet; returns the keys
        placed. ``still_open`` says whether the manager is still open once the copy is done
        (closed meanwhile, nothing is committed)."""
        keys = check_keys(keys)
        buffers = split_blocks(
            blocks,
            len(keys),
            self._pool.block_bytes,
            name="blocks",
            writable=False,
            dtype=self._dtype,
        )
        positions, slots, present = self._pool.reserve_new(keys)
        self.skipped_present += present
        self.skipped_full += len(keys) - present - len(slots)
        chosen_keys = [keys[i] for i in positions]
        chosen = [buffers[i] for i in positions]
        if slots:
            await self._copy_in(slots, chosen_keys, chosen, still_open)
            self.stored += len(slots)
        return chosen_keys

    async def _copy_in(
        self,
        slots: list[int],
        keys: list[bytes],
        buffers: list[BlockBuffer],
        still_open: Callable[[], bool],
    ) -> None:
        """Fill the reserved ``slots`` and commit them; abort them all if anything fails."""
        pool = self._pool
        committed = False
        try:
            if not pool.copy_in_now(slots, buffers):
                with anyio.fail_after(self._timeout):
                    await pool.copy_in(slots, buffers)
            if not still_open():
                raise LifecycleError(
                    "TieringManager is not open any more: it was closed while this store "
                    "copied its blocks, and nothing was stored"
                )
            for slot in slots:
                pool.commit(slot)
            committed = True
        finally:
            if not committed:
                for slot in slots:
                    pool.abort(slot)
            for key in keys:
                self._watchers.notify(key)

    async def load(self, keys: Sequence[bytes], out: Any) -> int:
        """Copy the leading primary hits among ``keys`` into ``out``; returns how many."""
        pool = self._pool
        keys = check_keys(keys)
        buffers = split_blocks(
            out, len(keys), pool.block_bytes, name="out", writable=True, dtype=self._dtype
        )
        pinned: list[int] = []
        try:
            for key in keys:
                slot = pool.pin(key)
                if slot is None:
                    break
                pinned.append(slot)
            if pinned:
                await pool.copy_out(pinned, buffers[: len(pinned)])
        finally:
            for slot in pinned:
                pool.unpin(slot)
        self.loaded += len(pinned)
        return len(pinned)

    def counts(self) -> StoreCounts:
        return StoreCounts(
            stored=self.stored,
            skipped_present=self.skipped_present,
            skipped_full=self.skipped_full,
            loaded=self.loaded,
        )
