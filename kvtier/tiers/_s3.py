"""A secondary tier on any S3-compatible object store, through aiobotocore (design §3-4).

Several kvtier processes on several machines share one bucket: a prefix computed on one node
is a hit on every other. Objects live at ``<prefix>/<2 hex>/<hex key>`` (the two hex digits
spread keys over many key-name prefixes, which S3 partitions on) and hold the block format
of ``kvtier._format``: a header naming the key, with an xxh3 checksum of the payload that is
verified on every load. The checksum is also written to the object metadata.

Choices where the contract leaves room:

- ``lookup`` composes an ``AsyncLookupManager``: unknown keys answer RETRY while batched HEAD
  requests run with bounded concurrency; misses expire after ``miss_ttl`` so blocks written
  by other nodes become visible; hits are kept (a block is immutable under its key).
- A corrupt object (bad header, wrong key, wrong length, checksum mismatch) is a miss with
  reason ``corrupt`` and is **deleted**, so no node keeps paying for it and the next store
  of that key repairs it. The one exception: a header of a *newer* format version is
  skipped, not deleted, so a mixed-version fleet sharing a bucket never destroys the newer
  nodes' blocks.
- Stores send ``If-None-Match: *``: an object that exists is not rewritten (412 means
  "already there", a success). A server that rejects the header (501 / NotImplemented) is
  remembered and gets plain puts from then on: the idempotent overwrite is harmless because
  a key always names the same bytes and S3 puts are atomic.
- Loads stream the body straight into the destination (header first, then the payload read
  chunk by chunk into ``dst``): no whole-block copy besides the one from the socket buffer.
  Stores build one ``bytearray`` of header + payload (one copy of the block; botocore needs a
  single seekable body to sign and checksum it).
- Faults: botocore's own retries are off; kvtier retries transient faults (unreachable,
  timeouts, 5xx, throttling) ``max_attempts`` times with full-jitter backoff, and every
  attempt feeds a circuit breaker (``kvtier.tiers._s3_breaker``). While it is open, requests
  fail at once and ``lookup`` answers MISS (reason ``unavailable``) without queueing.
- Credentials are held by the botocore session only; they appear in no repr, log or message.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import struct
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import anyio

from kvtier._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    ExtraNotInstalledError,
    InvalidArgumentError,
    LifecycleError,
    TierError,
    TierUnavailableError,
)
from kvtier._format import (
    FORMAT_VERSION,
    MAGIC,
    HeaderError,
    checksum,
    decode_header,
    encode_header,
    header_size,
)
from kvtier._keys import check_key
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import SecondaryTier, TierMeter, TierStatistics
from kvtier.tiers._s3_breaker import BreakerState, CircuitBreaker, Permit, backoff_delay
from kvtier.tiers._s3_errors import Fault, translate

__all__ = ["S3Tier", "S3TierStatistics"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSE_TIMEOUT = 5.0
_META_CHECKSUM = "kvtier-checksum"
_META_FORMAT = "kvtier-format"
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")
_ADDRESSING = ("auto", "path", "virtual")


@dataclass(frozen=True, slots=True)
class S3TierStatistics(TierStatistics):
    """``TierStatistics`` plus what is particular to a remote store."""

    breaker_state: str = "closed"
    breaker_opened: int = 0
    requests_rejected_by_breaker: int = 0
    retries: int = 0
    stores_skipped_existing: int = 0
    corrupt_deleted: int = 0
    conditional_put: bool = True


def _positive(value: object, name: str, *, integer: bool = False) -> Any:
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = "a positive integer" if integer else "a positive number of seconds"
        raise InvalidArgumentError(f"{name} must be {what}, got {value!r}")
    return value


def _check_endpoint(endpoint_url: object) -> str | None:
    if endpoint_url is None:
        return None
    if not isinstance(endpoint_url, str):
        raise InvalidArgumentError(
            f"endpoint_url must be a URL string such as 'http://127.0.0.1:9000', got "
            f"{type(endpoint_url).__name__}"
        )
    parsed = urllib.parse.urlsplit(endpoint_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InvalidArgumentError(
            "endpoint_url must be an http:// or https:// URL with a host, such as "
            "'http://127.0.0.1:9000'"
        )
    if parsed.username is not None or parsed.password is not None:
        raise InvalidArgumentError(
            "endpoint_url must not carry credentials: pass aws_access_key_id and "
            "aws_secret_access_key (or use the AWS environment) instead"
        )
    if parsed.query or parsed.fragment:
        raise InvalidArgumentError("endpoint_url must not have a query or fragment")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise InvalidArgumentError("endpoint_url has an invalid port") from None
    return endpoint_url.rstrip("/")


def _check_optional_str(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty string or None")
    return value


class S3Tier(SecondaryTier):
    """Blocks as objects in an S3-compatible bucket, shared by every node that uses it.

    ``async with S3Tier("bucket", endpoint_url="http://127.0.0.1:9000") as tier`` opens one
    aiobotocore client and checks that the bucket is reachable (a clear error otherwise: no
    such bucket, access denied, endpoint unreachable). Credentials come from the arguments or
    from the standard AWS chain (environment, config files, instance roles).
    ``clock`` drives the miss TTL and the circuit breaker; tests pass a fake one.
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region_name: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        addressing_style: str = "auto",
        name: str = "s3",
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        max_attempts: int = 3,
        max_concurrency: int = 32,
        miss_ttl: float = 2.0,
        lookup_batch_size: int = 64,
        breaker_threshold: int = 5,
        breaker_reset: float = 5.0,
        lookup_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("name must be a non-empty string")
        super().__init__(name)
        if not isinstance(bucket, str) or not bucket:
            raise InvalidArgumentError("bucket must be a non-empty bucket name")
        if not _BUCKET_RE.match(bucket):
            raise InvalidArgumentError(
                f"bucket {bucket!r} is not a valid bucket name: use 3-255 letters, digits, "
                "'.', '-' or '_', starting and ending with a letter or digit"
            )
        if not isinstance(prefix, str):
            raise InvalidArgumentError("prefix must be a string such as 'kvtier/llama-8b'")
        prefix = prefix.strip("/")
        if "//" in prefix or len(prefix) > 512:
            raise InvalidArgumentError("prefix must not contain '//' and be at most 512 chars")
        if addressing_style not in _ADDRESSING:
            raise InvalidArgumentError(
                f"addressing_style must be one of {_ADDRESSING}, got {addressing_style!r}"
            )
        access_key = _check_optional_str(aws_access_key_id, "aws_access_key_id")
        secret_key = _check_optional_str(aws_secret_access_key, "aws_secret_access_key")
        token = _check_optional_str(aws_session_token, "aws_session_token")
        if (access_key is None) != (secret_key is None):
            raise InvalidArgumentError(
                "pass aws_access_key_id and aws_secret_access_key together (or neither, to "
                "use the AWS environment and config files)"
            )
        if token is not None and access_key is None:
            raise InvalidArgumentError("aws_session_token needs aws_access_key_id too")
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = _check_endpoint(endpoint_url)
        self.region_name = _check_optional_str(region_name, "region_name")
        self.addressing_style = addressing_style
        self.connect_timeout = float(_positive(connect_timeout, "connect_timeout"))
        self.read_timeout = float(_positive(read_timeout, "read_timeout"))
        self.max_attempts = _positive(max_attempts, "max_attempts", integer=True)
        self.max_concurrency = _positive(max_concurrency, "max_concurrency", integer=True)
        self.miss_ttl = float(_positive(miss_ttl, "miss_ttl"))
        self.lookup_batch_size = _positive(lookup_batch_size, "lookup_batch_size", integer=True)
        self.lookup_timeout = float(_positive(lookup_timeout, "lookup_timeout"))
        breaker_threshold = _positive(breaker_threshold, "breaker_threshold", integer=True)
        breaker_reset = float(_positive(breaker_reset, "breaker_reset"))
        # Imported here, not at module level, so `import kvtier` works without the extra.
        try:
            import aiobotocore.config
            import aiobotocore.session
        except ImportError as exc:
            raise ExtraNotInstalledError("S3Tier", "s3", "aiobotocore") from exc
        self._aiobotocore_session = aiobotocore.session
        self._aio_config = aiobotocore.config.AioConfig
        # Kept in a closure, not as attributes, so no repr or vars() dump shows them.
        self._credentials: Callable[[], dict[str, str]] = lambda: {
            k: v
            for k, v in (
                ("aws_access_key_id", access_key),
                ("aws_secret_access_key", secret_key),
                ("aws_session_token", token),
            )
            if v is not None
        }
        self._breaker = CircuitBreaker(breaker_threshold, breaker_reset, clock=clock)
        self._lookups = AsyncLookupManager(
            self.contains_many,
            name=name,
            batch_size=self.lookup_batch_size,
            max_concurrency=max(1, min(8, self.max_concurrency)),
            timeout=self.lookup_timeout,
            miss_ttl=self.miss_ttl,
            on_verdict=self.notify,
            clock=clock,
        )
        self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._meter = TierMeter()
        self._log = BurstLogger(logger)
        self._conditional_put = True
        self._breaker_misses = 0
        self._retries = 0
        self._skipped_existing = 0
        self._corrupt_deleted = 0

    # -- naming ------------------------------------------------------------------------------

    @property
    def _endpoint_label(self) -> str:
        if self.endpoint_url is not None:
            return self.endpoint_url
        return f"AWS S3 ({self.region_name or 'default region'})"

    def object_key(self, key: bytes) -> str:
        """The object name of ``key``: ``<prefix>/<2 hex>/<hex key>``."""
        hexkey = key.hex()
        shard = f"{hexkey[:2]}/{hexkey}"
        return f"{self.prefix}/{shard}" if self.prefix else shard

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._stack is not None

    async def open(self) -> None:
        """Create the client and probe the bucket; raise a TierError saying what is wrong."""
        if self._stack is not None:
            return
        config = self._aio_config(
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"total_max_attempts": 1},  # kvtier retries, so the breaker sees attempts
            max_pool_connections=self.max_concurrency,
            s3={"addressing_style": self.addressing_style},
        )
        session = self._aiobotocore_session.get_session()
        async with AsyncExitStack() as stack:
            try:
                self._client = await stack.enter_async_context(
                    session.create_client(
                        "s3",
                        endpoint_url=self.endpoint_url,
                        region_name=self.region_name,
                        config=config,
                        **self._credentials(),
                    )
                )
            except Exception as exc:
                raise self._translate(exc, "open", None) from exc
            stack.push_async_callback(self._forget_client)
            self._breaker.reset()
            probe = await self._call(
                "open",
                None,
                lambda: self._client.head_bucket(Bucket=self.bucket),
                expected=frozenset({Fault.NOT_FOUND}),
            )
            if probe is Fault.NOT_FOUND:
                raise TierUnavailableError(
                    f"bucket {self.bucket!r} does not exist at {self._endpoint_label}: create "
                    "it, or fix bucket= or endpoint_url=",
                    tier=self.name,
                    operation="open",
                )
            self._stack = stack.pop_all()
        # Entered outside the exit stack: its task group must be left in the task that entered
        # it and outside the shielded scope that bounds closing the client.
        await self._lookups.__aenter__()

    async def _forget_client(self) -> None:
        self._client = None

    async def aclose(self) -> None:
        """Stop the existence checks and close the client (shielded, time-bounded)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        await self._lookups.aclose()  # cancels its checks: returns promptly
        with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            await stack.aclose()

    def _require_client(self, operation: str) -> Any:
        if self._client is None:
            raise LifecycleError(
                f"S3Tier {self.name!r} is not open: use `async with tier` or a TieringManager "
                f"before {operation}"
            )
        return self._client

    # -- requests ------------------------------------------------------------------------------

    def _translate(self, exc: BaseException, operation: str, key: bytes | None) -> TierError:
        translated = translate(
            exc,
            tier=self.name,
            operation=operation,
            key=key,
            bucket=self.bucket,
            endpoint=self._endpoint_label,
        )
        if translated is None:
            return TierUnavailableError(
                f"unexpected {type(exc).__name__}", tier=self.name, operation=operation, key=key
            )
        return translated.error

    async def _call(
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
        for n in range(self.max_attempts):
            permit = self._breaker.allow()
            if permit is Permit.REJECTED:
                raise TierUnavailableError(
                    f"circuit breaker open: {self._endpoint_label} failed "
                    f"{self._breaker.threshold} times in a row; retrying after "
                    f"{self._breaker.reset_after} s",
                    tier=self.name,
                    operation=operation,
                    key=key,
                )
            settled = False
            try:
                async with self._limiter:
                    result = await attempt()
                self._breaker.success(permit)
                settled = True
                return result
            except Exception as exc:
                translated = translate(
                    exc,
                    tier=self.name,
                    operation=operation,
                    key=key,
                    bucket=self.bucket,
                    endpoint=self._endpoint_label,
                )
                if translated is None:
                    raise  # not a storage or network error: a bug, let it show
                settled = True
                if not translated.fault.endpoint_down:
                    self._breaker.success(permit)
                    if translated.fault in expected:
                        return translated.fault
                    raise translated.error from exc
                self._breaker.failure(permit)
                if n + 1 >= self.max_attempts or self._breaker.rejecting():
                    raise translated.error from exc
                self._retries += 1
            finally:
                if not settled:
                    self._breaker.abandon(permit)
            await anyio.sleep(backoff_delay(n))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the contract ------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if self._breaker.rejecting():
            self._breaker_misses += 1
            return LookupResult.MISS
        return self._lookups.lookup(key)

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        client = self._require_client("contains_many")
        found = [False] * len(keys)
        errors: list[TierError] = []

        async def head(i: int, key: bytes, scope: anyio.CancelScope) -> None:
            try:
                result = await self._call(
                    "contains",
                    key,
                    lambda: client.head_object(Bucket=self.bucket, Key=self.object_key(key)),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
            except TierError as exc:
                errors.append(exc)
                scope.cancel()  # one failure fails the batch: stop spending requests on it
            else:
                found[i] = result is not Fault.NOT_FOUND

        async with anyio.create_task_group() as tg:
            for i, key in enumerate(keys):
                tg.start_soon(head, i, key, tg.cancel_scope)
        if errors:
            raise errors[0]
        return found

    async def load(self, key: bytes, dst: memoryview) -> None:
        check_key(key)
        client = self._require_client("load")
        view = memoryview(dst)
        if view.readonly or not view.contiguous:
            raise InvalidArgumentError("dst must be a writable, contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        started = time.perf_counter()
        try:
            result = await self._call(
                "load",
                key,
                lambda: self._get_into(client, key, view),
                expected=frozenset({Fault.NOT_FOUND}),
            )
        except CorruptBlockError:
            self._meter.failed(MissReason.CORRUPT)
            self._lookups.record(key, False, MissReason.CORRUPT)
            raise
        except TierError as exc:
            self._meter.failed(exc.reason)
            raise
        if result is Fault.NOT_FOUND:
            self._meter.failed(MissReason.NOT_FOUND)
            self._lookups.record(key, False, MissReason.NOT_FOUND)
            raise BlockNotFoundError("no such object", tier=self.name, operation="load", key=key)
        self._meter.read(view.nbytes, time.perf_counter() - started)

    async def _get_into(self, client: Any, key: bytes, dst: memoryview) -> None:
        """One GET: stream the header, check it, then stream the payload into ``dst``."""
        response = await client.get_object(Bucket=self.bucket, Key=self.object_key(key))
        body = response["Body"]
        try:
            length = int(response.get("ContentLength", -1))
            head = bytearray(header_size(len(key)))
            got = await _read_into(body, memoryview(head))
            problem: str | None = None
            if got < len(head):
                problem = f"object is {got} bytes, shorter than a header"
            else:
                try:
                    header = decode_header(head)
                except HeaderError as exc:
                    problem = str(exc)
            if problem is None:
                if header.key != key:
                    problem = "object holds the block of another key"
                elif header.payload_length != length - len(head):
                    problem = (
                        f"object is {length} bytes, header says {len(head)} + "
                        f"{header.payload_length}"
                    )
                elif (meta := response.get("Metadata", {}).get(_META_CHECKSUM)) is not None and (
                    meta != f"{header.payload_checksum:016x}"
                ):
                    problem = "header checksum differs from the object metadata"
            if problem is not None:
                await self._discard_corrupt(client, key, bytes(head[:6]), problem)
            if header.payload_length != dst.nbytes:
                raise InvalidArgumentError(
                    f"dst holds {dst.nbytes} bytes but block {key.hex()} is "
                    f"{header.payload_length} bytes"
                )
            got = await _read_into(body, dst)
            if got != dst.nbytes or checksum(dst) != header.payload_checksum:
                await self._discard_corrupt(client, key, bytes(head[:6]), "checksum mismatch")
        finally:
            body.close()

    async def _discard_corrupt(
        self, client: Any, key: bytes, head: bytes, problem: str
    ) -> NoReturn:
        """Delete a corrupt object (unless it is a newer format) and raise CorruptBlockError."""
        newer = (
            len(head) == 6
            and head[:4] == MAGIC
            and struct.unpack_from("<H", head, 4)[0] > FORMAT_VERSION
        )
        if not newer:
            with anyio.move_on_after(self.read_timeout, shield=True):
                try:
                    await client.delete_object(Bucket=self.bucket, Key=self.object_key(key))
                    self._corrupt_deleted += 1
                except Exception as exc:
                    self._log.warning(
                        "corrupt-delete",
                        "%s: could not delete a corrupt object: %s",
                        self.name,
                        type(exc).__name__,
                    )
        self._log.warning(
            "corrupt",
            "%s: corrupt object %s (%s)%s",
            self.name,
            self.object_key(key),
            problem,
            "" if not newer else "; newer format, left in place",
        )
        raise CorruptBlockError(problem, tier=self.name, operation="load", key=key)

    async def store(self, key: bytes, src: memoryview) -> None:
        check_key(key)
        client = self._require_client("store")
        payload = memoryview(src).cast("B") if memoryview(src).format != "B" else memoryview(src)
        started = time.perf_counter()
        header = encode_header(key, payload)
        body = bytearray(len(header) + payload.nbytes)
        body[: len(header)] = header
        body[len(header) :] = payload
        metadata = {
            _META_CHECKSUM: f"{checksum(payload):016x}",
            _META_FORMAT: str(FORMAT_VERSION),
        }
        object_key = self.object_key(key)

        async def put() -> Any:
            extra = {"IfNoneMatch": "*"} if self._conditional_put else {}
            return await client.put_object(
                Bucket=self.bucket, Key=object_key, Body=body, Metadata=metadata, **extra
            )

        expected = frozenset({Fault.PRECONDITION, Fault.CONFLICT, Fault.UNSUPPORTED})
        try:
            result = await self._call("store", key, put, expected=expected)
            if result is Fault.UNSUPPORTED and self._conditional_put:
                logger.info("%s: the server rejects conditional puts; using plain puts", self.name)
                self._conditional_put = False
                result = await self._call("store", key, put, expected=expected)
        except TierError as exc:
            self._meter.failed(exc.reason)
            raise
        if result is Fault.UNSUPPORTED:
            self._meter.failed(MissReason.UNAVAILABLE)
            raise TierUnavailableError(
                "the server rejected the put as not implemented",
                tier=self.name,
                operation="store",
                key=key,
            )
        if result in (Fault.PRECONDITION, Fault.CONFLICT):
            self._skipped_existing += 1  # it is there (or being written): nothing to do
        else:
            self._meter.wrote(len(body), time.perf_counter() - started)
        self.record_hit(key)

    async def delete(self, key: bytes) -> None:
        check_key(key)
        client = self._require_client("delete")
        try:
            await self._call(
                "delete",
                key,
                lambda: client.delete_object(Bucket=self.bucket, Key=self.object_key(key)),
                expected=frozenset({Fault.NOT_FOUND}),
            )
        except TierError as exc:
            self._meter.failed(exc.reason)
            raise
        self._meter.deletes += 1
        self._lookups.forget(key)

    # -- feedback and statistics ---------------------------------------------------------------

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self._lookups.record(key, False, reason)

    def record_hit(self, key: bytes) -> None:
        self._lookups.record(key, True)

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    def statistics(self) -> S3TierStatistics:
        lookups = self._lookups.statistics()
        if self._breaker_misses:
            reasons = dict(lookups.misses_by_reason)
            reasons["unavailable"] = reasons.get("unavailable", 0) + self._breaker_misses
            lookups = dataclasses.replace(
                lookups, misses=lookups.misses + self._breaker_misses, misses_by_reason=reasons
            )
        base = self._meter.snapshot(self.name, lookups)
        return S3TierStatistics(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(TierStatistics)},
            breaker_state=self._breaker.state.value,
            breaker_opened=self._breaker.times_opened,
            requests_rejected_by_breaker=self._breaker.rejected,
            retries=self._retries,
            stores_skipped_existing=self._skipped_existing,
            corrupt_deleted=self._corrupt_deleted,
            conditional_put=self._conditional_put,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        where = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return (
            f"<S3Tier {self.name!r} s3://{where} endpoint={self._endpoint_label} "
            f"open={self.is_open} breaker={s.breaker_state} hits={s.lookups.hits} "
            f"misses={s.lookups.misses} pending={s.lookups.pending} "
            f"in_flight={s.lookups.in_flight} loads={s.loads} stores={s.stores}>"
        )


async def _read_into(body: Any, dst: memoryview) -> int:
    """Read from a streaming body until ``dst`` is full or the body ends; bytes read."""
    filled = 0
    while filled < dst.nbytes:
        n = await body.readinto(dst[filled:])
        if n == 0:
            break
        filled += n
    return filled
