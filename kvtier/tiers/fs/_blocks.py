"""One block across the worker-thread boundary: whose memory the bytes pass through.

Why its own module: this is the part of ``FSTier`` that decides, for one block in a worker
thread, whether the bytes go straight between the file and the caller's memory or through
a private buffer of the tier's (always for a call that may be abandoned at a deadline, so an
abandoned thread never touches pool memory, and always with O_DIRECT, whose header and
payload must sit side by side in one aligned buffer). ``load``, ``store`` and the batch runs
in ``_fs_batch`` all call it; the file format itself is ``_fs_io``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier._format import header_size
from kvtier.tiers.fs import _io as io
from kvtier.tiers.fs import _read
from kvtier.tiers.fs._calls import Handoff

if TYPE_CHECKING:
    from kvtier.tiers.fs._tier import FSTier

__all__ = ["read_block", "write_block"]


def read_block(
    tier: FSTier, call: Handoff, key: bytes, name: str, view: memoryview, *, private: bool
) -> io.ReadOutcome:
    """Read and verify one block (in a worker thread). ``private``: through a buffer of
    the tier's, copied into ``view`` inside ``touching()``; else straight into ``view``,
    unless O_DIRECT needs an aligned buffer anyway."""
    if not (private or tier._direct):
        return _read.read_block(
            tier.root, name, key, view, None, call.touching, integrity_key=tier.integrity_key
        )
    hlen = header_size(len(key), integrity_key=tier.integrity_key)
    buf = tier._buffers.take(_read.scratch_size(tier._direct, hlen, view.nbytes))
    try:
        return _read.read_block(
            tier.root,
            name,
            key,
            view,
            memoryview(buf),
            call.touching,
            integrity_key=tier.integrity_key,
            direct=tier._direct,
        )
    finally:
        tier._buffers.give(buf)


def write_block(
    tier: FSTier,
    call: Handoff,
    key: bytes,
    name: str,
    payload: memoryview,
    victims: list[str],
    *,
    private: bool,
    started: Callable[[], None] | None = None,
) -> tuple[io.WriteOutcome, int]:
    """Publish one block (in a worker thread). ``private``: copy the payload out of the
    caller's memory first, inside ``touching()`` (always with O_DIRECT, whose header and
    payload must sit side by side in one aligned buffer). ``started`` is called, under
    the call's lock, once the block may touch the file system."""
    hlen = header_size(len(key), integrity_key=tier.integrity_key)
    copied = private or tier._direct
    buf = tier._buffers.take(io.staging_size(hlen, payload.nbytes)) if copied else None
    try:
        staging = None if buf is None else memoryview(buf)
        body = payload if staging is None else staging[hlen : hlen + payload.nbytes]
        with call.touching() if copied else call.holding():
            if staging is not None:
                io.copy_bytes(body, payload)
            if started is not None:
                started()
        return io.write_block(
            tier.root,
            name,
            key,
            body,
            tier.fsync,
            victims,
            integrity_key=tier.integrity_key,
            staging=staging if tier._direct else None,
        )
    finally:
        if buf is not None:
            tier._buffers.give(buf)
