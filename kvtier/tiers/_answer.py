"""A tier that opens tells whoever opens it when its backend first answered.

An open can be slow for two reasons a manager must tell apart: the backend does not answer (an
endpoint that accepts connections and says nothing), or it answers and the open has work to do
after that (an S3 tier listing a large prefix inside its open). The first is worth waiting for
only briefly; the second is a healthy tier the manager should open with. So the opener listens
(``hearing_answers``, around the tier's ``open()``), and the tier calls the teller it takes at
the start of its open (``answer_teller``) once the backend has answered: the S3 tier when the
bucket's probe returns. The FS tier does not tell: its disk is local, a hung mount is bounded
by its own deadlines (it opens degraded), and a loaded machine may well take a second to
answer at start-up, which is no reason to open without it.

The listener travels in a context variable, so the tier's open takes no extra argument and an
open nobody listens to (a tier opened by hand, ``require_all_tiers``) tells no one. The teller
may be called from a worker thread: it reaches the event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["answer_teller", "hearing_answers"]

_listener: ContextVar[Callable[[], None] | None] = ContextVar("kvtier_answer", default=None)


@contextmanager
def hearing_answers(heard: Callable[[], None]) -> Iterator[None]:
    """Within this block, a tier's open that answers calls ``heard`` (on the event loop)."""
    token = _listener.set(heard)
    try:
        yield
    finally:
        _listener.reset(token)


def _tell_no_one() -> None:
    pass


def answer_teller() -> Callable[[], None]:
    """What the open in progress calls once its backend has answered, on the event loop or
    in a worker thread; it does nothing when no one listens. Taken on the event loop."""
    heard = _listener.get()
    if heard is None:
        return _tell_no_one
    loop = asyncio.get_running_loop()

    def tell() -> None:
        loop.call_soon_threadsafe(heard)

    return tell
