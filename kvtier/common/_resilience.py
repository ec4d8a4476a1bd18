"""Fault handling for anything remote: a circuit breaker and retry backoff with full jitter.

Not tied to one store: any component that talks to a server composes them. When the server is
down, every request costs a connect timeout or a refused connection, and an engine doing
thousands of lookups per second would pile them up. The breaker counts consecutive availability
failures (unreachable, timeouts, 5xx, throttling); after ``threshold`` of them it *opens*:
requests fail at once and ``lookup()`` answers MISS (reason ``unavailable``) without queueing
anything. After ``reset_after`` seconds it lets one trial request through (*half-open*);
success closes it, failure opens it for another period. The breaker is a synchronous state
machine: callers ask ``allow()`` before a request and report ``success()`` or ``failure()``
after, so cancellation can never leave it half-updated (an abandoned trial is handed back with
``abandon()``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from enum import Enum, StrEnum

__all__ = ["BreakerState", "CircuitBreaker", "Permit", "backoff_delay"]

# Retry backoff: attempt n (0-based) waits uniform(0, min(CAP, BASE * 2**n)) seconds ("full
# jitter"), which spreads the retries of many clients instead of synchronising them.
BACKOFF_BASE = 0.05
BACKOFF_CAP = 2.0


def backoff_delay(attempt: int, *, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number ``attempt + 1``."""
    return float(rng()) * min(BACKOFF_CAP, BACKOFF_BASE * 2.0**attempt)


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Permit(Enum):
    REJECTED = "rejected"
    PASS = "pass"
    TRIAL = "trial"


class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive failures -> half-open after
    ``reset_after`` seconds (one trial request) -> closed on success, open on failure."""

    def __init__(
        self, threshold: int, reset_after: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = threshold
        self.reset_after = reset_after
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_out = False
        self.times_opened = 0
        self.rejected = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def trial_out(self) -> bool:
        """Half-open with its one trial request in flight: its outcome decides."""
        return self._state is BreakerState.HALF_OPEN and self._trial_out

    def rejecting(self) -> bool:
        """True while open and the reset period has not elapsed: requests would be refused.

        A pure read, cheap enough for ``lookup()``; it does not take the trial.
        """
        if self._state is BreakerState.OPEN:
            return self._clock() < self._opened_at + self.reset_after
        return self._state is BreakerState.HALF_OPEN and self._trial_out

    def allow(self) -> Permit:
        """May a request go out now? ``REJECTED``, ``PASS`` or ``TRIAL`` (the one request
        let through in half-open state); hand the permit back to ``success``/``failure``/
        ``abandon``."""
        if self._state is BreakerState.CLOSED:
            return Permit.PASS
        if self._state is BreakerState.OPEN:
            if self._clock() < self._opened_at + self.reset_after:
                self.rejected += 1
                return Permit.REJECTED
            self._state = BreakerState.HALF_OPEN
        if self._trial_out:
            self.rejected += 1
            return Permit.REJECTED
        self._trial_out = True
        return Permit.TRIAL

    def success(self, permit: Permit) -> None:
        """The endpoint answered (any answer, even 404 or 403: it is up)."""
        self._failures = 0
        if permit is Permit.TRIAL:
            self._trial_out = False
        self._state = BreakerState.CLOSED

    def failure(self, permit: Permit) -> None:
        """The endpoint did not answer usefully (unreachable, timeout, 5xx, throttled)."""
        self._failures += 1
        if permit is Permit.TRIAL:
            self._trial_out = False
            self._open()
        elif self._state is BreakerState.CLOSED and self._failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self.times_opened += 1
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()

    def abandon(self, permit: Permit) -> None:
        """A request holding ``permit`` was cancelled before it learnt anything."""
        if permit is Permit.TRIAL:
            self._trial_out = False

    def reset(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_out = False

    def __repr__(self) -> str:
        return (
            f"<CircuitBreaker {self._state.value} failures={self._failures}/{self.threshold} "
            f"opened={self.times_opened}>"
        )
