"""The blocking half of a shared folder's existence checks: which block files are there.

``stat_many`` runs in a worker thread, one call for a batch of keys, so a batch of checks
costs one thread hop. ``_stat`` is the one OS call it makes, named once so tests can inject a
fault or a hang (standing in for a hung network mount) at exactly this boundary.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvtier.tiers.fs._layout import path_of

__all__ = ["stat_many"]

_stat = os.stat


def stat_many(root: Path, names: Sequence[str]) -> list[int | None]:
    """The size of each block file, or None where there is none (a shard folder that is a
    link can only make a key look present here: the load that follows refuses the link)."""
    sizes: list[int | None] = []
    for name in names:
        try:
            st = _stat(path_of(root, name), follow_symlinks=False)
        except FileNotFoundError:
            sizes.append(None)
        else:
            sizes.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
    return sizes
