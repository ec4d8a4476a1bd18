"""Helpers for the scheduler tests that hold a tier (``StallingTier``) while a request waits:
the same block size, and one request run against a held operation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from kvtier import OffloadScheduler
from kvtier.testing import StallingTier

BB = 4096


async def lookup_while_held(
    scheduler: OffloadScheduler,
    keys: list[bytes],
    tier: StallingTier,
    operation: str,
    while_held: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """``scheduler.lookup(keys)`` as a concurrent request; once it is blocked on ``tier``'s held
    ``operation``, run ``while_held`` (checks on the waiting state), release the operation, and
    return the request's answer. Ordered by events, not sleeps; the caller bounds it."""
    answer: list[int] = []

    async def request() -> None:
        answer.append(await scheduler.lookup(keys))

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await tier.wait_stalled(operation)
        if while_held is not None:
            await while_held()
        tier.release(operation)
    return answer[0]
