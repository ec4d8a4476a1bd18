"""Turning the engine's arrays (numpy, torch, CuPy) into byte views, with checks that say
what is wrong before anything is copied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import MAX_KEY_BYTES
from kvtier.common._keys import check_key

__all__ = ["LOOP_COPY_BYTES", "BlockBuffer", "check_keys", "dtype_name", "split_blocks"]

LOOP_COPY_BYTES = 1 << 20
"""The most bytes one step copies on the event loop (a pool's copy in or out, an S3 object
built or checked): below it the hop to a worker thread and back costs the loop about as much
as the copy; above it the copy runs in a thread, so the loop is never held much longer."""


@dataclass(slots=True)
class BlockBuffer:
    """One block's worth of an engine buffer.

    ``host`` is a flat byte view when the memory is host memory; ``device`` is the original
    array when it lives on a GPU (CUDA pools copy those without a host round trip). Not
    frozen: a store makes one per block, and a frozen dataclass costs several times more to
    build; nothing changes one after it is made.
    """

    host: memoryview | None
    device: Any = None


def dtype_name(dtype: Any) -> str:
    """One spelling for numpy, torch and CuPy dtypes: 'float16', 'bfloat16', ..."""
    return str(dtype).removeprefix("torch.")


def _module_of(obj: object) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _one_block(obj: Any, block_bytes: int, what: str, writable: bool) -> BlockBuffer:
    module = _module_of(obj)
    if module == "torch":
        if obj.device.type != "cpu":
            _check_size(obj.numel() * obj.element_size(), block_bytes, what)
            if not obj.is_contiguous():
                raise InvalidArgumentError(f"{what} must be contiguous; call .contiguous()")
            return BlockBuffer(None, obj)
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what} must be contiguous; call .contiguous() first")
        import torch

        arr = obj.detach().reshape(-1).view(torch.uint8).numpy()
    elif module == "cupy":
        _check_size(obj.nbytes, block_bytes, what)
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError(f"{what} must be C-contiguous; use cupy.ascontiguousarray")
        return BlockBuffer(None, obj)
    elif isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise InvalidArgumentError(f"{what} has dtype object; KV blocks need a numeric dtype")
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError(f"{what} must be C-contiguous; use numpy.ascontiguousarray")
        if writable and not obj.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only; pass a writable array")
        arr = obj.reshape(-1).view(np.uint8)
    elif isinstance(obj, bytes | bytearray | memoryview):
        view = memoryview(obj).cast("B")
        if writable and view.readonly:
            raise InvalidArgumentError(f"{what} is read-only; pass a bytearray or an array")
        _check_size(view.nbytes, block_bytes, what)
        return BlockBuffer(view)
    else:
        raise InvalidArgumentError(
            f"{what} must be a numpy array, a torch tensor, a CuPy array or bytes, "
            f"got {type(obj).__name__}"
        )
    _check_size(arr.nbytes, block_bytes, what)
    return BlockBuffer(memoryview(arr))


def _check_size(nbytes: int, block_bytes: int, what: str) -> None:
    if nbytes != block_bytes:
        raise InvalidArgumentError(
            f"{what} holds {nbytes} bytes but the pool's blocks are {block_bytes} bytes; "
            "pass exactly one block per key"
        )


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, bytes | bytearray | str):
        raise InvalidArgumentError("keys must be a list of keys, not one key; wrap it in [...]")
    out = list(keys)
    for key in out:
        if type(key) is not bytes or not 1 <= len(key) <= MAX_KEY_BYTES:
            for i, bad in enumerate(out):  # say which key is wrong, and how
                check_key(bad, f"keys[{i}]")
    return out


def split_blocks(
    blocks: Any,
    count: int,
    block_bytes: int,
    *,
    name: str,
    writable: bool,
    dtype: str | None = None,
) -> list[BlockBuffer]:
    """Cut ``blocks`` (one array with a leading block axis, or a sequence of per-block arrays)
    into ``count`` block buffers, checking sizes, layout and ``dtype`` first."""
    if isinstance(blocks, np.ndarray) and blocks.ndim >= 1 and blocks.shape[0] == count:
        whole = _whole_host_array(blocks, count, block_bytes, name, writable, dtype)
        if whole is not None:
            return [
                BlockBuffer(whole[i * block_bytes : (i + 1) * block_bytes]) for i in range(count)
            ]
    if isinstance(blocks, list | tuple):
        items = list(blocks)
    elif hasattr(blocks, "shape") and len(blocks.shape) >= 1:
        if blocks.shape[0] != count:
            raise InvalidArgumentError(
                f"{name} has {blocks.shape[0]} blocks along its first axis but {count} keys "
                "were given; pass one block per key"
            )
        items = [blocks[i] for i in range(count)]
    else:
        raise InvalidArgumentError(
            f"{name} must be an array with a leading block axis or a list of per-block arrays, "
            f"got {type(blocks).__name__}"
        )
    if len(items) != count:
        raise InvalidArgumentError(
            f"{name} has {len(items)} blocks but {count} keys were given; pass one per key"
        )
    if dtype is not None:
        for i, item in enumerate(items):
            got = dtype_name(getattr(item, "dtype", "uint8"))
            if got != dtype:
                raise InvalidArgumentError(
                    f"{name}[{i}] has dtype {got} but this manager was configured for {dtype}"
                )
    return [_one_block(item, block_bytes, f"{name}[{i}]", writable) for i, item in enumerate(items)]


def _whole_host_array(
    arr: np.ndarray[Any, Any],
    count: int,
    block_bytes: int,
    name: str,
    writable: bool,
    dtype: str | None,
) -> memoryview | None:
    """One byte view of a stacked, contiguous numpy array, checked once instead of per block
    (the common case on the store path); None sends odd arrays through the per-block checks,
    which say exactly what is wrong."""
    if (
        arr.dtype.hasobject
        or not arr.flags.c_contiguous
        or (writable and not arr.flags.writeable)
        or (dtype is not None and dtype_name(arr.dtype) != dtype)
        or arr.nbytes != count * block_bytes
    ):
        return None
    return arr.reshape(-1).view(np.uint8).data
