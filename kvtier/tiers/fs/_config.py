"""``FSConfig``: every setting of an ``FSTier``, defined once.

The ``[fs]`` section of a config file, the ``KVTIER_FS_*`` variables and ``FSTier``'s keyword
arguments all land here, under the same names: each field holds its default and its parser
(``kvtier.common._settings``), so a setting is named, defaulted and checked in this one place. What
each setting trades is described in ``kvtier.tiers.fs``.

The integrity key is not here: it is one secret for the whole stack (``[integrity] key``),
which ``KVTierConfig`` hands to every tier; ``FSTier`` takes it as ``integrity_key``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypedDict

from kvtier.common._settings import (
    Section,
    choice,
    described,
    optional,
    parse_bool,
    parse_non_negative_size,
    parse_path,
    parse_positive_int,
    parse_positive_size,
    parse_seconds,
    parse_text,
    spec,
)
from kvtier.tiers.fs._ownership import Sharing

__all__ = ["FSYNC_POLICIES", "FSConfig", "FSOverrides"]

FSYNC_POLICIES = ("never", "data", "always")
"""What a store costs against what a crash of the machine can lose (see ``kvtier.tiers.fs``)."""

_LOOP_READ_BYTES = 256 << 10
"""``loop_read_bytes``'s default. Reading a page-cached block on the loop and checking its
checksum there costs the loop about what the hops to a worker thread and back cost it for a
block this small, and more for larger ones, while the promotion waits less either way; so by
default the loop reads only what costs it nothing more (measured in ``docs/benchmarks.md``)."""


def _parse_sharing(value: object, text: bool) -> Sharing:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_bool(value, text)


_SHARED = described(
    _parse_sharing,
    '"auto", true or false',
    '"auto" (the owner while no other process uses the folder), True (other processes write '
    "it too) or False (only this process writes it)",
)
_DIRECT_IO = described(
    parse_bool, "true or false", "True (O_DIRECT where the file system takes it) or False"
)


@dataclass(frozen=True, slots=True)
class FSConfig(Section):
    """An ``FSTier``: ``FSTier(root, config=FSConfig(...), **overrides)``, or the ``[fs]``
    section of ``KVTierConfig``."""

    SECTION: ClassVar[str] = "fs"

    # The folder; made (0700) when the tier opens. ``FSTier`` resolves it to an absolute path.
    root: str = field(metadata=spec(parse_path))
    name: str = field(default="fs", metadata=spec(parse_text))
    # None: unbounded; else the least recently used blocks go before a store passes it.
    capacity_bytes: int | None = field(default=None, metadata=spec(optional(parse_positive_size)))
    fsync: str = field(default="data", metadata=spec(choice(*FSYNC_POLICIES)))
    # How long a miss is remembered (another process may write the key meanwhile).
    miss_ttl: float = field(default=2.0, metadata=spec(parse_seconds))
    # Existence checks of a shared folder: keys per batch, and the bound on one batch.
    lookup_batch_size: int = field(default=256, metadata=spec(parse_positive_int))
    lookup_timeout: float = field(default=5.0, metadata=spec(parse_seconds))
    # Worker threads reading (and checking) blocks, and writing them.
    max_concurrency: int = field(default=16, metadata=spec(parse_positive_int))
    max_write_concurrency: int = field(default=16, metadata=spec(parse_positive_int))
    # Who writes root (see ``_ownership``): "auto" owns it while no other process uses it, and
    # an owner answers lookups from its index without a stat; True always checks the disk.
    shared: Sharing = field(default="auto", metadata=spec(_SHARED))
    # Threads a deadline walked away from (a hung mount) that may still run; past it, fail fast.
    max_stuck_threads: int = field(default=32, metadata=spec(parse_positive_int))
    direct_io: bool = field(default=True, metadata=spec(_DIRECT_IO))
    # A ``load_many`` of at most this many bytes whose files the page cache holds is read on
    # the event loop instead of in a worker thread (0: never; see ``_cached``).
    loop_read_bytes: int = field(default=_LOOP_READ_BYTES, metadata=spec(parse_non_negative_size))
    # An owner walks its folder again every walk_interval seconds (and at least 50 times the
    # CPU time its last walk took) to learn of files removed or added behind its back (by
    # hand, by a cleanup job) without waiting for their next load; None: never.
    walk_interval: float | None = field(default=600.0, metadata=spec(optional(parse_seconds)))
    # With a cache identity: keep its blocks in root/id-<digest> (each identity its own
    # folder) instead of refusing a root that records another identity
    # (``kvtier.common._identity``); no effect on a tier without an identity.
    separate_identities: bool = field(default=False, metadata=spec(parse_bool))


class FSOverrides(TypedDict, total=False):
    """``FSTier``'s keyword arguments: the fields of ``FSConfig`` but ``root`` (which is
    positional), for type checkers; the values are checked by ``FSConfig``."""

    name: str
    capacity_bytes: int | None
    fsync: str
    miss_ttl: float
    lookup_batch_size: int
    lookup_timeout: float
    max_concurrency: int
    max_write_concurrency: int
    shared: Sharing
    max_stuck_threads: int
    direct_io: bool
    loop_read_bytes: int
    walk_interval: float | None
    separate_identities: bool
