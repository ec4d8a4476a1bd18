"""What the pool tests on the CUDA stand-in (``devtools.fake_cuda``) share beyond its fixture:
closing the pools a test built on it, and a copy run while the stand-in parks one CUDA call."""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import anyio.to_thread

from devtools.fake_cuda import FakeCuda
from kvtier import PrimaryPool


async def close_on_stand_in(fake: FakeCuda, pools: Sequence[PrimaryPool]) -> None:
    """Close ``pools``, built on ``fake``: its gates opened first (a failed test may have left
    copies parked), each pool's slot table checked, then the check that no copy touched
    memory it must not."""
    fake.release_all()
    for pool in pools:
        pool.table.check_invariants()
        await pool.aclose()
    assert fake.violations == []


async def threads_parked_at(
    fake: FakeCuda, call: str, copy: Callable[[], Coroutine[Any, Any, None]]
) -> list[int]:
    """Run ``copy`` while ``fake`` parks every ``call`` of CUDA: the idents of the threads it
    parked there once the copy reached it. A failsafe opens the gate should the call block
    the event loop itself (nothing else could then open it)."""
    gate = fake.hold_call(call)
    failsafe = threading.Timer(5.0, fake.release_all)  # only a loop that blocked needs it
    failsafe.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(copy)
            assert await anyio.to_thread.run_sync(gate.reached.wait, 30), f"{call} never made"
            parked = list(gate.threads)
            fake.release(gate)
    finally:
        failsafe.cancel()
    return parked
