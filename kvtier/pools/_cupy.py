"""CuPy, the ``kvtier[cuda]`` extra, imported when first used, and the CUDA runtime calls
CudaPool makes through it.

``import kvtier`` and HostPool never import CuPy; CudaPool does when it is built, and says
which extra to install, or why no device is usable, when it cannot run.

``CudaRuntime`` is the one seam between CudaPool and CUDA: the handful of ``cudart`` calls the
pool makes, named and typed as ``cupy.cuda.runtime`` names them (raw handles and pointers as
ints). ``cupy_runtime()`` is that module plus the few driver calls it lacks (the current
context, a stream's context, the thread's graph-capture mode); the tests pass a stand-in with
the same calls (``devtools.fake_cuda``) so the pool's ordering, cancellation and close logic
runs without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any, Protocol, cast

from kvtier.common._errors import ExtraNotInstalledError, KVTierError

__all__ = [
    "CudaRuntime",
    "CudaUnavailableError",
    "cuda_available",
    "cupy_packages",
    "cupy_runtime",
    "device_count",
    "import_cupy",
    "use_device",
]


class CudaUnavailableError(KVTierError, RuntimeError):
    """CuPy is installed but no usable CUDA device is visible."""


class CudaRuntime(Protocol):
    """The CUDA runtime calls CudaPool makes, and HostPool for engine buffers on a GPU
    (``cupy_runtime()`` has them all: ``cupy.cuda.runtime`` plus three driver calls).

    No call of a copy is made on the event loop thread: CuPy holds the GIL in most wrappers, so
    even an enqueue call that blocks in the driver would freeze the loop. Copies are enqueued
    on the pool's CUDA thread (``_cuda_caller``), waited for on the lanes' waiter threads.
    ``eventQuery`` returns the raw status (0 done, 600 not ready, or an error code) instead of
    raising.
    """

    memcpyHostToDevice: int
    memcpyDeviceToHost: int
    memcpyDeviceToDevice: int
    streamNonBlocking: int
    eventBlockingSync: int
    eventDisableTiming: int
    memoryTypeHost: int
    streamCaptureModeRelaxed: int

    @property
    def CUDARuntimeError(self) -> type[Exception]: ...

    def getDeviceCount(self) -> int: ...
    def getDevice(self) -> int: ...
    def setDevice(self, device: int) -> None: ...
    def malloc(self, size: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def hostAlloc(self, size: int, flags: int) -> int: ...
    def freeHost(self, ptr: int) -> None: ...
    def hostRegister(self, ptr: int, size: int, flags: int) -> None: ...
    def hostUnregister(self, ptr: int) -> None: ...
    def memcpy(self, dst: int, src: int, size: int, kind: int) -> None: ...
    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None: ...
    def streamCreateWithFlags(self, flags: int) -> int: ...
    def streamDestroy(self, stream: int) -> None: ...
    def streamSynchronize(self, stream: int) -> None: ...
    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None: ...
    def eventCreateWithFlags(self, flags: int) -> int: ...
    def eventDestroy(self, event: int) -> None: ...
    def eventRecord(self, event: int, stream: int) -> None: ...
    def eventSynchronize(self, event: int) -> None: ...
    def eventQuery(self, event: int) -> int: ...
    def pointerGetAttributes(self, ptr: int) -> Any: ...
    def ctxGetCurrent(self) -> int: ...
    def streamGetCtx(self, stream: int) -> int: ...
    def threadExchangeStreamCaptureMode(self, mode: int) -> int: ...


@contextlib.contextmanager
def use_device(runtime: CudaRuntime, device: int) -> Iterator[None]:
    """``device`` current on the calling thread for the block.

    The previous device is restored only when the thread had a context before: on a thread
    that never chose a device, ``getDevice`` says 0 without any context existing, and
    switching "back" to 0 would create device 0's primary context (``cudaSetDevice`` does
    since CUDA 12), hundreds of MB of a GPU the pool never uses, in every process of a
    multi-GPU host. Such a thread keeps ``device`` current instead."""
    previous = runtime.getDevice()
    if previous == device:
        yield
        return
    had_context = runtime.ctxGetCurrent() != 0
    runtime.setDevice(device)
    if not had_context:
        yield
        return
    try:
        yield
    finally:
        runtime.setDevice(previous)


def cupy_packages(names: Iterable[str]) -> list[str]:
    """The CuPy builds among installed distribution ``names`` (``cupy``, ``cupy-cuda12x``,
    ``cupy-cuda13x``, ``cupy-rocm-*``), sorted."""
    found = set()
    for name in names:
        normal = name.lower().replace("_", "-")
        if normal == "cupy" or normal.startswith(("cupy-cuda", "cupy-rocm")):
            found.add(normal)
    return sorted(found)


def import_cupy() -> Any:
    """The cupy module, or an error that names the extra to install (or, when two CuPy
    builds are installed, which would make CuPy warn at import and misbehave, which to
    remove)."""
    installed = cupy_packages(d.metadata["Name"] or "" for d in metadata.distributions())
    if len(installed) > 1:
        raise CudaUnavailableError(
            f"several CuPy packages are installed ({', '.join(installed)}); the extras "
            "kvtier[cuda] and kvtier[cuda13] exclude each other: uninstall all but one"
        )
    try:
        import cupy
    except ImportError as exc:
        raise ExtraNotInstalledError("kvtier.CudaPool", "cuda", "cupy") from exc
    return cupy


class _CupyRuntime:
    """``cupy.cuda.runtime`` plus the calls CudaPool needs that it does not wrap: the
    current context and a stream's context (``cupy.cuda.driver``), and the calling thread's
    graph-capture mode (``cuThreadExchangeStreamCaptureMode``, from the driver library)."""

    def __init__(self, cupy: Any) -> None:
        self._runtime = cupy.cuda.runtime
        self._driver = cupy.cuda.driver
        self._libcuda: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def ctxGetCurrent(self) -> int:
        return int(self._driver.ctxGetCurrent())

    def streamGetCtx(self, stream: int) -> int:
        return int(self._driver.streamGetCtx(stream))

    def threadExchangeStreamCaptureMode(self, mode: int) -> int:
        if self._libcuda is None:
            name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
            self._libcuda = ctypes.CDLL(name)
        value = ctypes.c_int(mode)
        status = int(self._libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(value)))
        if status != 0:
            raise self._runtime.CUDARuntimeError(status)
        return value.value


def cupy_runtime() -> CudaRuntime:
    """``cupy.cuda.runtime`` (with the few driver calls it lacks), the runtime CudaPool uses
    unless it is given another."""
    return cast(CudaRuntime, _CupyRuntime(import_cupy()))


def device_count(runtime: CudaRuntime) -> int:
    """How many CUDA devices ``runtime`` sees; ``CudaUnavailableError`` (saying why) when
    none."""
    try:
        count = int(runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, driver too old, no device
        raise CudaUnavailableError(
            f"no CUDA device visible ({exc}); use kvtier.HostPool on machines without a GPU"
        ) from exc
    if count == 0:
        raise CudaUnavailableError(
            "no CUDA device visible; use kvtier.HostPool on machines without a GPU"
        )
    return count


def cuda_available() -> tuple[bool, str]:
    """Whether CudaPool can run here on CuPy, and why not (for skips and error messages)."""
    try:
        runtime = cupy_runtime()
    except ExtraNotInstalledError:
        return False, "no CUDA GPU: cupy not installed"
    except CudaUnavailableError as exc:
        return False, str(exc)
    try:
        count = device_count(runtime)
    except CudaUnavailableError as exc:
        return False, str(exc)
    return True, f"{count} CUDA device(s) visible"
