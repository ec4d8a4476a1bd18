"""CuPy, the ``kvtier[cuda]`` extra, imported when first used, and the CUDA devices it sees.

``import kvtier`` and HostPool never import CuPy; CudaPool does when it is built, and says
which extra to install, or why no device is usable, when it cannot run.
"""

from __future__ import annotations

from typing import Any

from kvtier._errors import ExtraNotInstalledError, KVTierError

__all__ = ["CudaUnavailableError", "cuda_available", "device_count", "import_cupy"]


class CudaUnavailableError(KVTierError, RuntimeError):
    """CuPy is installed but no usable CUDA device is visible."""


def import_cupy() -> Any:
    """The cupy module, or an error that names the extra to install."""
    try:
        import cupy
    except ImportError as exc:
        raise ExtraNotInstalledError("kvtier.CudaPool", "cuda", "cupy") from exc
    return cupy


def device_count(cupy: Any) -> int:
    """How many CUDA devices CuPy sees; ``CudaUnavailableError`` (saying why) when none."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
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
    """Whether CudaPool can run here, and why not (for skips and error messages)."""
    try:
        cupy = import_cupy()
    except ExtraNotInstalledError:
        return False, "no CUDA GPU: cupy not installed"
    try:
        count = device_count(cupy)
    except CudaUnavailableError as exc:
        return False, str(exc)
    return True, f"{count} CUDA device(s) visible"
