"""What several test modules share beyond fixtures (those live in ``conftest.py``): key and
block factories, where an FS tier keeps its files, the ``kvtier`` command run in-process, a
clock moved by hand, a pool whose copies wait at a gate, an OS call that hangs, a request run
against a held tier, an S3 tier on the run's SeaweedFS, the check that a manager is idle, and
the imports of a vLLM test module, skipped where vLLM is not installed."""

from __future__ import annotations

import io
import os
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypedDict, TypeVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from devtools.weed_server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY
from kvtier import (
    HostPool,
    LookupResult,
    OffloadScheduler,
    PrimaryPool,
    S3Tier,
    SecondaryTier,
    TieringManager,
    block_keys,
)
from kvtier._cli import main
from kvtier.common._buffers import BlockBuffer
from kvtier.testing import StallingTier
from kvtier.tiers.fs._layout import name_of, path_of

BB = 4096
"""The block size of the tests that need no other: one page."""

_A = ParamSpec("_A")
_T = TypeVar("_T")

H, P, R, M = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS
"""The four lookup answers by their initials, for tables of expected answers."""

HUNG_FAILSAFE = 60.0
"""Seconds after which the ``hang`` fixture releases its hung call whatever the test does: a
regression fails its assertions instead of leaving a thread in the call."""


def fresh_keys(n: int) -> list[bytes]:
    """``n`` chained keys in a namespace of their own, so tests never share blocks (nor objects
    in the run's one bucket)."""
    return block_keys(list(range(4 * n)), 4, namespace=os.urandom(8))


def random_blocks(n: int, *, seed: int = 0, block_bytes: int = BB) -> np.ndarray:
    """``n`` blocks of random bytes, one a row; the same ``seed`` gives the same blocks."""
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


async def fill(tier: SecondaryTier, keys: Sequence[bytes], data: np.ndarray | None = None) -> None:
    """Store row ``i`` of ``data`` (random blocks by default) in ``tier`` under ``keys[i]``."""
    rows = random_blocks(len(keys)) if data is None else data
    for key, block in zip(keys, rows, strict=True):
        await tier.store(key, memoryview(block.tobytes()))


async def assert_holds(tier: SecondaryTier, keys: Sequence[bytes], data: np.ndarray) -> None:
    """``tier`` holds row ``i`` of ``data`` under ``keys[i]``, byte for byte."""
    out = bytearray(data.shape[1])
    for i, key in enumerate(keys):
        await tier.load(key, memoryview(out))
        assert out == data[i].tobytes()


def run_cli(*argv: str) -> tuple[int, str, str]:
    """The ``kvtier`` command, run in this process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def block_file(root: Path, key: bytes) -> Path:
    """Where an FS tier rooted at ``root`` keeps the block of ``key``."""
    return path_of(root, name_of(key))


def block_files(root: Path) -> list[Path]:
    """The block files under an FS tier's ``root``, sorted (not its temporary files)."""
    return sorted(p for p in root.glob("??/??/*") if not p.name.startswith("."))


