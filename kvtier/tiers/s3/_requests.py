"""Sending one S3 request: bounded concurrency, retries with backoff, and the circuit breaker.

``Requests.call(operation, key, attempt)`` runs ``attempt`` (one aiobotocore call) under the
tier's connection limit, retries transient faults (unreachable, timeouts, 5xx, throttling)
``max_attempts`` times with full-jitter backoff, and reports every attempt to the breaker.
Faults the caller expects (a 404 for a HEAD) come back as the ``Fault``; others raise the
translated ``TierError`` from the native error (``_errors``). While the half-open breaker's
one trial request is out, other requests wait for its outcome instead of being rejected.
"""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio

from kvtier.common._errors import KVTierError, TierError, TierUnavailableError
from kvtier.common._resilience import CircuitBreaker, Permit, backoff_delay
from kvtier.tiers.s3._errors import Fault, Translated, translate

__all__ = ["BYTES_BODY_LIMIT", "Call", "Requests", "acquire", "body_of", "get_bytes"]

T = TypeVar("T")

# Bodies up to this size go to aiohttp as ``bytes`` (one write); larger ones as a ``BytesIO``,
# which aiohttp sends chunk by chunk: it warns that one write of a larger ``bytes`` body may
# hold the event loop while the unsent part is copied (``_client.send_bodies_as_given``).
BYTES_BODY_LIMIT = 1 << 20


class Call(Protocol):
    """``Requests.call``'s signature, for the helpers that send requests through it."""

    async def __call__(
        self,
        operation: str,
        key: bytes | None,
        attempt: Callable[[], Awaitable[T]],
        *,
        expected: frozenset[Fault] = ...,
    ) -> T | Fault: ...


def body_of(data: bytes) -> bytes | io.BytesIO:
    """A PutObject ``Body`` for ``data``: itself up to ``BYTES_BODY_LIMIT``, a fresh
    ``BytesIO`` above (a new one per attempt: a retry re-reads it from the start)."""
    return data if len(data) <= BYTES_BODY_LIMIT else io.BytesIO(data)


async def get_bytes(
    client: Any, bucket: str, name: str, lo: int | None = None, hi: int | None = None
) -> bytes:
    """One GET of object ``name``, read whole: bytes ``lo:hi`` (``hi`` exclusive, fewer if
    the object is shorter) when given, else all of it."""
    extra = {} if lo is None or hi is None else {"Range": f"bytes={lo}-{hi - 1}"}
    response = await client.get_object(Bucket=bucket, Key=name, **extra)
    async with response["Body"] as body:
        data: bytes = await body.read()
    return data


async def acquire(limiter: anyio.CapacityLimiter) -> None:
    """Take one of ``limiter``'s tokens; the caller releases it (``limiter.release()``).

    A free token is taken at once: ``async with limiter`` always passes through the event
    loop first (a checkpoint), one more loop iteration per request and limiter, and a store
    goes through two. The
    request that follows is awaited at once, so cancellation is still seen there.
    """
    try:
        limiter.acquire_nowait()
    except anyio.WouldBlock:
        await limiter.acquire()


class Requests:
    """The request policy of one ``S3Tier`` (its breaker, limiter and retry counter)."""

    def __init__(
        self,
        *,
        name: str,
        bucket: str,
        endpoint_label: str,
        max_attempts: int,
        max_concurrency: int,
        breaker: CircuitBreaker,
    ) -> None:
        self.name = name
        self.bucket = bucket
        self._endpoint_label = endpoint_label
        self._max_attempts = max_attempts
        self._limiter = anyio.CapacityLimiter(max_concurrency)
        self._breaker = breaker
        self._trial_done = anyio.Event()
        self.retries = 0

    def _translated(
        self, exc: BaseException, operation: str, key: bytes | None
    ) -> Translated | None:
        return translate(
            exc,
            tier=self.name,
            operation=operation,
            key=key,
            bucket=self.bucket,
            endpoint=self._endpoint_label,
        )

    def _rejected(self, operation: str, key: bytes | None) -> TierUnavailableError:
        """The error of a request the open breaker refused."""
        return TierUnavailableError(
            f"circuit breaker open: {self._endpoint_label} failed {self._breaker.threshold} "
            f"times in a row; retrying after {self._breaker.reset_after} s",
            tier=self.name,
            operation=operation,
            key=key,
        )

    def translate(self, exc: BaseException, operation: str, key: bytes | None) -> TierError:
        translated = self._translated(exc, operation, key)
        if translated is None:
            return TierUnavailableError(
                f"unexpected {type(exc).__name__}", tier=self.name, operation=operation, key=key
            )
        return translated.error

    async def call(
        self,
        operation: str,
        key: bytes | None,
        attempt: Callable[[], Awaitable[T]],
        *,
        expected: frozenset[Fault] = frozenset(),
    ) -> T | Fault:
        """Run ``attempt`` with retries, backoff and the breaker.

        Faults in ``expected`` (e.g. NOT_FOUND for a HEAD) are answers, returned as the
        Fault; others raise the translated TierError ``from`` the native error.
        """
        attempts = self._max_attempts
        for n in range(attempts):
            permit = await self.permit()
            if permit is Permit.REJECTED:
                raise self._rejected(operation, key)
            settled = False
            try:
                await acquire(self._limiter)
                try:
                    result = await attempt()
                finally:
                    self._limiter.release()
                self._breaker.success(permit)
                settled = True
                return result
            except Exception as exc:
                translated = self._translated(exc, operation, key)
                settled = True
                if translated is None:
                    if isinstance(exc, KVTierError):  # ours (corrupt, bad dst): it answered
                        self._breaker.success(permit)
                    else:  # not a storage or network error: a bug, let it show
                        self._breaker.abandon(permit)
                    raise
                if not translated.fault.endpoint_down:
                    self._breaker.success(permit)
                    if translated.fault in expected:
                        return translated.fault
                    raise translated.error from exc
                self._breaker.failure(permit)
                if n + 1 >= attempts or self._breaker.rejecting():
                    raise translated.error from exc
                self.retries += 1
            finally:
                if not settled:
                    self._breaker.abandon(permit)
                if permit is Permit.TRIAL:
                    self._trial_done.set()
            await anyio.sleep(backoff_delay(n))
        raise AssertionError("unreachable")  # pragma: no cover

    async def permit(self) -> Permit:
        """The breaker's permit for one request. While the half-open trial is out, requests
        wait for its outcome instead of failing: a batch of requests sent together once the
        reset period is over (several HEADs, several loads) must not be rejected beside the
        trial, or worse, cancel it (the breaker would then never close)."""
        while self._breaker.trial_out:
            await self._trial_done.wait()  # the trial has its own timeouts
        permit = self._breaker.allow()
        if permit is Permit.TRIAL:
            self._trial_done = anyio.Event()
        return permit
