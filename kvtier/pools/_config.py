"""``PoolConfig``: which primary pool to build, and its settings, defined once.

The ``[pool]`` section of a config file and the ``KVTIER_POOL_*`` variables land here. A pool
class takes its sizes as plain arguments (``HostPool(num_blocks, block_bytes)``), so this is
not a pool's constructor argument: it is the choice between pools (``kind``) plus the
arguments that choice takes, and ``build_pool`` makes the pool it describes. The defaults
are the pool classes' own (``policy``, ``device``); a test keeps them so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from kvtier.common._settings import (
    Section,
    choice,
    parse_non_negative_int,
    parse_positive_int,
    parse_positive_size,
    spec,
)
from kvtier.pools._policy import POLICY_NAMES

if TYPE_CHECKING:
    from kvtier.pools._base import PrimaryPool

__all__ = ["POOL_KINDS", "PoolConfig", "build_pool"]

POOL_KINDS = ("host", "cuda")
"""``HostPool`` (page-aligned host memory) or ``CudaPool`` (device memory, the ``cuda`` extra)."""


@dataclass(frozen=True, slots=True)
class PoolConfig(Section):
    """The primary pool: ``HostPool`` (``kind="host"``) or ``CudaPool`` (``kind="cuda"``)."""

    SECTION: ClassVar[str] = "pool"

    # No defaults: both follow from the model and the memory given to kvtier.
    num_blocks: int = field(metadata=spec(parse_positive_int))
    block_bytes: int = field(metadata=spec(parse_positive_size))
    kind: str = field(default="host", metadata=spec(choice(*POOL_KINDS)))
    policy: str = field(default="lru", metadata=spec(choice(*POLICY_NAMES)))
    # The CUDA device of a ``cuda`` pool; a ``host`` pool ignores it.
    device: int = field(default=0, metadata=spec(parse_non_negative_int))


def build_pool(config: PoolConfig) -> PrimaryPool:
    """The pool ``config`` describes (a ``CudaPool`` needs the ``cuda`` extra)."""
    if config.kind == "cuda":
        from kvtier.pools._cuda import CudaPool

        return CudaPool(config.num_blocks, config.block_bytes, config.device, policy=config.policy)
    from kvtier.pools._host import HostPool

    return HostPool(config.num_blocks, config.block_bytes, policy=config.policy)
