"""``S3Tier``: the async shell over the S3 tier's core (see ``kvtier.tiers.s3``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, Unpack

import anyio
import anyio.abc
import anyio.to_thread

from kvtier.common._background import cancel_task_group, enter_task_group
from kvtier.common._describe import describe
from kvtier.common._errors import (
    ExtraNotInstalledError,
    InvalidArgumentError,
    LifecycleError,
    TierError,
    TierUnavailableError,
)
from kvtier.common._events import EventKind
from kvtier.common._format import IntegrityKey
from kvtier.common._identity import CacheIdentity, scoped_name
from kvtier.common._keys import check_key
from kvtier.common._lookup import LookupResult, MissReason
from kvtier.common._resilience import BreakerState
from kvtier.tiers._answer import answer_teller
from kvtier.tiers._async_lookup import AsyncLookupManager
from kvtier.tiers._base import SecondaryTier
from kvtier.tiers._checks import existence_checks
from kvtier.tiers.s3._blocks import BlockObjects
from kvtier.tiers.s3._client import (
    client_config,
    send_bodies_as_given,
    shared_session,
    warm_session,
)
from kvtier.tiers.s3._config import S3Config, S3Overrides, check_bucket_name
from kvtier.tiers.s3._core import S3Core, S3TierStatistics
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._integrity import OpenPlace, check_marker, claim_identity
from kvtier.tiers.s3._listing_xml import parse_listings_off_the_loop
from kvtier.tiers.s3._pack_format import PackTableError
from kvtier.tiers.s3._pack_table import read_table
from kvtier.tiers.s3._requests import Requests, acquire
from kvtier.tiers.s3.index._sync import IndexSync

__all__ = ["S3Tier"]

logger = logging.getLogger("kvtier.tiers.s3")

_CLOSE_TIMEOUT = 5.0
# HEADs in flight at once for lookups while the index loads without a snapshot directory.
_LOAD_HEADS = 4


class S3Tier(SecondaryTier):
    """Blocks as objects in an S3-compatible bucket, shared by every node that uses it.

    ``async with S3Tier("bucket", endpoint_url="http://127.0.0.1:9000") as tier`` opens one
    aiobotocore client and checks that the bucket is reachable (a clear error otherwise: no
    such bucket, access denied, endpoint unreachable). Settings come from ``config`` (an
    ``S3Config``; else the defaults) and keyword overrides, each named and checked there:
    credentials (else the standard AWS chain: environment, config files, instance roles),
    timeouts and limits, the existence index (``lookup_mode``, ``index_refresh``, ...) and
    ``pack_blocks``. ``clock`` drives the miss TTL and the circuit breaker; tests pass a
    fake one.

    ``integrity_key`` (a secret of at least 16 bytes, or an ``IntegrityKey``): sign every block
    and serve only blocks signed with it; every node sharing the prefix must set the same one.
    It is never shown (``repr`` says ``signed=True``). Neither are the credentials: they live
    in a closure handed to ``create_client``, and ``config`` keeps every setting but them.

    ``identity`` (a ``kvtier.CacheIdentity``): what the blocks are; recorded under the prefix
    at open, and a prefix that records another one is refused (or, with
    ``separate_identities``, each identity keeps its blocks under ``<prefix>/id-<digest>``).
    Without one the prefix is used as it is: you vouch for the keys' namespace.
    """

    tells_answer = True  # once the bucket's probe returns (``_probe``)

    def __init__(
        self,
        bucket: str,
        *,
        config: S3Config | None = None,
        integrity_key: str | bytes | IntegrityKey | None = None,
        identity: CacheIdentity | None = None,
        clock: Callable[[], float] = time.monotonic,
        **overrides: Unpack[S3Overrides],
    ) -> None:
        settings = S3Config.from_keywords(config, bucket=bucket, **overrides)
        check_bucket_name(settings.bucket)
        self.identity = identity
        if settings.separate_identities and identity is not None:  # else nothing to separate
            scoped = "/".join(p for p in (settings.prefix, scoped_name(identity)) if p)
            settings = dataclasses.replace(settings, prefix=scoped)
        self.integrity_key = (
            integrity_key
            if integrity_key is None or isinstance(integrity_key, IntegrityKey)
            else IntegrityKey(integrity_key)
        )
        super().__init__(settings.name)
        # Imported here, not at module level, so `import kvtier` works without the extra.
        try:
            import aiobotocore.config
            import aiobotocore.session  # noqa: F401 - checked here; client_config uses them
        except ImportError as exc:
            raise ExtraNotInstalledError("S3Tier", "s3", "aiobotocore") from exc
        credentials = settings.credentials
        # Kept in a closure, not as attributes, so no repr or vars() dump shows them.
        self._credentials: Callable[[], dict[str, str]] = lambda: dict(credentials)
        self.config = config = dataclasses.replace(
            settings, aws_access_key_id=None, aws_secret_access_key=None, aws_session_token=None
        )
        self.bucket, self.prefix = config.bucket, config.prefix
        self._lookups = self._new_lookups(config, clock)
        self._core = core = S3Core(
            config, integrity_key=self.integrity_key, lookups=self._lookups, clock=clock
        )
        # What it holds, for routers (``kvtier.common._events``): this node's stores and removals
        # (``_core``), and other nodes' from their journals as REMOTE events (``_sync``).
        self.events = core.events
        core.events.shared, core.events.storage = True, "object"  # every node on the prefix
        # The core's parts that ``lookup`` reads, bound once: it costs about a dict lookup.
        self._breaker, self._index, self._index_mode = core.breaker, core.index, core.index_mode
        self.write_batch = core.pack_blocks
        self._requests = Requests(
            name=self.name,
            bucket=config.bucket,
            endpoint_label=config.endpoint_label,
            max_attempts=config.max_attempts,
            max_concurrency=config.max_concurrency,
            breaker=core.breaker,
        )
        self._blocks = BlockObjects(
            core, self._requests, client=self._require_client, task_group=self._background
        )
        self._sync = self._new_sync(core)
        self._load_heads = anyio.CapacityLimiter(_LOAD_HEADS)
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._task_group: anyio.abc.TaskGroup | None = None

    def _new_lookups(self, config: S3Config, clock: Callable[[], float]) -> AsyncLookupManager:
        """The existence checks of the ask mode, and of the index mode while the index loads
        in the background: batched checks of keys asked about (``_check_unindexed``;
        bounded: a few batches at once, a bounded queue)."""
        return existence_checks(self, self._check_unindexed, config, most=8, clock=clock)

    def _new_sync(self, core: S3Core) -> IndexSync:
        """The listing at open and the journal loop that keep ``core.index`` current."""
        return IndexSync(
            core.index,
            core.config,
            name=self.name,
            writer=core.writer,
            call=self._requests.call,
            client=self._sync_client,
            notify=self._learnt,
            forgot=self._forgot,
            read_journal=core.index_mode,  # ask mode only publishes, for the others
            integrity_key=self.integrity_key,
        )

    def _learnt(self, keys: list[bytes]) -> None:
        """Keys another node stored, read from its journal: REMOTE stored events, then the
        listeners."""
        self.events.emit(EventKind.STORED, keys, locality="REMOTE")
        self.notify(keys)

    def _forgot(self, keys: list[bytes], why: str) -> None:
        """Keys another node deleted (``why``: as it published), dropped from the index:
        REMOTE removed events, then the listeners; keys the audit found gone (``not_found``:
        nobody announced them) are this node's finding, LOCAL as a load's."""
        local = why == MissReason.NOT_FOUND.value
        self.events.emit(
            EventKind.REMOVED, keys, locality="LOCAL" if local else "REMOTE", reason=why
        )
        self.notify(keys)

    def object_key(self, key: bytes) -> str:
        """The object name of ``key``: ``<prefix>/<2 hex>/<hex key>``."""
        return self._core.object_key(key)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._stack is not None

    async def open(self) -> None:
        """Create the client and probe the bucket; raise a TierError saying what is wrong."""
        if self._stack is not None:
            return
        config = self.config
        session = shared_session()
        await self.warm_up()
        async with AsyncExitStack() as stack:
            try:
                self._client = await stack.enter_async_context(
                    session.create_client(
                        "s3",
                        endpoint_url=config.endpoint_url,
                        region_name=config.region_name,
                        config=client_config(config),
                        **self._credentials(),
                    )
                )
            except Exception as exc:
                raise self._requests.translate(exc, "open", None) from exc
            send_bodies_as_given(self._client)
            parse_listings_off_the_loop(self._client)
            stack.push_async_callback(self._forget_client)
            self._breaker.reset()
            await self._probe()
            if self._index_mode and config.index_background_load:
                self._sync.begin_load()  # the journal loop loads it (IndexSync.run)
            elif self._index_mode:
                await self._sync.list_at_open()
            self._stack = stack.pop_all()
        # Entered outside the exit stack: task groups must be left in the task that entered
        # them and outside the shielded scope that bounds closing the client.
        await self._lookups.__aenter__()
        self._task_group = tg = await enter_task_group()
        tg.start_soon(self._sync.run)

    async def warm_up(self) -> None:
        """Prepare what opening needs from this process alone: botocore's S3 model, parsed
        once per process in a worker thread (about a second in a fresh process on a busy
        machine). ``open()`` does it first; a ``TieringManager`` does it before it starts
        its ``tier_open_wait``, which bounds how long an endpoint may take to answer, not
        how long a process takes to start. Idempotent."""
        await anyio.to_thread.run_sync(warm_session, shared_session())

    async def _probe(self) -> None:
        """Check that the bucket is there, then the prefix's integrity marker. The bucket's
        answer, whatever it is, tells the opener the endpoint answers (``_answer``)."""
        core, client = self._core, self._client
        probe = await self._requests.call(
            "open",
            None,
            lambda: client.head_bucket(Bucket=self.bucket),
            expected=frozenset({Fault.NOT_FOUND}),
        )
        answer_teller()()  # the endpoint answered: what is left of the open is this tier's
        if probe is Fault.NOT_FOUND:
            raise TierUnavailableError(
                f"bucket {self.bucket!r} does not exist at {self.config.endpoint_label}: "
                "create it, or fix bucket= or endpoint_url=",
                tier=self.name,
                operation="open",
            )
        place = OpenPlace(self._requests.call, client, self.bucket, self.prefix, self.name)
        core.conditional_put = await check_marker(
            place,
            integrity_key=self.integrity_key,
            conditional_put=core.conditional_put,
            where=core.where,
        )
        if self.identity is not None:
            core.conditional_put = await claim_identity(
                place, identity=self.identity, conditional_put=core.conditional_put
            )

    async def _forget_client(self) -> None:
        self._client = None

    async def aclose(self) -> None:
        """Stop the background work, publish the last keys written here, close the client.

        From the first line on, operations raise LifecycleError. Both task groups are left,
        in the order they were entered, even when the caller is cancelled meanwhile: a group
        left entered would keep its tasks running and break the caller's cancel scopes. The
        last publish and the client's close each run shielded within a time bound of their
        own, and the close runs whatever came before it: a publish hung on an endpoint that
        stopped answering must not leave the client's session and sockets open."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            tg, self._task_group = self._task_group, None
            try:
                if tg is not None:  # entered after the lookups' task group: left before it
                    await cancel_task_group(tg)  # nothing in it is shielded: returns promptly
            finally:  # even when the caller is cancelled meanwhile (a manager's open_timeout)
                self._sync.load.end()  # a load cut short by the close: its waiters return
                await self._lookups.aclose()  # cancels its checks: returns promptly
            with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                await self._sync.refresh_once(poll=False)  # publish the last keys written here
        finally:
            with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                await stack.aclose()
            self._client = None  # even if closing it ran out of time

    def _background(self) -> anyio.abc.TaskGroup | None:
        """The task group of background work (corrupt deletes); None while closed."""
        return self._task_group

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

    # -- the contract ------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if self._breaker.rejecting():
            self._core.breaker_misses += 1
            return LookupResult.MISS
        if self._index_mode:
            index = self._index
            if self._task_group is None:
                return index.miss(MissReason.UNAVAILABLE)
            if index.loading and key not in index:  # not brought yet: ask the bucket
                return self._lookups.lookup(key)
            return index.lookup(key)
        return self._lookups.lookup(key)

    def lookup_with_reason(self, key: bytes) -> tuple[LookupResult, MissReason | None]:
        if self._breaker.rejecting():
            self._core.breaker_misses += 1
            return LookupResult.MISS, MissReason.UNAVAILABLE
        if self._index_mode:
            index = self._index
            if self._task_group is None:
                return index.miss(MissReason.UNAVAILABLE), MissReason.UNAVAILABLE
            if index.loading and key not in index:  # not brought yet: ask the bucket
                return self._lookups.lookup_with_reason(key)
            return index.lookup_with_reason(key)
        return self._lookups.lookup_with_reason(key)

    async def _check_unindexed(self, keys: list[bytes]) -> list[bool]:
        """The existence checks of keys the index does not hold: in the ``ask`` mode, each
        a request on the request path (a HEAD). While the index loads in the background:
        the snapshot chunks that hold them, fetched through the snapshot's directory
        (packed keys included: a HEAD by key sees the key's own object, never a block inside
        a pack), then the index answers as the loaded one will; without a directory, a HEAD
        of each key's own object, ``_LOAD_HEADS`` at a time (each request costs the event
        loop CPU: a burst of them while the engine serves would hold its loop). Those are
        counted in ``index_load_requests``."""
        core, index = self._core, self._index
        if not (self._index_mode and index.loading):
            core.request_path_requests += len(keys)
            return await self.contains_many(keys)
        unsettled = await self._sync.bring(keys)
        rest = [k for k in keys if k not in index and (unsettled is None or k in unsettled)]
        core.index_load_requests += len(rest)
        found = dict(zip(rest, await self._heads(rest, self._load_heads), strict=True))
        return [key in index or found.get(key, False) for key in keys]

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        return await self._heads(keys, None)

    async def _heads(self, keys: list[bytes], limiter: anyio.CapacityLimiter | None) -> list[bool]:
        """A HEAD per key (of its pack where the index places it), all at once or, with
        ``limiter``, as many at once as it allows."""
        if not keys:
            return []
        client = self._require_client("contains_many")
        found = [False] * len(keys)
        errors: list[TierError] = []

        async def head(i: int, key: bytes, scope: anyio.CancelScope) -> None:
            where = self._index.location(key)
            name = self._core.object_key(key) if where is None else where.pack
            try:
                if limiter is not None:
                    await acquire(limiter)
                try:
                    result = await self._requests.call(
                        "contains",
                        key,
                        lambda: client.head_object(Bucket=self.bucket, Key=name),
                        expected=frozenset({Fault.NOT_FOUND}),
                    )
                finally:
                    if limiter is not None:
                        limiter.release()
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
        self._require_client("load")
        view = memoryview(dst)
        if view.readonly or not view.contiguous:
            raise InvalidArgumentError("dst must be a writable, contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        await self._blocks.load(key, view)

    async def store(self, key: bytes, src: memoryview) -> None:
        check_key(key)
        self._require_client("store")
        if self._core.should_skip_store(key):
            return
        payload = memoryview(src).cast("B") if memoryview(src).format != "B" else memoryview(src)
        await self._blocks.store(key, payload)

    async def delete(self, key: bytes) -> None:
        """Delete ``key``'s object, and the pack that holds it if any: S3 cannot delete part
        of an object, so the pack's other blocks go too (misses from then on, on every node;
        this is a cache, and no block is ever served from a pack that is gone). The pack's
        table is read first, so its other keys that the index places in it are removed with
        it: announced as removed and published at the next journal refresh, as the key is
        (a table that cannot be read leaves them to be found gone at their next load)."""
        check_key(key)
        client = self._require_client("delete")
        core = self._core
        where = self._index.location(key)
        pack = None if where is None else where.pack
        names = [core.object_key(key)] + ([pack] if pack is not None else [])
        neighbours = [] if pack is None else await self._pack_neighbours(client, key, pack)
        try:
            for name in names:
                await self._requests.call(
                    "delete",
                    key,
                    functools.partial(client.delete_object, Bucket=self.bucket, Key=name),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
        except TierError as exc:
            core.meter.failed(exc.reason)
            raise
        core.meter.deletes += 1
        core.deleted(key, "deleted")
        for other in neighbours:
            if (place := self._index.location(other)) is not None and place.pack == pack:
                core.deleted(other, "deleted")  # still placed in the pack that is gone

    async def _pack_neighbours(self, client: Any, key: bytes, pack: str) -> list[bytes]:
        """The other keys pack ``pack``'s table names (none if it cannot be read)."""
        try:
            entries = await read_table(
                self._requests.call, client, self.bucket, pack, "delete", key
            )
        except (PackTableError, TierError) as exc:
            logger.warning(
                "%s: could not read the table of pack %s before deleting it (%s): its other "
                "blocks are found gone at their next load",
                self.name,
                pack,
                exc,
            )
            return []
        return [other for other, _ in entries if other != key]

    # -- feedback and statistics ---------------------------------------------------------------

    def record_miss(self, key: bytes, reason: MissReason) -> None:
        self._core.record_miss(key, reason)

    def record_hit(self, key: bytes) -> None:
        self._core.record_hit(key)

    async def refresh_index(self) -> None:
        """Publish this node's new keys and read the other nodes' journals now, instead of at
        the next ``index_refresh`` (tests, and a node that wants a fresh view at once). A
        load at open still running is part of that view: it ends first, so that one journal
        read never runs beside another."""
        self._require_client("refresh_index")
        await self._sync.load.wait()
        await self._sync.refresh_once(full=True)

    async def audit_index(self) -> None:
        """List the prefix and settle the index against it now, whoever's turn it is (tests,
        and an operator after a lifecycle rule or a cleanup by hand): blocks the listing has
        that the index lacks are indexed and published; keys it lacks are checked with a
        HEAD at the next refresh round, then dropped and published (``_audit``). Raises
        ``TierError`` when a request fails and ``TimeoutError`` past
        ``index_list_timeout``."""
        self._require_client("audit_index")
        if not self._index_mode:
            raise InvalidArgumentError(
                f"S3Tier {self.name!r} is in the ask mode: it keeps no index to audit"
            )
        await self._sync.load.wait()
        await self._sync.audit.audit()

    async def wait_index_loaded(self) -> bool:
        """Until the index's load at open has ended (at once if ``open()`` loaded it); whether
        the index is complete (``index_listing_complete``). False: the listing stopped at
        ``index_list_timeout`` or failed, the ask mode (no index), or a close came first.
        For what must see the whole prefix (tests, tools); the tier serves while it loads."""
        self._require_client("wait_index_loaded")
        await self._sync.load.wait()
        return self._index_mode and self._sync.listing_complete

    def held_keys(self) -> list[bytes]:
        """The keys the existence index holds (a router's full state; read-only)."""
        return self.held_keys_reader()()

    def held_keys_reader(self) -> Callable[[], list[bytes]]:
        """``held_keys`` as the index is now, to read in a worker thread (its columns are
        copied here; the keys are made in the thread)."""
        entries = self._index.entries_reader()
        return lambda: [key for key, _ in entries()]

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    def statistics(self) -> S3TierStatistics:
        stats = self._core.statistics(
            retries=self._requests.retries,
            **self._sync.counts(),
            **self._blocks.packer.counts(),
            **self._blocks.reads.counts(),
        )
        gets = self._sync.section_gets  # the chunks fetched for lookups during the load
        if not gets:
            return stats
        return dataclasses.replace(stats, index_load_requests=stats.index_load_requests + gets)

    def __repr__(self) -> str:
        return describe(
            "S3Tier",
            repr(self.name),
            self._core.where,
            f"endpoint={self.config.endpoint_label}",
            f"open={self.is_open}",
            f"signed={self.integrity_key is not None}",
            stats=self.statistics(),
            shown="breaker_state lookups.hits lookups.misses lookups.pending lookups.in_flight"
            " loads stores",
        )
