"""The engine-neutral bridge: a kvtier tier driven from an engine's synchronous thread.

An engine adapter (``kvtier.integrations.vllm``) builds on ``TierBridge``; the bridge knows
no engine.

- ``_bridge``: ``TierBridge``, the face engine threads call;
- ``_jobs``: each submitted job from submission to outcome, one batch call on the tier;
- ``_answers``: the existence answers engine threads read without waiting;
- ``_loop``: the private asyncio loop on its own thread;
- ``_shared``: what the parts of one bridge share under one lock.
"""

from __future__ import annotations

from kvtier.integrations.bridge._bridge import BridgeStatistics, TierBridge

__all__ = ["BridgeStatistics", "TierBridge"]
