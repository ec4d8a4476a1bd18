"""``openat2(2)``: a file below a folder descriptor opened in one call, never through a link.

The FS tier reaches a block file from its root without following a link (``_layout``). One
level at a time that is a walk of three opens and three closes per block; ``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` asks the kernel for the same
guarantee in one call (Linux 5.6 on), and with ``RESOLVE_CACHED`` (5.12 on) to answer only
from its caches, which is what the event loop's reads of page-cached blocks need
(``_cached``). Python has no binding for it, so it is called through ``ctypes``, which lets go
of the GIL for the call as ``os.open`` does.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

__all__ = [
    "AT_FDCWD",
    "RESOLVE_CACHED",
    "RESOLVE_NO_LINKS",
    "UNSUPPORTED",
    "Openat2",
]

# ``openat2(2)``'s number where the generic table is used (x86-64 shares it), and its flags.
_OPENAT2 = 437
_ARCHES = ("x86_64", "aarch64", "arm64", "riscv64")
AT_FDCWD = -100  # a path relative to the working folder (or absolute)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
RESOLVE_CACHED = 0x20
# Below the folder, through no link of any kind.
RESOLVE_NO_LINKS = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
# Errors that mean this kernel (or a filter in front of it) will never take the call.
UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EPERM)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


class Openat2:
    """The ``openat2`` system call where this platform has it (``on``)."""

    def __init__(self) -> None:
        linux = platform.system() == "Linux" and platform.machine() in _ARCHES
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall if linux else None

    @property
    def on(self) -> bool:
        return self._syscall is not None

    def off(self) -> None:
        """Never call it again (the kernel refused it)."""
        self._syscall = None

    def open(self, dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
        """A descriptor (close-on-exec), or -1 with the reason in ``ctypes.get_errno()``;
        -1 with ENOSYS when it is off."""
        syscall = self._syscall
        if syscall is None:
            ctypes.set_errno(errno.ENOSYS)
            return -1
        how = _OpenHow(flags | _O_CLOEXEC, 0, resolve)
        return int(syscall(_OPENAT2, dir_fd, path, ctypes.byref(how), ctypes.sizeof(how)))
