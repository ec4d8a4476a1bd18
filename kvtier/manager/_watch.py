"""Change notification: who waits for which key, and what a waiter sleeps on.

The manager fires a ``KeyWatch`` once per registered key, at that key's next change (a verdict,
a promotion or a store landing), and forgets the registration; a waiting scan asks only those
keys again and registers again the ones still pending. That keeps a long wait linear in the
prefix instead of rescanning it at every wake.

``Watchers`` is the registry, a synchronous map from key to the watches registered on it. It
also remembers keys whose answer waits on another key (a tier hit not promoted yet because an
earlier key of the scan is still unknown): when that blocker changes, their watches fire too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["KeyWatch", "Watchers"]


class KeyWatch:
    """Collects the keys fired since the last ``take`` and wakes whoever waits on it.

    A waiter sleeps on a bare asyncio future made only when it is about to sleep: a request
    answered without waiting, or woken by keys that had already fired, never builds one.
    kvtier runs on asyncio, and an event or a cancel scope per wait cost a waiting request
    more loop time than its own bookkeeping (anyio's ask which event loop runs at every
    construction); a time bound is one timer on the loop (``wait``'s ``timeout``).
    """

    __slots__ = ("_changed", "_waiter", "lease")

    def __init__(self) -> None:
        self._changed: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        # The pins the waiter holds until it answers (a scheduler lookup's lease), or None.
        # A block promoted for a key it waits on is pinned into it as it lands (see
        # ``Watchers.leases``).
        self.lease: list[int] | None = None

    def fire(self, key: bytes) -> None:
        """``key`` may answer differently now (called by the manager)."""
        self._changed.append(key)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - one timer, no scope
        """Return once a key has fired since the last ``take`` (at once if one has; a
        checkpoint either way), or once ``timeout`` seconds have passed (None: no bound).
        True when a key has fired."""
        if self._changed:
            await asyncio.sleep(0)
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return bool(self._changed)

    def take(self) -> list[bytes]:
        """The keys fired since the last call, in firing order."""
        changed, self._changed = self._changed, []
        return changed


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Watchers:
    """Key -> the watches to fire at its next change, plus keys deferred until another's.

    A key almost always has one watch (one request waits on it), so that watch is held
    directly and a list only when a second joins: a list per registration was the largest
    share of the objects a waiting request kept alive, and those reach the collector's oldest
    generation, which makes its full passes come sooner.
    """

    __slots__ = ("_after", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[bytes, KeyWatch | list[KeyWatch]] = {}
        self._after: dict[bytes, list[bytes]] = {}  # blocker -> keys deferred until it changes

    def add(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        waiting = self._waiting
        for key in keys:
            current = waiting.get(key)
            if current is None:
                waiting[key] = watch
            elif isinstance(current, list):
                current.append(watch)
            else:
                waiting[key] = [current, watch]

    def remove(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        """Drop the registrations of ``watch`` on ``keys`` that have not fired."""
        waiting = self._waiting
        for key in keys:
            current = waiting.get(key)
            if current is None:
                continue
            if current is watch:
                del waiting[key]
            elif isinstance(current, list):
                if watch in current:
                    current.remove(watch)
                if not current:
                    del waiting[key]

    def leases(self, key: bytes) -> list[list[int]]:
        """The leases of the watches waiting on ``key`` that hold one (see ``KeyWatch``)."""
        watches = self._waiting.get(key)
        if watches is None:
            return []
        if isinstance(watches, list):
            return [w.lease for w in watches if w.lease is not None]
        return [] if watches.lease is None else [watches.lease]

    def after(self, blocker: bytes, key: bytes) -> None:
        """Fire ``key``'s watches too when ``blocker`` changes."""
        self._after.setdefault(blocker, []).append(key)

    def notify(self, key: bytes) -> None:
        """``key`` may answer differently now: fire its watches and those of the keys that
        waited on it."""
        if self._after:
            deferred = self._after.pop(key, None)
            if deferred:
                for other in deferred:
                    self.notify(other)
        watches = self._waiting.pop(key, None)
        if watches is None:
            return
        if isinstance(watches, list):
            for watch in watches:
                watch.fire(key)
        else:
            watches.fire(key)

    def fire_all(self) -> None:
        """Fire every watch and forget them all (the manager closed: nothing will change)."""
        self._after.clear()
        waiting, self._waiting = self._waiting, {}
        for key, watches in waiting.items():
            for watch in watches if isinstance(watches, list) else (watches,):
                watch.fire(key)

    def __len__(self) -> int:
        return len(self._waiting)
