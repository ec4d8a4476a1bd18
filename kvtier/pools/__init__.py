"""Primary pools: the slot state machine, eviction policies, host and CUDA pools."""

from __future__ import annotations
