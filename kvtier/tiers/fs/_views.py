"""The caller's buffers of ``FSTier``'s operations, checked and seen as flat bytes.

A load writes into ``dst`` and a store reads ``src``: each must be a C-contiguous
``memoryview`` (a pool slot), writable for a load; any other shape is a caller's mistake,
raised as ``InvalidArgumentError`` with what to change, before any file is touched.
"""

from __future__ import annotations

from kvtier.common._errors import InvalidArgumentError

__all__ = ["readable_bytes", "writable_bytes"]


def writable_bytes(dst: object) -> memoryview:
    if not isinstance(dst, memoryview):
        raise InvalidArgumentError(f"dst must be a memoryview, got {type(dst).__name__}")
    if dst.readonly:
        raise InvalidArgumentError("dst must be writable; pass a memoryview of a writable buffer")
    return _flat(dst, "dst")


def readable_bytes(src: object) -> memoryview:
    if not isinstance(src, memoryview):
        raise InvalidArgumentError(f"src must be a memoryview, got {type(src).__name__}")
    return _flat(src, "src")


def _flat(view: memoryview, what: str) -> memoryview:
    if not view.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous; copy it into one buffer first")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
