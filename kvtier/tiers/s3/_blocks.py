"""Blocks as S3 objects: the loads and stores of an ``S3Tier``, around its core.

A load is one GET streamed into the caller's buffer and checked there (``_codec``), or, for a
block in a pack, its section fetched with those of the same pack that other loads want now
(``PackReads``). A store builds the object (header + payload) and hands it to the group commit
(``PackWriter``), which sends it alone with a conditional put or with its neighbours as one
pack. Each outcome is booked in the core (index, verdicts, counters).

A corrupt object is a miss with reason ``corrupt`` and is deleted in the tier's background,
bounded by ``read_timeout``: the load that found it fails at once, so clean-up never holds a
promotion (its slot, the request that waits on it) past its deadline. Once deleted, its key
is published as removed through the journal, so other nodes drop it without a GET of their
own. ``S3Core.keep_corrupt`` says which corrupt objects are left in place instead. A pack
section that fails its check is a corrupt miss that drops the key from the index, and the
pack is kept (``_load_section``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

import anyio
import anyio.abc
import anyio.to_thread

from kvtier.common._errors import (
    BlockNotFoundError,
    CorruptBlockError,
    TierError,
    TierUnavailableError,
)
from kvtier.common._format import FORMAT_VERSION
from kvtier.common._lookup import MissReason
from kvtier.tiers.s3._codec import META_FORMAT, build_object, verify_into, verify_response_into
from kvtier.tiers.s3._core import S3Core
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._pack import PackReads, PackWriter, PendingStore
from kvtier.tiers.s3._pack_format import Location, encode_table, pack_body
from kvtier.tiers.s3._requests import Requests, body_of, get_bytes

__all__ = ["BlockObjects"]

logger = logging.getLogger("kvtier.tiers.s3")

_PUT_ANSWERS = frozenset({Fault.PRECONDITION, Fault.CONFLICT, Fault.UNSUPPORTED})


class BlockObjects:
    """The object I/O of one tier: ``load`` and ``store`` of single blocks and packs.

    ``client(operation)`` returns the tier's open client (or raises ``LifecycleError``);
    ``task_group()`` the tier's background task group, None while it is closed."""

    def __init__(
        self,
        core: S3Core,
        requests: Requests,
        *,
        client: Callable[[str], Any],
        task_group: Callable[[], anyio.abc.TaskGroup | None],
    ) -> None:
        self.core = core
        self._call = requests.call
        self._client = client
        self._task_group = task_group
        # Write-through is background work: it may use a quarter of the connections, so the
        # loads a waiting request needs are never queued behind a burst of stores.
        limiter = anyio.CapacityLimiter(max(1, core.config.max_concurrency // 4))
        self.packer = PackWriter(
            pack_blocks=core.pack_blocks,
            limiter=limiter,
            put_single=self._put_single,
            put_pack=self._put_pack,
        )
        self.reads = PackReads(self._fetch_pack)

    # -- loads ---------------------------------------------------------------------------------

    async def load(self, key: bytes, view: memoryview) -> None:
        """Load ``key``'s block into ``view`` (flat bytes), booking the outcome."""
        core = self.core
        client = self._client("load")
        started = time.perf_counter()
        where = core.index.location(key)
        try:
            if where is not None:
                core.check_location(key, where, view.nbytes)
                result = await self._load_section(key, where, view)
            else:
                result = await self._call(
                    "load",
                    key,
                    lambda: self._get_into(client, key, view),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
        except CorruptBlockError:
            core.meter.failed(MissReason.CORRUPT)
            core.lost(key, MissReason.CORRUPT)
            raise
        except TierError as exc:
            core.meter.failed(exc.reason)
            raise
        if result is Fault.NOT_FOUND:
            core.meter.failed(MissReason.NOT_FOUND)
            core.lost(key, MissReason.NOT_FOUND)  # an index HIT that was stale
            raise BlockNotFoundError("no such object", tier=core.name, operation="load", key=key)
        core.meter.read(view.nbytes, time.perf_counter() - started)

    async def _get_into(self, client: Any, key: bytes, dst: memoryview) -> None:
        """One GET, streamed into ``dst``; a corrupt object is deleted and raised."""
        core = self.core
        response = await client.get_object(Bucket=core.bucket, Key=core.object_key(key))
        try:
            problem, head = await verify_response_into(
                response,
                key,
                dst,
                thread_bytes=core.verify_thread_bytes,
                integrity_key=core.integrity_key,
            )
        finally:
            response["Body"].close()
        if problem is not None:
            self._discard_corrupt(key, head, problem)

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
        core = self.core
        section = await self.reads.read(where)
        if section is None:
            return Fault.NOT_FOUND
        verify = functools.partial(verify_into, section, key, dst, None, core.integrity_key)
        if section.nbytes > core.verify_thread_bytes:
            problem, _head = await anyio.to_thread.run_sync(verify)
        else:
            problem, _head = verify()
        if problem is not None:
            core.log.warning(
                "corrupt",
                "%s: section of %s at %s+%d is not its block (%s); the pack is kept",
                core.name,
                key.hex(),
                where.pack,
                where.offset,
                problem,
            )
            raise CorruptBlockError(problem, tier=core.name, operation="load", key=key)
        return None

    async def _fetch_pack(self, name: str, lo: int, hi: int) -> bytes | None:
        """Bytes ``lo:hi`` of the pack ``name`` (fewer if it is shorter), None if it is gone."""
        get = functools.partial(get_bytes, self._client("load"), self.core.bucket, name, lo, hi)
        # A range past the end (HTTP 416) means a pack shorter than its table: the short
        # answer is then caught as corrupt by each section's header check.
        expected = frozenset({Fault.NOT_FOUND, Fault.REJECTED})
        result = await self._call("load", None, get, expected=expected)
        if result is Fault.NOT_FOUND:
            return None
        return b"" if isinstance(result, Fault) else result

    # -- corrupt objects -----------------------------------------------------------------------

    def _discard_corrupt(self, key: bytes, head: bytes, problem: str) -> NoReturn:
        """Raise CorruptBlockError for ``key``'s corrupt object, after starting its delete in
        the background (unless ``S3Core.keep_corrupt`` keeps it)."""
        core = self.core
        kept = core.keep_corrupt(head)
        name = core.object_key(key)
        if not kept:
            self._delete_corrupt_soon(name, key)
        core.log.warning("corrupt", "%s: corrupt object %s (%s)%s", core.name, name, problem, kept)
        raise CorruptBlockError(problem, tier=core.name, operation="load", key=key)

    def _delete_corrupt_soon(self, name: str, key: bytes) -> None:
        """Start deleting the corrupt object ``name`` in the tier's task group. A closing
        tier starts none, and at most ``max_concurrency`` run at once; an object left in
        place is deleted by the next load that finds it. Once deleted, ``key`` is published
        as removed (``corrupt``) at the next journal refresh."""
        tg = self._task_group()
        if tg is not None and self.core.start_delete(name):
            tg.start_soon(self._delete_corrupt, name, key)

    async def _delete_corrupt(self, name: str, key: bytes) -> None:
        """One background delete of a corrupt object, bounded by ``read_timeout``."""
        core = self.core
        deleted = False
        try:
            client = self._client("delete")
            with anyio.move_on_after(core.config.read_timeout) as scope:
                await self._call(
                    "delete",
                    None,
                    functools.partial(client.delete_object, Bucket=core.bucket, Key=name),
                    expected=frozenset({Fault.NOT_FOUND}),
                )
                deleted = True
            if scope.cancelled_caught:
                core.log.warning(
                    "corrupt-delete",
                    "%s: deleting a corrupt object took over %.1f s; left in place",
                    core.name,
                    core.config.read_timeout,
                )
        except Exception as exc:
            core.log.warning(
                "corrupt-delete",
                "%s: could not delete a corrupt object: %s",
                core.name,
                type(exc).__name__,
            )
        finally:
            core.end_delete(name, key, deleted=deleted)

    # -- stores --------------------------------------------------------------------------------

    async def store(self, key: bytes, payload: memoryview) -> None:
        """Build ``key``'s object from ``payload`` (flat bytes) and send it, alone or packed
        with the stores that arrive with it (``_pack``)."""
        core = self.core
        build = functools.partial(build_object, key, payload, integrity_key=core.integrity_key)
        if payload.nbytes > core.build_thread_bytes:
            body, metadata, crc = await anyio.to_thread.run_sync(build)
        else:
            body, metadata, crc = build()
        await self.packer.store(PendingStore(key, body, metadata, crc))

    async def _put_single(self, item: PendingStore) -> None:
        """One block as its own object, with a conditional put; the caller holds a slot."""
        core = self.core
        client = self._client("store")
        key, body = item.key, item.body
        started = time.perf_counter()
        object_key = core.object_key(key)

        async def put() -> Any:
            extra = {"IfNoneMatch": "*"} if core.conditional_put else {}
            return await client.put_object(
                Bucket=core.bucket,
                Key=object_key,
                Body=body_of(body),
                Metadata=item.metadata,
                ChecksumCRC32=item.crc,
                **extra,
            )

        try:
            result = await self._call("store", key, put, expected=_PUT_ANSWERS)
            if result is Fault.UNSUPPORTED and core.conditional_put:
                logger.info("%s: the server rejects conditional puts; using plain puts", core.name)
                core.conditional_put = False
                result = await self._call("store", key, put, expected=_PUT_ANSWERS)
        except TierError as exc:
            core.meter.failed(exc.reason)
            raise
        if result is Fault.UNSUPPORTED:
            core.meter.failed(MissReason.UNAVAILABLE)
            raise TierUnavailableError(
                "the server rejected the put as not implemented",
                tier=core.name,
                operation="store",
                key=key,
            )
        if result in (Fault.PRECONDITION, Fault.CONFLICT):
            core.skipped_existing += 1  # it is there (or being written): nothing to do
        else:
            core.meter.wrote(len(body), time.perf_counter() - started)
        core.wrote(key)

    async def _put_pack(self, items: list[PendingStore]) -> None:
        """Several blocks as one pack object (``_pack_format``); the caller holds a slot. A pack's
        name is unique to this writer, so it needs no conditional put."""
        core = self.core
        client = self._client("store")
        started = time.perf_counter()
        keys = [item.key for item in items]
        lengths = [len(item.body) for item in items]
        name = core.next_pack_name(keys[0])
        table = encode_table(keys, lengths)
        join = functools.partial(pack_body, table, [item.body for item in items])
        if sum(lengths) > core.join_thread_bytes:
            body, crc = await anyio.to_thread.run_sync(join)
        else:
            body, crc = join()

        async def put() -> Any:
            return await client.put_object(
                Bucket=core.bucket,
                Key=name,
                Body=body_of(body),
                Metadata={META_FORMAT: str(FORMAT_VERSION)},
                ChecksumCRC32=crc,
            )

        try:
            await self._call("store", None, put)
        except TierError as exc:
            core.meter.failed(exc.reason)
            raise
        seconds = (time.perf_counter() - started) / len(items)
        offset = len(table)
        for key, length in zip(keys, lengths, strict=True):
            core.meter.wrote(length, seconds)
            core.wrote(key, Location(name, offset, length))
            offset += length
