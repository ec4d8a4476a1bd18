"""The contract every wing shares, and the plumbing beneath it; nothing here imports a wing.

The contract:

- ``_keys``: content keys chained through the prefix (``block_keys``);
- ``_lookup``: ``LookupResult`` and ``MissReason``, what every ``lookup`` answers;
- ``_errors``: the one error tree, rooted at ``KVTierError``;
- ``_identity``: ``CacheIdentity`` and the manifest that records what a cache holds;
- ``_format``: the block format at rest and ``IntegrityKey``, shared by every tier that
  writes bytes;
- ``_events``: ``TierEvent`` and the ``EventBuffer`` a tier reports its blocks through.

The plumbing: ``_buffers`` (engine arrays as byte views), ``_lending`` (a pool's slots lent to
a tier's reads), ``_background`` (counted background tasks and the long-lived task groups
of components that own them), ``_settings`` (value parsers and the settings base),
``_arguments`` (plain checks of constructor arguments), ``_verdicts`` (answers remembered for
a while), ``_resilience`` (breaker and backoff), ``_threads`` (worker threads for blocking
calls, never started on the event loop), ``_logging`` (one log line per burst), ``_describe``
(the one-glance ``repr``), ``_freeze`` (live counters into a statistics dataclass) and
``_version``.
"""

from __future__ import annotations

from kvtier.common._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    ExtraNotInstalledError,
    InvalidArgumentError,
    KVTierError,
    LifecycleError,
    TierContractError,
    TierError,
    TierNoSpaceError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvtier.common._events import EventBuffer, EventKind, TierEvent
from kvtier.common._format import IntegrityConfig, IntegrityKey
from kvtier.common._identity import CacheIdentity, IdentityMismatchError, ManifestError
from kvtier.common._keys import block_keys
from kvtier.common._lookup import LookupResult, MissReason

__all__ = [
    "BlockNotFoundError",
    "CacheIdentity",
    "CorruptBlockError",
    "EventBuffer",
    "EventKind",
    "ExtraNotInstalledError",
    "IdentityMismatchError",
    "IntegrityConfig",
    "IntegrityKey",
    "InvalidArgumentError",
    "KVTierError",
    "LifecycleError",
    "LookupResult",
    "ManifestError",
    "MissReason",
    "TierContractError",
    "TierError",
    "TierEvent",
    "TierNoSpaceError",
    "TierTimeoutError",
    "TierUnavailableError",
    "block_keys",
]
