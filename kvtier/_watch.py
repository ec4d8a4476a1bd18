"""What a waiting scan sleeps on: which of the keys it watches changed, and an event to wait for.

The manager fires a ``KeyWatch`` once per registered key, at that key's next change (a verdict,
a promotion or a store landing), and forgets the registration; the scan asks only those keys
again and registers again the ones still pending. That keeps a long wait linear in the
prefix instead of rescanning it at every wake (issue 11).
"""

from __future__ import annotations

import anyio

__all__ = ["KeyWatch"]


class KeyWatch:
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
