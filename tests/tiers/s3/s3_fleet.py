"""Several S3 tier nodes on one prefix of the run's SeaweedFS, each with a wall clock of its own
that the test moves by hand (its journal stamps segments by it), and the check that a node's
index knows a set of keys."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from kvtier.tiers.s3 import S3Tier
from tests.support import MakeS3Tier, ManualClock

__all__ = ["assert_knows", "fleet"]


@asynccontextmanager
async def fleet(
    make_tier: MakeS3Tier, walls: Sequence[ManualClock], settings: dict[str, Any]
) -> AsyncIterator[list[S3Tier]]:
    """Open one tier per wall clock (``node-0``, ``node-1``, ...) with ``settings``, each with
    that clock as its journal's, and its index loaded (the tests drive the journal by hand
    from there); all closed on the way out."""
    async with AsyncExitStack() as stack:
        tiers = []
        for i, wall in enumerate(walls):
            tier = make_tier(name=f"node-{i}", **settings)
            tier._sync._wall = wall
            tiers.append(await stack.enter_async_context(tier))
            await tier.wait_index_loaded()  # complete or not: some tests make it incomplete
        yield tiers


def assert_knows(tier: S3Tier, keys: Sequence[bytes]) -> None:
    """``tier``'s index holds every one of ``keys``."""
    missing = [key for key in keys if key not in tier._index]
    assert not missing, f"{tier.name} misses {len(missing)} of {len(keys)} keys"
