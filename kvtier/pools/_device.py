"""Engine buffers that live on a GPU (torch CUDA tensors, CuPy arrays, anything with
``__cuda_array_interface__``), seen as raw device pointers.

Both pools use this: CudaPool copies device-to-device between the pointer and a slot,
HostPool host<->device, each through the CUDA runtime seam. Nothing here imports torch or
CuPy at module level: a buffer's library is already imported when the engine hands us its
array.

Zero-copy: we never convert the engine's array; we read its data pointer (``data_ptr()`` for
torch, ``.data.ptr`` for CuPy, ``__cuda_array_interface__`` otherwise) and copy bytes to or from
it, which is what DLPack would give us too, without creating a capsule per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.common._errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvtier.pools._cupy import CudaRuntime

__all__ = [
    "DeviceArray",
    "current_stream",
    "device_array",
    "engine_stream_handle",
    "external_stream",
    "producer_stream",
    "stream_device",
    "stream_handle",
]


@dataclass(frozen=True, slots=True)
class DeviceArray:
    """One engine block on a GPU: the original object plus its pointer, size and device."""

    obj: Any
    ptr: int
    nbytes: int
    device: int
    framework: str  # "torch", "cupy" or "cai" (another producer of __cuda_array_interface__)


def _framework(obj: object) -> str:
    module = type(obj).__module__.split(".", 1)[0]
    if module in ("torch", "cupy"):
        return module
    if hasattr(obj, "__cuda_array_interface__"):
        return "cai"
    raise InvalidArgumentError(
        f"a GPU buffer must be a torch CUDA tensor, a CuPy array or expose "
        f"__cuda_array_interface__, got {type(obj).__name__}"
    )


def device_array(obj: Any, runtime: CudaRuntime | None = None) -> DeviceArray:
    """The pointer, byte size and device of a contiguous GPU array (checked by split_blocks).

    A foreign producer's ``__cuda_array_interface__`` is read directly, never through
    ``cupy.asarray``: that would synchronise the producer's stream on the calling thread (the
    event loop). Its device comes from ``runtime`` (CuPy's when not given).
    """
    framework = _framework(obj)
    if framework == "torch":
        return DeviceArray(
            obj, int(obj.data_ptr()), obj.numel() * obj.element_size(), obj.device.index, "torch"
        )
    if framework == "cupy":
        return DeviceArray(obj, int(obj.data.ptr), int(obj.nbytes), int(obj.device.id), "cupy")
    interface = obj.__cuda_array_interface__
    shape = tuple(int(n) for n in interface["shape"])
    itemsize = np.dtype(interface["typestr"]).itemsize
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, itemsize):
        raise InvalidArgumentError(f"GPU buffer of type {type(obj).__name__} must be C-contiguous")
    ptr = int(interface["data"][0])
    if runtime is None:
        from kvtier.pools._cupy import cupy_runtime

        runtime = cupy_runtime()
    device = int(runtime.pointerGetAttributes(ptr).device)
    return DeviceArray(obj, ptr, itemsize * math.prod(shape), device, "cai")


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def engine_stream_handle(arr: DeviceArray) -> int | None:
    """The raw handle of the stream ``arr``'s producer works on, for a copy to wait on; None
    when nothing needs waiting for (``__cuda_array_interface__`` without a stream). Call it
    on the loop thread: torch's and CuPy's current streams are thread-local."""
    if arr.framework == "cai":
        stream = arr.obj.__cuda_array_interface__.get("stream")
        return None if stream is None else int(stream)
    return stream_handle(current_stream(arr))


def producer_stream(obj: Any) -> int | None:
    """The raw handle of the stream the producer of GPU array ``obj`` works on now, read
    without a CUDA call: torch's or CuPy's current stream on the array's device, the stream
    a ``__cuda_array_interface__`` names (None when it names none). Call it on the engine's
    thread (the event loop): current streams are thread-local."""
    framework = _framework(obj)
    if framework == "torch":
        import torch

        return int(torch.cuda.current_stream(obj.device.index).cuda_stream)
    if framework == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream(obj.device.id).ptr)
    stream = obj.__cuda_array_interface__.get("stream")
    return None if stream is None else int(stream)


def current_stream(arr: DeviceArray) -> Any:
    """The engine's current stream for ``arr``'s device, as its library's stream object.

    Current streams are thread-local in torch and CuPy: call this on the engine's thread (the
    event loop), never in a worker.
    """
    if arr.framework == "torch":
        import torch

        return torch.cuda.current_stream(arr.device)
    import cupy

    if arr.framework == "cai":
        handle = arr.obj.__cuda_array_interface__.get("stream")
        if handle is not None:
            return external_stream(int(handle), arr.device)
    return cupy.cuda.get_current_stream(arr.device)


class _StreamRef:
    """A raw stream handle spoken through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def external_stream(handle: int, device: int) -> Any:
    """A CuPy stream object for a raw handle owned by someone else (the engine)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy 14+: ExternalStream is deprecated
        return from_external(_StreamRef(handle))
    return cupy.cuda.ExternalStream(handle, device)


def stream_handle(stream: Any) -> int:
    """A raw ``cudaStream_t`` from a torch stream, a CuPy stream, a CUDA-stream-protocol object
    or an int."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    if hasattr(stream, "__cuda_stream__"):  # the CUDA stream protocol: (version, handle)
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        return int(stream.ptr)
    raise InvalidArgumentError(
        "engine_stream must be a torch.cuda.Stream, a cupy.cuda.Stream, an object with "
        f"__cuda_stream__ or a raw stream handle (int), got {type(stream).__name__}"
    )


def stream_device(stream: Any) -> int | None:
    """The device of a torch or CuPy stream object; None when it does not say (a raw handle,
    a ``__cuda_stream__`` object)."""
    device = getattr(stream, "device", None)
    if device is not None and isinstance(getattr(device, "index", None), int):  # torch
        return int(device.index)
    device_id = getattr(stream, "device_id", None)  # cupy.cuda.Stream
    if isinstance(device_id, int) and device_id >= 0:
        return device_id
    return None
