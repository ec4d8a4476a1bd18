"""What a closed manager must have given back: threads, tasks, file descriptors, sockets.

``Resources.now()`` counts them from /proc/self (file descriptors, and which of them are
sockets) and from the interpreter (threads, the loop's tasks). ``growth(before, after)`` is
what is left over after a close. Two kinds of thread are pools shared by the whole process,
not owned by a manager, and are left out: anyio's and kvtier's worker threads (kept idle for
reuse) and the loop's default executor's (kept until the loop closes); a thread a
manager starts and does not join shows up under any other name.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass

__all__ = ["Resources"]

_POOLED = ("AnyIO worker thread", "asyncio_", "kvtier worker")
_OWN = ".counters"  # the soak's own shared counters (the oracle maps other writers' lazily)


@dataclass(frozen=True)
class Resources:
    """What the process holds at one instant."""

    threads: frozenset[int]
    tasks: frozenset[int]
    fds: dict[int, str]  # descriptor -> what it is open on (its /proc/self/fd link)

    @classmethod
    def now(cls) -> Resources:
        threads = frozenset(
            t.ident or 0
            for t in threading.enumerate()
            if not t.name.startswith(_POOLED) and t.is_alive()
        )
        current = asyncio.current_task()
        tasks = frozenset(id(t) for t in asyncio.all_tasks() if t is not current)
        fds = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # the listing's own descriptor, closed already
        return cls(threads, tasks, fds)

    def new_fds(self, after: Resources) -> list[str]:
        """What the descriptors ``after`` holds beyond this snapshot are open on."""
        return sorted(
            t for fd, t in after.fds.items() if self.fds.get(fd) != t and not t.endswith(_OWN)
        )

    def growth(self, after: Resources) -> dict[str, int]:
        """What ``after`` holds beyond this snapshot (0 where it holds no more)."""
        new = self.new_fds(after)
        sockets = sum(t.startswith("socket:") for t in new)
        return {
            "threads": len(after.threads - self.threads),
            "tasks": len(after.tasks - self.tasks),
            "fds": len(new) - sockets,
            "sockets": sockets,
        }