def tmp_files(root: Path) -> list[Path]:
    """The temporary files that stores left under an FS tier's ``root``, sorted."""
    return sorted(root.glob("??/??/.tmp-*"))


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

    def close_gate(self) -> None:
        """From now on copies wait at a new gate; ``entered`` starts unset again."""
        self.gate = anyio.Event()
        self.entered = anyio.Event()

    def open_gate(self) -> None:
        """Let the copies waiting at the gate through, and every later one until it closes."""
        if self.gate is not None:
            self.gate.set()

    async def _pass_gate(self) -> None:
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()

    def copy_in_now(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> bool:
        return False  # every copy in goes through ``copy_in`` and its gate

    async def copy_in(self, slots: Sequence[int], blocks: Sequence[BlockBuffer]) -> None:
        await self._pass_gate()
        await super().copy_in(slots, blocks)

    async def copy_out(self, slots: Sequence[int], out: Sequence[BlockBuffer]) -> None:
        if self._loads:
            await self._pass_gate()
        await super().copy_out(slots, out)


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
    assert stats.background.tasks == 0 and stats.writes.in_flight_bytes == 0
    assert all(a.in_flight_bytes == 0 for a in stats.admission)
    manager.pool.table.check_invariants()


class Hang:
    """Makes a wrapped (OS) call block until ``release`` is set: a hung mount, a root on a dead
    NFS server. ``entered`` is set once a call waits there; ``calls`` counts the calls that
    entered. The ``hang`` fixture releases it at teardown and after ``HUNG_FAILSAFE``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()

    def wrap(self, fn: Callable[_A, _T]) -> Callable[_A, _T]:
        def hung(*args: _A.args, **kwargs: _A.kwargs) -> _T:
            with self._lock:
                self.calls += 1
            self.entered.set()
            self.release.wait()
            return fn(*args, **kwargs)

        return hung

    async def wait_entered(self) -> None:
        """Wait (off the event loop) until a call waits at the hang."""
        assert await anyio.to_thread.run_sync(self.entered.wait, HUNG_FAILSAFE)


class BlockingCallError(AssertionError):
    """A file-system call ran on the event loop thread."""


MakeS3Tier = Callable[..., S3Tier]
"""The type of the S3 tests' ``make_tier`` fixture: ``s3_tier`` with its server and prefix
bound."""


CREDENTIALS_FROM_ENVIRONMENT: dict[str, Any] = {
    "aws_access_key_id": None,
    "aws_secret_access_key": None,
}
"""``s3_tier`` overrides that pass no keys: the tier finds its credentials through the AWS
chain (environment, config files, a credential process)."""


class IndexSettings(TypedDict):
    index_refresh: float
    index_lookback: float


INDEX_BY_HAND = IndexSettings(index_refresh=100.0, index_lookback=1000.0)
"""``s3_tier`` overrides under which the tier's index refreshes when the test calls
``refresh_index()`` (and at open), its own loop's period far beyond any test."""


class HasEndpoint(Protocol):
    """A server with an S3 endpoint: the run's SeaweedFS, one of a test's own, moto's."""

    @property
    def endpoint_url(self) -> str: ...


def s3_tier(
    server: HasEndpoint | str, prefix: str, *, bucket: str = BUCKET, **overrides: Any
) -> S3Tier:
    """An S3Tier on ``server`` (or an endpoint URL) with the test credentials, in ``bucket``
    under ``prefix``; ``overrides`` are S3Tier keywords (they win over these). No audits
    unless asked for: one falls due at a wall-clock instant, which a test must not meet by
    chance (``test_s3_audit`` asks)."""
    settings: dict[str, Any] = {
        "index_audit_every": None,
        "prefix": prefix,
        "endpoint_url": server if isinstance(server, str) else server.endpoint_url,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }
    return S3Tier(bucket, **(settings | overrides))


async def given_back(pool: PrimaryPool, most: int = 1000) -> None:
    """Let the loop run the give-backs of slots lent to reads that have now returned (each
    a callback a worker thread queued on the loop): yields, never sleeps."""
    for _ in range(most):
        if not pool.table.lent:
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError(f"{pool.table.lent} slot(s) still lent")


@contextmanager
def vllm_imports(module: str) -> Iterator[None]:
    """Around a test module's imports of vLLM: skips the module when vLLM's ``module`` does not
    import, except under ``nox -s vllm`` (``KVTIER_VLLM_REQUIRED=1``), where the imports must
    fail instead; and hides the deprecation warnings vLLM and torch raise while importing (not
    ours to fix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if os.environ.get("KVTIER_VLLM_REQUIRED") != "1":
            pytest.importorskip(
                module,
                reason="vLLM is not installed here; `nox -s vllm` installs it and runs these tests",
            )
        yield
