"""A secondary tier on any S3-compatible object store, through aiobotocore (design §3-4).

Several kvtier processes on several machines share one bucket: a prefix computed on one node
is a hit on every other. Objects live at ``<prefix>/<2 hex>/<hex key>`` (the two hex digits
spread keys over many key-name prefixes, which S3 partitions on) and hold the block format
of ``kvtier._format``: a header naming the key, with an xxh3 checksum of the payload that is
verified on every load. The checksum is also written to the object metadata. Stores that
reach the tier together share one *pack* object instead, and loads of blocks of one pack that
start together share one ranged GET (``_pack``, ``_packs``): on a small machine the
request, not the byte, is what an S3 block costs.

Choices where the contract leaves room:

- ``lookup`` answers from an existence index (``lookup_mode="index"``, the default;
  ``_index``): this node's own writes, a listing made at open, and the keys other nodes
  publish in a small per-writer journal that this tier polls every ``index_refresh`` seconds
  (``_journal``, ``_sync``). A key the index does not hold is a MISS at once
  (reason ``not_found``): the request path never waits on the object store for a block that
  cannot be there. Another node's write becomes a HIT here within about ``2 x
  index_refresh`` seconds. An indexed key whose GET finds nothing is a miss that removes it.
  ``lookup_mode="ask"`` keeps asking the server: it composes an ``AsyncLookupManager``
  (unknown keys answer RETRY while batched HEADs run; misses expire after ``miss_ttl``).
  Either way ``statistics().request_path_requests`` counts the requests sent because
  ``lookup()`` was asked about a key the index did not hold (0 in index mode).
- A corrupt object (bad header, wrong key, wrong length, checksum mismatch) is a miss with
  reason ``corrupt`` and is **deleted**, so no node keeps paying for it and the next store
  of that key repairs it. The DELETE runs in the tier's background, bounded by
  ``read_timeout``: it never holds the load (or the promotion waiting on it) past its
  deadline. Two exceptions, skipped rather than deleted: a header of a *newer*
  format version, so a mixed-version fleet sharing a bucket never destroys the newer nodes'
  blocks; and, for a tier without an integrity key, a signed block, which it cannot check and
  which may be a signing peer's (the prefix's marker normally keeps such a tier out). A
  pack section that fails its check is a corrupt miss that drops the key from the index, and
  the pack is kept (``_load_section`` says why).
- Stores send ``If-None-Match: *``: an object that exists is not rewritten (412 means
  "already there", a success). A server that rejects the header (501 / NotImplemented) is
  remembered and gets plain puts from then on: the idempotent overwrite is harmless because
  a key always names the same bytes and S3 puts are atomic.
- Loads copy each socket chunk of the body straight into ``dst`` and check the xxh3
  checksum over what was written there, chunk by chunk (``_codec.read_block``): one copy
  of the block and no worker-thread hop, so a load costs less client CPU than a raw GET and
  ``read()``. Stores build one ``bytes`` of
  header + payload (one copy of the block, one xxh3 pass, one CRC32 pass), sent as it is up
  to 1 MiB and through a ``BytesIO`` above (``_config.send_bodies_as_given``); the payload
  is not SHA-256 signed (the block carries its own checksum) and botocore adds checksums
  only where the operation requires them. Building runs on the event loop for blocks up to
  1 MiB (64 KiB when signed) and in a worker thread above, as does a signed load's MAC
  check: the hop costs as much CPU as the work on a 256 KiB block.
- Client CPU per request is what decides whether an S3 load beats recomputing the block on a
  machine with few cores: the client's configuration (``_config.client_config``) and the
  retry wrapper (``_requests``) are trimmed for it; ``benchmarks/bench_s3_cpu.py``
  measures it beside raw aiobotocore.
- Signed blocks: with ``integrity_key`` every object carries a keyed BLAKE2b MAC (see
  ``kvtier._format``) and only objects that verify are served; anything else (unsigned, or
  signed with another key) is a ``corrupt`` miss and is deleted. The prefix's marker
  (``_integrity``) names the key's public fingerprint, so a node with no key or another key
  refuses the prefix at open instead of deleting its peers' blocks; a signing tier refuses a
  prefix that already holds unsigned blocks.
- Faults: botocore's own retries are off; kvtier retries transient faults (unreachable,
  timeouts, 5xx, throttling) ``max_attempts`` times with full-jitter backoff, and every
  attempt feeds a circuit breaker (``kvtier._resilience``). While it is open, requests
  fail at once and ``lookup`` answers MISS (reason ``unavailable``) without queueing.
- Credentials given as arguments live in a closure handed to ``create_client``, not in
  attributes; error messages are built from error codes only (``_errors``), so they
  appear in no repr, log or message. One botocore session serves every tier of a process
  (like boto3's default session): its model files are parsed once, in a worker thread.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, NoReturn

import anyio
import anyio.abc
import anyio.to_thread

from kvtier._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    ExtraNotInstalledError,
    InvalidArgumentError,
    LifecycleError,
    TierError,
    TierUnavailableError,
)
from kvtier._format import FORMAT_VERSION, IntegrityKey, header_size
from kvtier._keys import check_key
from kvtier._logging import BurstLogger
from kvtier._lookup import LookupResult, MissReason
from kvtier._resilience import BreakerState, CircuitBreaker
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import SecondaryTier, TierMeter, TierStatistics
from kvtier.tiers.s3._codec import (
    META_FORMAT,
    build_object,
    is_newer_format,
    is_signed,
    read_block,
    verify_into,
)
from kvtier.tiers.s3._config import (
    BYTES_BODY_LIMIT,
    S3Settings,
    S3TierStatistics,
    check_credentials,
    client_config,
    send_bodies_as_given,
    shared_session,
    warm_session,
)
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._index import ExistenceIndex
from kvtier.tiers.s3._integrity import check_marker
from kvtier.tiers.s3._journal import writer_id
from kvtier.tiers.s3._pack import Location, encode_table, pack_body, pack_name
from kvtier.tiers.s3._packs import PackReads, PackWriter, PendingStore
from kvtier.tiers.s3._requests import Requests
from kvtier.tiers.s3._sync import IndexSync

__all__ = ["S3Tier", "S3TierStatistics"]

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT = 5.0
# Building and verifying objects: on the event loop when small, in a worker thread above
# these sizes. A hop costs ~0.04 ms of CPU and two loop wakeups, as much as building a 256 KiB
# object (0.07 ms; verifying it: 0.015 ms), so blocks up to 1 MiB stay on the loop (unsigned
# build 0.29 ms per MiB, verify 0.1 ms per MiB); signed blocks (BLAKE2b: build 1.3 ms,
# verify 1.0 ms per MiB) above 64 KiB go to the thread (2-core machine, loaded). An unsigned
# load streamed from aiohttp checks each chunk as it lands and never hops (_codec); the
# verify threshold applies to a body read whole (another HTTP backend).
_THREAD_BUILD_BYTES = 1 << 20
_THREAD_VERIFY_BYTES = (1 << 20) + 4096  # a 1 MiB payload and its header
_THREAD_SIGNED_BYTES = 64 << 10


class S3Tier(SecondaryTier):
    """Blocks as objects in an S3-compatible bucket, shared by every node that uses it.

    ``async with S3Tier("bucket", endpoint_url="http://127.0.0.1:9000") as tier`` opens one
    aiobotocore client and checks that the bucket is reachable (a clear error otherwise: no
    such bucket, access denied, endpoint unreachable). Credentials come from the arguments or
    from the standard AWS chain (environment, config files, instance roles).
    ``clock`` drives the miss TTL and the circuit breaker; tests pass a fake one.

    Index settings: ``lookup_mode`` ("index" or "ask"), ``index_refresh`` (seconds between
    journal rounds; bounds how soon another node's write is visible: about twice this),
    ``index_lookback`` (how far back a poll lists journal segments: covers a segment's PUT
    time and clock skew between nodes), ``index_list_timeout`` (bound on the listing at
    open), ``index_max_keys`` (bound on the index's memory).

    ``pack_blocks``: at most this many blocks stored together go into one object, a *pack*
    (``_pack``): one PUT, and one ranged GET for a node that needs them again; 1 keeps one
    object per block. Default 8 in the index mode; the ask mode needs 1 (a HEAD by key cannot
    see a block inside a pack).

    ``integrity_key`` (a secret of at least 16 bytes, or an ``IntegrityKey``): sign every block
    and serve only blocks signed with it; every node sharing the prefix must set the same one.
    It is never shown (``repr`` says ``signed=True``).
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
        lookup_mode: str = "index",
        index_refresh: float = 2.0,
        index_lookback: float = 60.0,
        index_list_timeout: float = 60.0,
        index_max_keys: int = 10_000_000,
        pack_blocks: int | None = None,
        integrity_key: str | bytes | IntegrityKey | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("name must be a non-empty string")
        self.integrity_key = (
            integrity_key
            if integrity_key is None or isinstance(integrity_key, IntegrityKey)
            else IntegrityKey(integrity_key)
        )
        super().__init__(name)
        self.settings = S3Settings.check(
            bucket,
            prefix=prefix,
            endpoint_url=endpoint_url,
            region_name=region_name,
            addressing_style=addressing_style,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            max_concurrency=max_concurrency,
            miss_ttl=miss_ttl,
            lookup_batch_size=lookup_batch_size,
            breaker_threshold=breaker_threshold,
            breaker_reset=breaker_reset,
            lookup_timeout=lookup_timeout,
            lookup_mode=lookup_mode,
            index_refresh=index_refresh,
            index_lookback=index_lookback,
            index_list_timeout=index_list_timeout,
            index_max_keys=index_max_keys,
            pack_blocks=pack_blocks,
        )
        self.write_batch = self.settings.pack_blocks
        credentials = check_credentials(aws_access_key_id, aws_secret_access_key, aws_session_token)
        # Imported here, not at module level, so `import kvtier` works without the extra.
        try:
            import aiobotocore.config
            import aiobotocore.session  # noqa: F401 - checked here; client_config uses them
        except ImportError as exc:
            raise ExtraNotInstalledError("S3Tier", "s3", "aiobotocore") from exc
        # Kept in a closure, not as attributes, so no repr or vars() dump shows them.
        self._credentials: Callable[[], dict[str, str]] = lambda: dict(credentials)
        cfg = self.settings
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix
        self._breaker = CircuitBreaker(cfg.breaker_threshold, cfg.breaker_reset, clock=clock)
        self._requests = Requests(
            name=name,
            bucket=cfg.bucket,
            endpoint_label=cfg.endpoint_label,
            max_attempts=cfg.max_attempts,
            max_concurrency=cfg.max_concurrency,
            breaker=self._breaker,
        )
        self._call = self._requests.call
        self._translate = self._requests.translate
        self._lookups = AsyncLookupManager(
            self._check_unindexed,
            name=name,
            batch_size=cfg.lookup_batch_size,
            max_concurrency=max(1, min(8, cfg.max_concurrency)),
            timeout=cfg.lookup_timeout,
            miss_ttl=cfg.miss_ttl,
            on_verdict=self.notify,
            clock=clock,
        )
        # Write-through is background work: it may use a quarter of the connections, so the
        # loads a waiting request needs are never queued behind a burst of stores.
        self._store_limiter = anyio.CapacityLimiter(max(1, cfg.max_concurrency // 4))
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._meter = TierMeter()
        self._log = BurstLogger(logger)
        self._conditional_put = True
        self._breaker_misses = 0
        self._skipped_existing = 0
        self._corrupt_deleted = 0
        self._locations_rejected = 0
        self._deleting: set[str] = set()  # corrupt objects being deleted in the background
        self._request_path_requests = 0
        self._index = ExistenceIndex(
            miss_ttl=cfg.miss_ttl, max_keys=cfg.index_max_keys, clock=clock, name=name
        )
        self._writer = writer_id()
        self._packs_sent = 0
        self._packer = PackWriter(
            max_blocks=cfg.pack_blocks,
            limiter=self._store_limiter,
            put_single=self._put_single,
            put_pack=self._put_pack,
        )
        self._pack_reads = PackReads(self._fetch_pack)
        self._sync = IndexSync(
            self._index,
            name=name,
            bucket=cfg.bucket,
            prefix=cfg.prefix,
            writer=self._writer,
            call=self._call,
            client=self._sync_client,
            notify=self.notify,
            refresh=cfg.index_refresh,
            lookback=cfg.index_lookback,
            list_timeout=cfg.index_list_timeout,
            read_journal=cfg.lookup_mode == "index",  # ask mode only publishes, for the others
            integrity_key=self.integrity_key,
        )
        self._task_group: anyio.abc.TaskGroup | None = None

    # -- naming ------------------------------------------------------------------------------

    @property
    def _endpoint_label(self) -> str:
        return self.settings.endpoint_label

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
        cfg = self.settings
        config = client_config(cfg)
        session = shared_session()
        await anyio.to_thread.run_sync(warm_session, session)
        async with AsyncExitStack() as stack:
            try:
                self._client = await stack.enter_async_context(
                    session.create_client(
                        "s3",
                        endpoint_url=cfg.endpoint_url,
                        region_name=cfg.region_name,
                        config=config,
                        **self._credentials(),
                    )
                )
            except Exception as exc:
                raise self._translate(exc, "open", None) from exc
            send_bodies_as_given(self._client)
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
            where = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
            self._conditional_put = await check_marker(
                self._call,
                self._client,
                bucket=self.bucket,
                prefix=self.prefix,
                integrity_key=self.integrity_key,
                conditional_put=self._conditional_put,
                tier=self.name,
                where=where,
            )
            if cfg.lookup_mode == "index":
                await self._sync.list_at_open()
            self._stack = stack.pop_all()
        # Entered outside the exit stack: task groups must be left in the task that entered
        # them and outside the shielded scope that bounds closing the client.
        await self._lookups.__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._task_group = tg
        tg.start_soon(self._sync.run)

    async def _forget_client(self) -> None:
        self._client = None

    async def aclose(self) -> None:
        """Stop the background work, publish the last keys written here, close the client.

        From the first line on, operations raise LifecycleError. The last publish and the
        client's close each run shielded within a time bound of their own, and the close
        runs whatever came before it: a publish hung on an endpoint that stopped answering
        must not leave the client's session and sockets open."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            tg, self._task_group = self._task_group, None
            if tg is not None:  # entered after the lookups' task group: left before it
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
            await self._lookups.aclose()  # cancels its checks: returns promptly
            with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                await self._sync.refresh_once(poll=False)  # publish the last keys written here
        finally:
            with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                await stack.aclose()
            self._client = None  # even if closing it ran out of time

    def _sync_client(self) -> Any:
        """The client for the listing at open and the last publish at close, which run while
        the tier is not open to other operations."""
        if self._client is None:
            raise LifecycleError(f"S3Tier {self.name!r} is not open")
        return self._client

    def _require_client(self, operation: str) -> Any:
        if self._stack is None or self._client is None:
            raise LifecycleError(
                f"S3Tier {self.name!r} is not open: use `async with tier` or a TieringManager "
                f"before {operation}"
            )
        return self._client

    # -- requests ------------------------------------------------------------------------------

    # -- the contract ------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if self._breaker.rejecting():
            self._breaker_misses += 1
            return LookupResult.MISS
        if self.settings.lookup_mode == "index":
            if self._task_group is None:
                return self._index.miss(MissReason.UNAVAILABLE)
            return self._index.lookup(key)
        return self._lookups.lookup(key)

    async def _check_unindexed(self, keys: list[bytes]) -> list[bool]:
        """The ``ask`` mode's existence checks: each is a request on the request path."""
        self._request_path_requests += len(keys)
        return await self.contains_many(keys)

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        client = self._require_client("contains_many")
        found = [False] * len(keys)
        errors: list[TierError] = []

        async def head(i: int, key: bytes, scope: anyio.CancelScope) -> None:
            where = self._index.location(key)
            name = self.object_key(key) if where is None else where.pack
            try:
                result = await self._call(
                    "contains",
                    key,
                    lambda: client.head_object(Bucket=self.bucket, Key=name),
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
        where = self._index.location(key)
        try:
            if where is not None:
                self._check_location(key, where, view.nbytes)
                result = await self._load_section(key, where, view)
            else:
                result = await self._call(
                    "load",
                    key,
                    lambda: self._get_into(client, key, view),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
        except CorruptBlockError:
            self._meter.failed(MissReason.CORRUPT)
            self.record_miss(key, MissReason.CORRUPT)
            raise
        except TierError as exc:
            self._meter.failed(exc.reason)
            raise
        if result is Fault.NOT_FOUND:
            self._meter.failed(MissReason.NOT_FOUND)
            self.record_miss(key, MissReason.NOT_FOUND)  # an index HIT that was stale
            raise BlockNotFoundError("no such object", tier=self.name, operation="load", key=key)
        self._meter.read(view.nbytes, time.perf_counter() - started)

    async def _get_into(self, client: Any, key: bytes, dst: memoryview) -> None:
        """One GET, streamed into ``dst``; a corrupt object is deleted and raised."""
        response = await client.get_object(Bucket=self.bucket, Key=self.object_key(key))
        try:
            problem, head = await read_block(
                response,
                key,
                dst,
                thread_bytes=_THREAD_VERIFY_BYTES
                if self.integrity_key is None
                else _THREAD_SIGNED_BYTES,
                integrity_key=self.integrity_key,
            )
        finally:
            response["Body"].close()
        if problem is not None:
            self._discard_corrupt(key, head, problem)

    def _check_location(self, key: bytes, where: Location, block_bytes: int) -> None:
        """Refuse, before any GET, a location that is not exactly a header and a block of
        ``block_bytes``: locations come from journal segments and pack tables, which anyone
        who can write the bucket can forge, and one claiming 2**40 bytes would otherwise make
        the load of one block download a whole object. A corrupt miss (the caller drops the
        entry); the pack is not touched."""
        expected = header_size(len(key), integrity_key=self.integrity_key) + block_bytes
        if where.length == expected:
            return
        self._locations_rejected += 1
        self._log.warning(
            "location",
            "%s: ignoring the index's location of %s: %d bytes at %s+%d, not a block's %d",
            self.name,
            key.hex(),
            where.length,
            where.pack,
            where.offset,
            expected,
        )
        raise CorruptBlockError(
            f"the index locates this block in {where.length} bytes, not {expected}",
            tier=self.name,
            operation="load",
            key=key,
        )

    async def _load_section(self, key: bytes, where: Location, dst: memoryview) -> Fault | None:
        """Load a packed block: its section comes with those of the same pack that other
        loads want now (one ranged GET, ``PackReads``), then is checked into ``dst``.

        A section that fails the check is a corrupt miss, and the pack is kept. A header that
        does not name ``key`` with the claimed length is evidence against the location (an
        index entry from a wrong or hostile journal segment), not against the pack; and a
        section that is ``key``'s but fails its checksum spoils only itself, since every other
        section carries its own header and checksum and stays servable to every node. S3
        cannot delete part of an object, deleting the pack would throw away its intact blocks
        on every node, and it would save nobody a request (a node still holding the location
        pays one GET either way, to find it damaged or gone). The caller drops the entry."""
        section = await self._pack_reads.read(where)
        if section is None:
            return Fault.NOT_FOUND
        thread_bytes = _THREAD_VERIFY_BYTES if self.integrity_key is None else _THREAD_SIGNED_BYTES
        verify = functools.partial(verify_into, section, key, dst, None, self.integrity_key)
        if section.nbytes > thread_bytes:
            problem, _head = await anyio.to_thread.run_sync(verify)
        else:
            problem, _head = verify()
        if problem is not None:
            self._log.warning(
                "corrupt",
                "%s: section of %s at %s+%d is not its block (%s); the pack is kept",
                self.name,
                key.hex(),
                where.pack,
                where.offset,
                problem,
            )
            raise CorruptBlockError(problem, tier=self.name, operation="load", key=key)
        return None

    async def _fetch_pack(self, name: str, lo: int, hi: int) -> bytes | None:
        """Bytes ``lo:hi`` of the pack ``name`` (fewer if it is shorter), None if it is gone."""
        client = self._require_client("load")

        async def get() -> bytes:
            response = await client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={lo}-{hi - 1}"
            )
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        # A range past the end (HTTP 416) means a pack shorter than its table: the short
        # answer is then caught as corrupt by each section's header check.
        expected = frozenset({Fault.NOT_FOUND, Fault.REJECTED})
        result = await self._call("load", None, get, expected=expected)
        if result is Fault.NOT_FOUND:
            return None
        return b"" if isinstance(result, Fault) else result

    def _discard_corrupt(self, key: bytes, head: bytes, problem: str) -> NoReturn:
        """Raise CorruptBlockError for ``key``'s corrupt object, after starting its delete in
        the background (unless it may be valid to other nodes: a newer format, or signed
        while this tier has no key)."""
        kept = ""
        if is_newer_format(head):
            kept = "; newer format, left in place"
        elif self.integrity_key is None and is_signed(head):
            kept = "; signed, and this tier has no integrity key: left in place"
        name = self.object_key(key)
        if not kept:
            self._delete_corrupt_soon(name)
        self._log.warning("corrupt", "%s: corrupt object %s (%s)%s", self.name, name, problem, kept)
        raise CorruptBlockError(problem, tier=self.name, operation="load", key=key)

    def _delete_corrupt_soon(self, name: str) -> None:
        """Start deleting the corrupt object ``name`` in the tier's task group. The load that
        found it fails at once: clean-up never holds a promotion (its slot, the request that
        waits on it) past its deadline. A closing tier starts none, and at most
        ``max_concurrency`` run at once; an object left in place is deleted by the next load
        that finds it."""
        tg = self._task_group
        busy = len(self._deleting) >= self.settings.max_concurrency
        if tg is None or busy or name in self._deleting:
            return
        self._deleting.add(name)
        tg.start_soon(self._delete_corrupt, name)

    async def _delete_corrupt(self, name: str) -> None:
        """One background delete of a corrupt object, bounded by ``read_timeout``."""
        try:
            client = self._require_client("delete")
            with anyio.move_on_after(self.settings.read_timeout) as scope:
                await self._call(
                    "delete",
                    None,
                    functools.partial(client.delete_object, Bucket=self.bucket, Key=name),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
                self._corrupt_deleted += 1
            if scope.cancelled_caught:
                self._log.warning(
                    "corrupt-delete",
                    "%s: deleting a corrupt object took over %.1f s; left in place",
                    self.name,
                    self.settings.read_timeout,
                )
        except Exception as exc:
            self._log.warning(
                "corrupt-delete",
                "%s: could not delete a corrupt object: %s",
                self.name,
                type(exc).__name__,
            )
        finally:
            self._deleting.discard(name)

    async def store(self, key: bytes, src: memoryview) -> None:
        check_key(key)
        self._require_client("store")
        if self.settings.lookup_mode == "index" and key in self._index:
            # Already in the bucket (written here, listed, or published by another node): a key
            # always names the same bytes, so there is nothing to send. If the object was
            # deleted meanwhile, the next GET finds out and drops it from the index.
            self._skipped_existing += 1
            return
        payload = memoryview(src).cast("B") if memoryview(src).format != "B" else memoryview(src)
        build = functools.partial(build_object, key, payload, integrity_key=self.integrity_key)
        limit = _THREAD_BUILD_BYTES if self.integrity_key is None else _THREAD_SIGNED_BYTES
        if payload.nbytes > limit:
            body, metadata, crc = await anyio.to_thread.run_sync(build)
        else:
            body, metadata, crc = build()
        # Sent alone, or packed with the stores that arrive with it (``_packs``).
        await self._packer.store(PendingStore(key, body, metadata, crc))

    async def _put_single(self, item: PendingStore) -> None:
        """One block as its own object, with a conditional put; the caller holds a slot."""
        client = self._require_client("store")
        key, body = item.key, item.body
        started = time.perf_counter()
        object_key = self.object_key(key)

        async def put() -> Any:
            extra = {"IfNoneMatch": "*"} if self._conditional_put else {}
            return await client.put_object(
                Bucket=self.bucket,
                Key=object_key,
                Body=body if len(body) <= BYTES_BODY_LIMIT else io.BytesIO(body),
                Metadata=item.metadata,
                ChecksumCRC32=item.crc,
                **extra,
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
        self._index.wrote(key)  # indexed now, published in the next journal segment
        self._lookups.record(key, True)

    async def _put_pack(self, items: list[PendingStore]) -> None:
        """Several blocks as one pack object (``_pack``); the caller holds a slot. A pack's
        name is unique to this writer, so it needs no conditional put."""
        client = self._require_client("store")
        started = time.perf_counter()
        keys = [item.key for item in items]
        lengths = [len(item.body) for item in items]
        self._packs_sent += 1
        name = pack_name(self.prefix, keys[0], self._writer, self._packs_sent)
        table = encode_table(keys, lengths)
        join = functools.partial(pack_body, table, [item.body for item in items])
        if sum(lengths) > _THREAD_BUILD_BYTES:
            body, crc = await anyio.to_thread.run_sync(join)
        else:
            body, crc = join()

        async def put() -> Any:
            return await client.put_object(
                Bucket=self.bucket,
                Key=name,
                Body=body if len(body) <= BYTES_BODY_LIMIT else io.BytesIO(body),
                Metadata={META_FORMAT: str(FORMAT_VERSION)},
                ChecksumCRC32=crc,
            )

        try:
            await self._call("store", None, put)
        except TierError as exc:
            self._meter.failed(exc.reason)
            raise
        seconds = (time.perf_counter() - started) / len(items)
        offset = len(table)
        for key, length in zip(keys, lengths, strict=True):
            self._meter.wrote(length, seconds)
            self._index.wrote(key, Location(name, offset, length))
            self._lookups.record(key, True)
            offset += length

    async def delete(self, key: bytes) -> None:
        """Delete ``key``'s object, and the pack that holds it if any: S3 cannot delete part
        of an object, so the pack's other blocks go too (misses from then on, on every node;
        this is a cache, and no block is ever served from a pack that is gone)."""
        check_key(key)
        client = self._require_client("delete")
        where = self._index.location(key)
        names = [self.object_key(key)] + ([where.pack] if where is not None else [])
        try:
            for name in names:
                await self._call(
                    "delete",
                    key,
                    functools.partial(client.delete_object, Bucket=self.bucket, Key=name),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
        except TierError as exc:
            self._meter.failed(exc.reason)
            raise
        self._meter.deletes += 1
        self._lookups.forget(key)
        self._index.discard(key)

    # -- feedback and statistics ---------------------------------------------------------------

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self._lookups.record(key, False, reason)
        self._index.suppress(key, reason)

    def record_hit(self, key: bytes) -> None:
        self._lookups.record(key, True)
        self._index.add(key)

    async def refresh_index(self) -> None:
        """Publish this node's new keys and read the other nodes' journals now, instead of at
        the next ``index_refresh`` (tests, and a node that wants a fresh view at once)."""
        self._require_client("refresh_index")
        await self._sync.refresh_once()

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    def statistics(self) -> S3TierStatistics:
        if self.settings.lookup_mode == "index":
            lookups = self._index.statistics()
        else:
            lookups = self._lookups.statistics()
        if self._breaker_misses:
            reasons = dict(lookups.misses_by_reason)
            reasons["unavailable"] = reasons.get("unavailable", 0) + self._breaker_misses
            lookups = dataclasses.replace(
                lookups, misses=lookups.misses + self._breaker_misses, misses_by_reason=reasons
            )
        base = dataclasses.replace(
            self._meter.snapshot(self.name, lookups),
            request_path_requests=self._request_path_requests,
        )
        return S3TierStatistics(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(TierStatistics)},
            breaker_state=self._breaker.state.value,
            breaker_opened=self._breaker.times_opened,
            requests_rejected_by_breaker=self._breaker.rejected,
            retries=self._requests.retries,
            stores_skipped_existing=self._skipped_existing,
            corrupt_deleted=self._corrupt_deleted,
            conditional_put=self._conditional_put,
            lookup_mode=self.settings.lookup_mode,
            index_keys=len(self._index),
            index_listed=self._index.listed,
            index_learnt=self._index.learnt,
            index_listing_complete=self._sync.listing_complete,
            index_refreshes=self._sync.refreshes,
            journal_segments_published=self._sync.segments_published,
            journal_segments_read=self._sync.segments_read,
            packs_written=self._packer.packs,
            blocks_packed=self._packer.packed_blocks,
            pack_gets=self._pack_reads.gets,
            pack_sections_read=self._pack_reads.sections,
            pack_bytes_read=self._pack_reads.bytes,
            index_evictions=self._index.evictions,
            index_locations_rejected=self._locations_rejected,
            index_refresh_failures=self._sync.refresh_failures,
            journal_segments_rejected=self._sync.segments_rejected,
            journal_entries_rejected=self._sync.entries_rejected,
            journal_clock_skew=self._sync.clock_skew,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        where = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return (
            f"<S3Tier {self.name!r} s3://{where} endpoint={self._endpoint_label} "
            f"open={self.is_open} signed={self.integrity_key is not None} "
            f"breaker={s.breaker_state} hits={s.lookups.hits} "
            f"misses={s.lookups.misses} pending={s.lookups.pending} "
            f"in_flight={s.lookups.in_flight} loads={s.loads} stores={s.stores}>"
        )
