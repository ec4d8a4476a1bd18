"""The one error tree of kvtier.

::

    KVTierError
    ├── InvalidArgumentError (also ValueError): bad arguments or configuration; says what to fix
    │   ├── IdentityMismatchError: a tier's folder or prefix holds another cache identity
    │   ├── UnusableRootError (also OSError): an FS root that cannot be created or written
    │   └── ManifestError: a cache identity manifest that cannot be read or trusted
    ├── ExtraNotInstalledError (also ImportError): an optional extra is missing; names it
    ├── LifecycleError (also RuntimeError): used outside ``async with`` or after closing
    └── TierError: an operation on a tier failed; carries tier, key, operation and reason
        ├── BlockNotFoundError       reason "not_found"
        ├── CorruptBlockError        reason "corrupt"
        ├── TierTimeoutError         reason "timeout"
        ├── TierUnavailableError     reason "unavailable"
        ├── TierNoSpaceError         reason "no_space"
        └── TierContractError        reason "tier_error"

Tier faults never escape ``lookup()`` or background work: they are turned into a miss with the
``reason`` of the error. They do escape direct calls such as ``tier.load()``.
"""

from __future__ import annotations

from typing import ClassVar

from kvtier.common._lookup import MissReason

__all__ = [
    "BlockNotFoundError",
    "CorruptBlockError",
    "ExtraNotInstalledError",
    "InvalidArgumentError",
    "KVTierError",
    "LifecycleError",
    "TierContractError",
    "TierError",
    "TierNoSpaceError",
    "TierTimeoutError",
    "TierUnavailableError",
]


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""


class InvalidArgumentError(KVTierError, ValueError):
    """An argument or a configuration value is wrong; the message says what to change."""


class ExtraNotInstalledError(KVTierError, ImportError):
    """An optional feature was used without its extra installed."""

    def __init__(self, feature: str, extra: str, module: str) -> None:
        super().__init__(
            f"{feature} needs the optional package {module!r}: install it with "
            f"`pip install 'kvtier[{extra}]'`"
        )
        self.extra = extra


class LifecycleError(KVTierError, RuntimeError):
    """A component was used before ``async with`` entered it or after it closed."""


class TierError(KVTierError):
    """A tier operation failed. ``reason`` is the miss reason it turns into."""

    reason: ClassVar[MissReason] = MissReason.UNAVAILABLE

    def __init__(
        self, message: str, *, tier: str, operation: str, key: bytes | None = None
    ) -> None:
        where = f"{tier}.{operation}" + (f" key={key.hex()}" if key is not None else "")
        super().__init__(f"{where}: {message}")
        self.tier = tier
        self.operation = operation
        self.key = key


class BlockNotFoundError(TierError):
    """The tier does not hold the block (it was never stored, or was evicted or deleted)."""

    reason = MissReason.NOT_FOUND


class CorruptBlockError(TierError):
    """The stored bytes failed verification: the block is dropped, never served."""

    reason = MissReason.CORRUPT


class TierTimeoutError(TierError):
    """The tier did not answer within its deadline; the caller counts a miss and goes on."""

    reason = MissReason.TIMEOUT


class TierUnavailableError(TierError):
    """The tier cannot be reached or refused the call (a dead endpoint, a lost disk)."""

    reason = MissReason.UNAVAILABLE


class TierNoSpaceError(TierError):
    """The tier has no room for the block, even after evicting what it may."""

    reason = MissReason.NO_SPACE


class TierContractError(TierError):
    """A tier answered against its own contract (a batch call with one result too few, say):
    a bug in the tier, not a fault of its storage, so its blocks fail and nothing else does."""

    reason = MissReason.TIER_ERROR
