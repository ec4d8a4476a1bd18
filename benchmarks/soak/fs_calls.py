"""EIO and hung calls inside a worker's FS tier, armed by the coordinator, each counted.

A real disk that fails (EIO) or a mount that hangs cannot be had on demand, so a worker wraps
the two OS calls through which its ``FSTier`` moves every block's bytes in worker threads
(``kvtier.tiers.fs._write._writev`` and ``kvtier.tiers.fs._read._preadv``, the seams kvtier's
own tests patch; a kvtier that renamed them runs without these faults and says so in its log).
The coordinator arms faults through a small memory-mapped array (``CallControl``), one row
per worker slot, each a cumulative request count, so arming never races the worker:

- ``eio``: the next N calls fail with ``OSError(EIO)`` (counted as ``fs_eio``, one per call);
- ``hang``: the next N calls block for ``hang_ms`` (longer than the promotion and store
  deadlines, so the tier must walk away from them), then run (``fs_hang``, one per call).

The same wrapper counts every real ENOSPC the write call meets (``fs_enospc``: the small
tmpfs the soak puts the shared folder on filling up, or filled by the coordinator's ballast)
and publishes when it last met one (``CallControl.last_enospc``): a full disk makes the tier
evict, which the durability oracle must tell from a loss. Calls on the event loop's thread are
never faulted: a hang there would stall the whole worker, which no deadline can bound; nor
are calls on a block in a protected shard (``fs_faults.protected``): an armed fault waits for
the next call on any other block.

For the false-miss oracle the wrapper remembers, per block file name, when an injected fault
last hit a call on it (``last_hit``), and whether a hang is still in progress; the leak check
waits for hung calls to return, since a thread the tier abandoned keeps its descriptor until
its call ends.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.soak.fs_faults import protected
from benchmarks.soak.shared import Counters, _Array

__all__ = ["CallControl", "CallFaults"]

_FIELDS = ("eio", "hang", "hang_ms", "enospc_ns")


class CallControl(_Array):
    """Per worker slot: cumulative EIO requests, cumulative hang requests, hang length, and
    (written by the worker) when its write calls last met ENOSPC."""

    def __init__(self, path: str, workers: int, *, create: bool = False) -> None:
        self.workers = workers
        super().__init__(path, len(_FIELDS) * workers, create=create)

    def _at(self, worker: int, what: str) -> int:
        return worker * len(_FIELDS) + _FIELDS.index(what)

    def value(self, worker: int, what: str) -> int:
        return self.get(self._at(worker, what))

    def arm_eio(self, worker: int, calls: int) -> None:
        """The coordinator: worker's next ``calls`` calls fail with EIO."""
        self.set(self._at(worker, "eio"), self.value(worker, "eio") + calls)

    def mark_enospc(self, worker: int) -> None:
        """The worker: one of its write calls met ENOSPC just now."""
        self.set(self._at(worker, "enospc_ns"), time.monotonic_ns())

    def last_enospc(self, workers: list[int]) -> float:
        """When (``time.monotonic``, one clock for every process) any of ``workers`` last met
        ENOSPC (-1: never). An FS tier gives up blocks to make room only in a store that met
        ENOSPC, so a block that landed before this may have been evicted, as designed."""
        last = max((self.value(w, "enospc_ns") for w in workers), default=0)
        return last / 1e9 if last else -1.0

    def arm_hang(self, worker: int, calls: int, seconds: float) -> None:
        """The coordinator: worker's next ``calls`` calls block ``seconds`` each, then run."""
        self.set(self._at(worker, "hang_ms"), int(seconds * 1000))
        self.set(self._at(worker, "hang"), self.value(worker, "hang") + calls)


def _name_of(fd: int) -> str:
    """The block file name an fd is open on (a temporary file's final name), or ''."""
    try:
        base = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return ""
    return base.rsplit("-", 1)[-1] if base.startswith(".tmp-") else base


class CallFaults:
    """One worker process's injector (see the module docstring)."""

    def __init__(self, control: CallControl, worker: int, counters: Counters) -> None:
        self.control = control
        self.worker = worker
        self.counters = counters
        self._lock = threading.Lock()
        # Requests made before this incarnation started are not its own.
        self._eio_done = control.value(worker, "eio")
        self._hang_done = control.value(worker, "hang")
        self.hanging = 0
        self.last_hit: dict[str, float] = {}
        self.installed = False

    def install(self) -> bool:
        """Wrap the tier's read and write calls; False if kvtier no longer has them."""
        try:
            from kvtier.tiers.fs import _read, _write
        except ImportError:
            return False
        if not (hasattr(_write, "_writev") and hasattr(_read, "_preadv")):
            return False
        _write._writev = self._wrap(_write._writev, write=True)
        _read._preadv = self._wrap(_read._preadv, write=False)
        self.installed = True
        return True

    def _pending(self) -> bool:
        """An EIO or a hang is armed and not yet taken (two reads of the shared array)."""
        return (
            self.control.value(self.worker, "eio") > self._eio_done
            or self.control.value(self.worker, "hang") > self._hang_done
        )

    def _take(self, name: str) -> tuple[str, float]:
        """The fault this call on block file ``name`` gets: ('eio', 0), ('hang', seconds)
        or ('', 0). A call on a protected block (``fs_faults.protected``) leaves the armed
        fault to the next call."""
        if threading.current_thread() is threading.main_thread() or protected(name):
            return "", 0.0
        with self._lock:
            if self.control.value(self.worker, "eio") > self._eio_done:
                self._eio_done += 1
                self.counters.add("fs_eio")
                self.last_hit[name] = time.monotonic()
                return "eio", 0.0
            if self.control.value(self.worker, "hang") > self._hang_done:
                self._hang_done += 1
                self.counters.add("fs_hang")
                self.hanging += 1
                self.last_hit[name] = time.monotonic()
                return "hang", self.control.value(self.worker, "hang_ms") / 1000.0
        return "", 0.0

    def _wrap(self, call: Callable[..., int], *, write: bool) -> Callable[..., int]:
        def faulty(fd: int, *args: Any) -> int:
            kind, seconds = self._take(_name_of(fd)) if self._pending() else ("", 0.0)
            if kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO) + " (soak)")
            if kind == "hang":
                try:
                    time.sleep(seconds)
                finally:
                    with self._lock:
                        self.last_hit[_name_of(fd)] = time.monotonic()
                        self.hanging -= 1
            try:
                return call(fd, *args)
            except OSError as exc:
                if write and exc.errno == errno.ENOSPC:
                    with self._lock:
                        self.counters.add("fs_enospc")
                        self.control.mark_enospc(self.worker)
                raise

        return faulty

    def hit_since(self, name: str, since: float) -> bool:
        """An injected fault hit a call on block file ``name`` at or after ``since``."""
        with self._lock:
            return self.last_hit.get(name, -1.0) >= since

    async def wait_unhung(self, bound: float) -> None:
        """Wait (up to ``bound`` s) until no injected hang is still holding a thread."""
        for _ in range(int(bound / 0.05) + 1):
            if not self.hanging:
                return
            await asyncio.sleep(0.05)
