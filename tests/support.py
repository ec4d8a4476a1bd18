"""What several test modules share beyond fixtures (those live in ``conftest.py``): key and
block factories, a clock moved by hand, a pool whose copies wait at a gate, and the check that
a manager is idle."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from devtools.weed_server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, WeedServer
from kvtier import HostPool, S3Tier, TieringManager, block_keys
from kvtier._buffers import BlockBuffer


def fresh_keys(n: int) -> list[bytes]:
    """``n`` chained keys in a namespace of their own, so tests never share blocks (nor objects
    in the run's one bucket)."""
    return block_keys(list(range(4 * n)), 4, namespace=os.urandom(8))


def random_blocks(n: int, *, seed: int = 0, block_bytes: int = 4096) -> np.ndarray:
    """``n`` blocks of random bytes, one a row; the same ``seed`` gives the same blocks."""
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


class ManualClock:
    """A clock a test moves by hand (set ``now`` or call ``advance``), for every component
    that takes a ``clock``: tests move time instead of waiting for it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class GatedPool(HostPool):
    """A HostPool whose copies wait at ``gate`` while there is one, so a test can cancel a
    copy or race it against ``aclose``; ``entered`` is set once a copy waits there.

    ``closed``: the gate exists from the start (otherwise the test sets ``gate`` later);
    ``loads``: copies out of the pool wait too, not only copies in."""

    def __init__(
        self, num_blocks: int, block_bytes: int, *, closed: bool = True, loads: bool = True
    ) -> None:
        super().__init__(num_blocks, block_bytes)
        self.gate: anyio.Event | None = anyio.Event() if closed else None
        self.entered = anyio.Event()
        self._loads = loads

    async def _pass_gate(self) -> None:
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()

    async def copy_in(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> None:
        await self._pass_gate()
        await super().copy_in(slots, blocks)

    async def copy_out(self, slots: Sequence[int], out: Sequence[BlockBuffer]) -> None:
        if self._loads:
            await self._pass_gate()
        await super().copy_out(slots, out)


def assert_idle(manager: TieringManager) -> None:
    """Nothing left behind: no slot WRITING or pinned, every slot free or ready, every
    reservation committed or aborted, no background task, no bytes in flight (in the manager
    or at any tier's admission), and the slot table's own invariants hold."""
    stats = manager.statistics()
    pool = stats.pool
    assert pool.writing == 0, "a slot was left WRITING"
    assert pool.pinned == 0 and pool.pins == 0, "a slot was left pinned"
    assert pool.free + pool.ready == pool.num_blocks
    assert pool.reservations == pool.commits + pool.aborts
    assert stats.background_tasks == 0 and stats.in_flight_bytes == 0
    assert all(a.in_flight_bytes == 0 for a in stats.admission)
    manager.pool.table.check_invariants()


class BlockingCallError(AssertionError):
    """A file-system call ran on the event loop thread."""


def s3_tier(server: WeedServer, prefix: str, **overrides: Any) -> S3Tier:
    """An S3Tier on the run's SeaweedFS bucket under ``prefix``; ``overrides`` are S3Tier
    keywords (they win over these)."""
    settings: dict[str, Any] = {
        "prefix": prefix,
        "endpoint_url": server.endpoint_url,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }
    return S3Tier(BUCKET, **(settings | overrides))
