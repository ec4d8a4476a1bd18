"""The lifecycle every kvtier component that owns background work or connections shares.

An ``AsyncResource`` is an async context manager whose exit is its ``aclose()`` (anyio's
``AsyncResource``): ``async with component:`` and ``await component.aclose()`` end it the same
way, and ``aclose()`` is idempotent, so closing twice, or closing then leaving the block, is
harmless. A subclass writes ``__aenter__`` (opening) and ``aclose`` (closing) and nothing else.
"""

from __future__ import annotations

import types
from abc import ABC, abstractmethod

__all__ = ["AsyncResource"]


class AsyncResource(ABC):
    """Leaving ``async with`` awaits ``aclose()``, whatever ended the block."""

    __slots__ = ()

    @abstractmethod
    async def aclose(self) -> None:
        """Release what the resource holds; a second call does nothing."""

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()
