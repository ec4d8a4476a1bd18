"""CuPy, the ``kvtier[cuda]`` extra, imported when first used, and the CUDA runtime calls
CudaPool makes through it.

``import kvtier`` and HostPool never import CuPy; CudaPool does when it is built, and says
which extra to install, or why no device is usable, when it cannot run.

``CudaRuntime`` is the one seam between CudaPool and CUDA: the handful of ``cudart`` calls the
pool makes, named and typed as ``cupy.cuda.runtime`` names them (raw handles and pointers as
ints). ``cupy_runtime()`` is that module; the tests pass a stand-in with the same calls
(``devtools.fake_cuda``) so the pool's ordering, cancellation and close logic runs without a
GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata
from typing import Any, Protocol

from kvtier._errors import ExtraNotInstalledError, KVTierError

__all__ = [
    "CudaRuntime",
    "CudaUnavailableError",
    "cuda_available",
    "cupy_packages",
    "cupy_runtime",
    "device_count",
    "import_cupy",
]


class CudaUnavailableError(KVTierError, RuntimeError):
    """CuPy is installed but no usable CUDA device is visible."""


class CudaRuntime(Protocol):
    """The CUDA runtime calls CudaPool makes (``cupy.cuda.runtime`` has them all).

    Blocking calls (``eventSynchronize``, ``streamSynchronize``, ``free``, ``freeHost``)
    are only ever made off the event loop thread.
    """

    memcpyHostToDevice: int
    memcpyDeviceToHost: int
    memcpyDeviceToDevice: int
    streamNonBlocking: int
    eventBlockingSync: int
    eventDisableTiming: int

    @property
    def CUDARuntimeError(self) -> type[Exception]: ...

    def getDeviceCount(self) -> int: ...
    def getDevice(self) -> int: ...
    def setDevice(self, device: int) -> None: ...
    def malloc(self, size: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def hostAlloc(self, size: int, flags: int) -> int: ...
    def freeHost(self, ptr: int) -> None: ...
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
    def pointerGetAttributes(self, ptr: int) -> Any: ...


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


def cupy_runtime() -> CudaRuntime:
    """``cupy.cuda.runtime``, the runtime CudaPool uses unless it is given another."""
    runtime: CudaRuntime = import_cupy().cuda.runtime
    return runtime


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
