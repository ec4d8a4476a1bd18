"""What one soak run is: its seed, its size, its fault rates and its thresholds.

One frozen object, written whole into the reproducer and read back by ``--replay``, so a
replayed run gets exactly the settings (and seeds) of the run that failed. Workers get it as a
JSON file too, with their own index and incarnation beside it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["FALSE_MISS_LIMIT", "OVERRUN_LIMIT", "SoakSettings", "Worker", "layout"]

# The thresholds: false misses at most 0.1 % of the lookups of clean keys, deadline
# overruns at most 0.01 % of operations.
FALSE_MISS_LIMIT = 0.001
OVERRUN_LIMIT = 0.0001


@dataclass(frozen=True)
class Worker:
    """One worker process's place in the run: its FS folder and its node."""

    index: int
    folder: str  # "own" or "shared"
    node: str
    clock_skew: float  # seconds added to this node's wall clock (its S3 journal's)


def layout(workers: int) -> list[Worker]:
    """Worker 0 owns folder ``own`` on node ``a``; workers 1 and 2 share folder ``shared`` on
    node ``b`` (one machine, one clock, 1.5 s ahead of ``a``); more workers alternate."""
    out = []
    for i in range(workers):
        if i == 0:
            out.append(Worker(0, "own", "a", 0.0))
        elif i in (1, 2):
            out.append(Worker(i, "shared", "b", 1.5))
        else:
            out.append(Worker(i, f"own{i}", "c" if i % 2 else "a", -1.0 if i % 2 else 0.0))
    return out


@dataclass(frozen=True)
class SoakSettings:
    """Everything that decides what a run does (with its seed, what it did, up to timing)."""

    seed: int
    duration: float = 60.0  # seconds of workload, after the servers and workers are up
    workers: int = 3
    block_bytes: int = 4096
    block_tokens: int = 4
    pool_blocks: int = 192
    # Key space: shared hot chains (every worker), per-worker cold chains.
    hot_chains: int = 24
    cold_chains: int = 4000
    max_chain_blocks: int = 8
    # Synchronous lookups in one "lookup_run" operation (a scheduler's step over a batch).
    lookup_run: int = 20
    # Share of operations that open a burst of concurrent ones, and its size.
    burst_rate: float = 0.02
    burst_size: int = 8
    # Operations between close-and-reopen of a worker's manager, and clean restarts.
    reopen_every: int = 400
    restart_every: int = 2500
    # Deadlines: the scheduler's lookup timeout, a load's, and the margin past them.
    lookup_timeout: float = 0.5
    load_deadline: float = 0.5
    deadline_margin: float = 0.05
    # Faults: FS faults per second (all folders), S3 object faults per second, the share of
    # S3 requests the proxy faults, seconds between SIGKILLs (0: none).
    fs_fault_rate: float = 8.0
    s3_fault_rate: float = 3.0
    proxy_fault_share: float = 0.08
    kill_every: float = 20.0
    # Injected call faults in the workers' FS tiers (``fs_calls``): episodes per second (all
    # workers), the share that are EIO (the rest hang), calls per episode (1 to this), and
    # how long a hung call blocks (past the promotion and store timeouts).
    call_fault_rate: float = 2.0
    call_eio_share: float = 0.9
    call_fault_calls: int = 3
    hang_seconds: float = 6.0
    # The FS folders' tmpfs sizes (0: no tmpfs), when the soak may mount one: the shared
    # folder's small enough to fill (ENOSPC), the others' large enough never to.
    shared_fs_bytes: int = 3 << 20
    # Seconds between ballast fills of the small tmpfs (0: none), and how long one holds it
    # full (each drawn from half to one and a half times these).
    disk_full_every: float = 0.0
    disk_full_hold: float = 1.5
    own_fs_bytes: int = 512 << 20
    fsync: str = "data"
    shared_mode: str = "auto"  # the shared folder's FSTier(shared=...): "auto" or "true"
    # kvtier's own timeouts, short so faults resolve within a soak's time scale.
    promotion_timeout: float = 3.0
    store_timeout: float = 5.0
    s3_read_timeout: float = 2.0
    index_refresh: float = 1.0
    index_audit_every: float = 10.0  # the S3 index's audit, often enough to run in a quick soak

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SoakSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path: str) -> SoakSettings:
        with open(path) as f:
            return cls.from_json(json.load(f))

    def worker_seed(self, index: int, incarnation: int) -> int:
        """Each incarnation of each worker its own stream, all fixed by the run's seed."""
        return (self.seed * 1_000_003 + index * 7919 + incarnation * 104_729) % (1 << 63)
