"""Where the bytes of an FS block file sit, and the buffers that carry them: one place.

A block file is the shared block format (``kvtier.common._format``: header, checksum, MAC)
laid out for a disk read and written with O_DIRECT. This module says, for a payload of a given
size, which format version its file is written in, how many bytes come before the payload
(the header region: the header, padded to a page in version 2), and how large the aligned
private buffers are that a write stages the file in or a read streams it through. Writing
(``_write``), reading (``_read``) and the choice of buffer (``_blocks``) all ask here; none of
them does this arithmetic itself. Pure functions over constants.
"""

from __future__ import annotations

import numpy as np

from kvtier.common._format import (
    ALIGNED_FORMAT_VERSION,
    FORMAT_VERSION,
    PAYLOAD_ALIGN,
    payload_offset,
)

__all__ = [
    "ALIGN",
    "ALIGNED_MIN_PAYLOAD",
    "DIRECT_CHUNK",
    "READ_CHUNK",
    "READ_VERSIONS",
    "aligned",
    "file_version",
    "region_size",
    "scratch_size",
    "staging_size",
]

# O_DIRECT needs file offsets, lengths and memory aligned to the device's logical block; 4096
# covers every common one, and it is where version 2 puts the payload. Buffers from
# ``BufferPool`` are page-aligned (mmap).
ALIGN = PAYLOAD_ALIGN

# Payloads of whole pages from this size on are written in version 2 (aligned, so O_DIRECT
# moves them without a copy); smaller or odd-sized ones in the compact version 1, where the
# padded header would cost more room than the copy it saves.
ALIGNED_MIN_PAYLOAD = 64 << 10

# The FS tier writes version 2 (the payload aligned for O_DIRECT) and still reads version 1.
READ_VERSIONS = (FORMAT_VERSION, ALIGNED_FORMAT_VERSION)

READ_CHUNK = 256 << 10  # small enough to stay in a core's cache between read, hash and copy
# O_DIRECT reads are synchronous device requests: small ones cost more CPU per byte than the
# cache misses they save, so a block is read whole, up to this size (the figures are in
# docs/design.md, "Measurements behind the defaults").
DIRECT_CHUNK = 4 << 20


def file_version(payload_bytes: int) -> int:
    """The block format a payload of ``payload_bytes`` is written in."""
    if payload_bytes >= ALIGNED_MIN_PAYLOAD and payload_bytes % ALIGN == 0:
        return ALIGNED_FORMAT_VERSION
    return FORMAT_VERSION


def region_size(header_bytes: int, payload_bytes: int) -> int:
    """Bytes before the payload in the file of a block: its header, padded in version 2."""
    return payload_offset(header_bytes, file_version(payload_bytes))


def staging_size(header_bytes: int, payload_bytes: int) -> int:
    """Bytes of an aligned buffer that holds a header and payload for an O_DIRECT write."""
    return -(-(header_bytes + payload_bytes) // ALIGN) * ALIGN


def scratch_size(direct: bool, header_bytes: int, payload_bytes: int) -> int:
    """The private buffer a read of one block goes through (see ``_read.read_verified``)."""
    if not direct:
        return READ_CHUNK
    return min(staging_size(header_bytes, payload_bytes), DIRECT_CHUNK)


def aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move ``view``'s bytes as they are: an ``ALIGN``-aligned address
    and a whole number of ``ALIGN`` pieces."""
    if view.nbytes % ALIGN or not view.c_contiguous:
        return False
    return int(np.frombuffer(view, np.uint8).ctypes.data) % ALIGN == 0
