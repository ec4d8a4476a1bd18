"""The shape of a CudaPool's own threads (its caller and each lane's waiter): one ordinary
Python thread, started on first use, that takes work from a queue under one condition and
that ``stop`` ends once the queue is empty, within a bound the pool's close can afford."""

from __future__ import annotations

import threading

__all__ = ["QueueThread"]


class QueueThread:
    """The condition, stop flag and thread a subclass's worker loop waits on; the subclass
    starts ``_thread`` and returns from its loop once ``_stopping`` is set and its queue is
    empty."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def stop(self, timeout: float) -> bool:
        """End the thread once its queue is empty (a worker thread calls this at close);
        False when it is still busy (in a call, or waiting on a copy) after ``timeout``
        seconds."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
