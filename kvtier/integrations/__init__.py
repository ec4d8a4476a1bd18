"""Adapters that plug kvtier's tiers into serving engines.

Each engine has its own module (``kvtier.integrations.vllm``), importable only with that
engine's extra installed; ``import kvtier`` never imports one. The engine-neutral part, a
kvtier tier driven from a synchronous engine thread, is ``kvtier.integrations.bridge._bridge``.
"""

from __future__ import annotations
