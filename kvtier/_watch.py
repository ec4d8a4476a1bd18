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

from collections.abc import Iterable

import anyio

__all__ = ["KeyWatch", "Watchers"]


class KeyWatch:
    """Collects the keys fired since the last ``take`` and wakes whoever waits on it."""

    __slots__ = ("_changed", "_event")

    def __init__(self) -> None:
        self._changed: list[bytes] = []
        self._event = anyio.Event()

    def fire(self, key: bytes) -> None:
        """``key`` may answer differently now (called by the manager)."""
        self._changed.append(key)
        self._event.set()

    async def wait(self) -> None:
        """Return once a key has fired since the last ``take`` (at once if one has)."""
        await self._event.wait()

    def take(self) -> list[bytes]:
        """The keys fired since the last call, in firing order; re-arms the event."""
        changed, self._changed = self._changed, []
        if self._event.is_set():
            self._event = anyio.Event()
        return changed


class Watchers:
    """Key -> the watches to fire at its next change, plus keys deferred until another's."""

    __slots__ = ("_after", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[bytes, list[KeyWatch]] = {}
        self._after: dict[bytes, list[bytes]] = {}  # blocker -> keys deferred until it changes

    def add(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        waiting = self._waiting
        for key in keys:
            waiting.setdefault(key, []).append(watch)

    def remove(self, keys: Iterable[bytes], watch: KeyWatch) -> None:
        """Drop the registrations of ``watch`` on ``keys`` that have not fired."""
        for key in keys:
            watches = self._waiting.get(key)
            if watches is not None:
                if watch in watches:
                    watches.remove(watch)
                if not watches:
                    del self._waiting[key]

    def after(self, blocker: bytes, key: bytes) -> None:
        """Fire ``key``'s watches too when ``blocker`` changes."""
        self._after.setdefault(blocker, []).append(key)

    def notify(self, key: bytes) -> None:
        """``key`` may answer differently now: fire its watches and those of the keys that
        waited on it."""
        deferred = self._after.pop(key, None)
        if deferred:
            for other in deferred:
                self.notify(other)
        watches = self._waiting.pop(key, None)
        if watches:
            for watch in watches:
                watch.fire(key)

    def fire_all(self) -> None:
        """Fire every watch and forget them all (the manager closed: nothing will change)."""
        self._after.clear()
        waiting, self._waiting = self._waiting, {}
        for key, watches in waiting.items():
            for watch in watches:
                watch.fire(key)

    def __len__(self) -> int:
        return len(self._waiting)
