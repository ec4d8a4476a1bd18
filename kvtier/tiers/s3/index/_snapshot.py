"""Index snapshots of the S3 tier: loading the newest at open, and compacting into a new one.

No metadata service decides who compacts. Every ``index_snapshot_every`` seconds (its phase
set by the writer id, so nodes look at different moments) a node lists the snapshot folder
(``_snapshot_format``: one LIST, one page) and, if the newest snapshot is older than that period
*by the server's clock* (the manifest's ``LastModified`` against the response's ``Date``, so
a node's own clock never decides), and nobody claimed the next generation lately, it:

1. claims generation ``g`` (the highest named in the folder, plus one) with a conditional PUT
   of ``claim-g``; a node that finds the claim taken (412) stops: of two compactors, one wins;
2. writes its whole index as ``data-g-<writer>``, sorted by key, and the body's directory
   ``dir-g-<writer>`` (``_snapshot_directory``; both encoded in a worker thread);
3. publishes it with a conditional PUT of the manifest ``gen-g``;
4. deletes the folder's objects of older generations (it keeps ``g - 1``, which a reader may
   be reading).

A node that crashes between 2 and 3 leaves a claim and a body no manifest names: readers
never read them, the claim stops counting once it is ``index_snapshot_every`` old, and the
next compactor takes ``g + 1`` and deletes them later. Only a node whose index is complete
(its listing at open completed or it loaded a snapshot, it has polled the journal without a
gap since, and its index never reached ``index_max_keys``) compacts.

A snapshot covers, in server time, the moment its writer's last journal poll started: every
segment listable then is in it. A node that loads it reads the segments stamped after that
moment minus ``index_lookback`` (its first poll lists from there), which its writers keep
for twice the lookback: a snapshot is used only while it is at most half the lookback old.
The cover is converted between clocks through each node's measure of the server's ``Date``,
so skewed node clocks move the cover by the skew at most, which the lookback absorbs.

A node loading a snapshot in the background reads its manifest and directory first
(``prepare``), then the journal, then streams the body; meanwhile a lookup of a key the
stream has not reached fetches the one chunk that holds it (``_snapshot_sections``).

A node that finds a snapshot newer than its journal view (it has not polled for longer than
the lookback, so it may have missed segments) loads it and polls from its cover, as a new
node does. Loading adds keys; it never removes one this node knows.
"""

from __future__ import annotations

import collections
import email.utils
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from kvtier.common._errors import TierError
from kvtier.common._format import IntegrityKey
from kvtier.common._logging import BurstLogger
from kvtier.tiers.s3._config import S3Config
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._requests import Call, body_of, get_bytes
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._snapshot_directory import (
    MAX_DIRECTORY_BYTES,
    decode_directory,
    encode_sorted_body,
)
from kvtier.tiers.s3.index._snapshot_format import (
    MAX_GENERATION,
    MAX_MANIFEST_BYTES,
    BodyDecoder,
    Manifest,
    SnapshotError,
    body_digest,
    claim_name,
    data_name,
    decode_manifest,
    directory_name,
    encode_manifest,
    manifest_name,
    parse_name,
    snapshot_dir,
)
from kvtier.tiers.s3.index._snapshot_sections import SnapshotSections
from kvtier.tiers.s3.index._snapshot_stream import stream_body

__all__ = ["SnapshotLink", "Snapshots", "Survey", "delete_object", "put_if_absent"]

logger = logging.getLogger(__name__)

_CONDITIONAL_ANSWERS = frozenset({Fault.PRECONDITION, Fault.CONFLICT, Fault.UNSUPPORTED})
_LOST = (Fault.PRECONDITION, Fault.CONFLICT)
_GET_ANSWERS = frozenset({Fault.NOT_FOUND, Fault.REJECTED})
_DATE_SLACK_MS = 2000  # an HTTP Date has whole seconds; LastModified too on some servers


@dataclass
class Survey:
    """One listing of the snapshot folder: what is there, and the server's time then."""

    server_ms: int  # the response's Date, or this node's wall time without one
    wall_ms: int  # this node's wall time when the response came
    # generation: (name, size, LastModified in server ms)
    manifests: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    claims: dict[int, int] = field(default_factory=dict)  # gen: mtime (server ms)
    others: list[tuple[int, str]] = field(default_factory=list)  # (gen, name) of bodies

    def newest(self) -> int | None:
        return max(self.manifests, default=None)

    def highest(self) -> int:
        return max([*self.manifests, *self.claims, *(g for g, _ in self.others), 0], default=0)

    def age_ms(self, mtime_ms: int) -> int:
        return self.server_ms - mtime_ms


@dataclass(frozen=True, slots=True)
class SnapshotLink:
    """How snapshots reach the bucket: the tier's name and writer id, its request sender and
    client, and the integrity key that signs them (the journal loop's own)."""

    name: str
    writer: str
    call: Call
    client: Callable[[], Any]
    integrity_key: IntegrityKey | None


class Snapshots:
    """Snapshot reads and compaction for one ``IndexSync`` (see the module docstring)."""

    def __init__(
        self,
        index: ExistenceIndex,
        config: S3Config,
        *,
        link: SnapshotLink,
        requests: collections.Counter[str],
    ) -> None:
        """Snapshots of ``index`` for the bucket and prefix of ``config`` (the tier's: also the
        lookback and snapshot settings), sent the way ``link`` says and counted in
        ``requests`` with the journal loop's."""
        self._index, self.name, self._writer = index, link.name, link.writer
        self._call, self._client = link.call, link.client
        self._bucket, self._prefix = config.bucket, config.prefix
        self._integrity_key = link.integrity_key
        self.requests = requests
        self._lookback_ms = int(config.index_lookback * 1000)
        every = config.index_snapshot_every
        self.every_ms = int((every if every is not None else config.index_lookback / 4) * 1000)
        self.max_age_ms = self._lookback_ms // 2
        self._max_bytes = config.index_snapshot_max_bytes
        self._log = BurstLogger(logger)
        # The wall ms of this node's next look at the folder: phased by the writer id.
        self._next_look_ms: int | None = None
        self._phase_ms = int(self._writer[:8], 16) % max(self.every_ms, 1)
        self.generation = 0  # the generation this index loaded or published
        # While a background load reads a body: its chunks, fetched on demand (``prepare``).
        self.sections: SnapshotSections | None = None
        self._prepared: Manifest | None = None  # read by ``prepare``, for ``load``
        self.loaded = 0
        self.published = 0
        self.lost = 0  # compactions another node won
        self.rejected = 0  # snapshots ignored: too old, too large, corrupt, unauthenticated
        self.entries_rejected = 0
        self.bytes_read = 0

    # -- reading ----------------------------------------------------------------------------

    async def survey(self, wall_ms: int) -> Survey:
        """List the snapshot folder (one page: the newest generations and their leftovers)."""
        client = self._client()
        self.requests["list"] += 1
        page = await self._call(
            "snapshot",
            None,
            functools.partial(
                client.list_objects_v2,
                Bucket=self._bucket,
                Prefix=snapshot_dir(self._prefix),
                MaxKeys=1000,
            ),
        )
        assert not isinstance(page, Fault)
        survey = Survey(server_ms=_server_ms(page, wall_ms), wall_ms=wall_ms)
        for item in page.get("Contents", ()):
            name, parsed = item.get("Key"), None
            if isinstance(name, str):
                parsed = parse_name(name, self._prefix)
            mtime = _mtime_ms(item)
            if parsed is None or mtime is None:
                continue
            if parsed.kind == "gen":
                size = item.get("Size")
                survey.manifests[parsed.generation] = (
                    name,
                    size if isinstance(size, int) else -1,
                    mtime,
                )
            elif parsed.kind == "claim":
                survey.claims[parsed.generation] = mtime
            else:
                survey.others.append((parsed.generation, name))
        return survey

    async def prepare(self, survey: Survey) -> None:
        """Read the newest snapshot's manifest and its body's directory now, ahead of the
        rest of a background load (the journal, then the body): from then on a lookup of a
        key not indexed yet can fetch the chunk that holds it (``sections``). A snapshot
        that is too old, or whose manifest does not verify, is left to ``load`` (which
        rejects it and says so). Raises only ``TierError``."""
        generation = survey.newest()
        if generation is None or generation <= self.generation:
            return
        name, size, mtime = survey.manifests[generation]
        if survey.age_ms(mtime) > self.max_age_ms:
            return
        try:
            self._prepared = await self._read_manifest(generation, name, size, mtime)
        except SnapshotError:
            return
        await self._open_sections(self._prepared)

    async def load(self, survey: Survey, *, newer_than: int = 0) -> int | None:
        """Load the newest usable snapshot newer than generation ``newer_than`` into the
        index (adding keys); its cover in this node's wall ms, or None if there is none (too
        old, or rejected: then the previous generation is tried once)."""
        prepared, self._prepared = self._prepared, None
        try:
            for tried, generation in enumerate(sorted(survey.manifests, reverse=True)):
                if generation <= newer_than or tried >= 2:
                    return None
                name, size, mtime = survey.manifests[generation]
                if survey.age_ms(mtime) > self.max_age_ms:
                    return None  # older ones are older still
                try:
                    if prepared is not None and prepared.generation == generation:
                        manifest = prepared
                    else:
                        manifest = await self._read_manifest(generation, name, size, mtime)
                        await self._open_sections(manifest)
                    entries = await self._read_body(manifest)
                except SnapshotError as exc:
                    self.rejected += 1
                    self._log.warning(
                        "snapshot", "%s: ignoring index snapshot %s: %s", self.name, name, exc
                    )
                    continue
                self._index.listed += entries
                self.generation = max(self.generation, generation)
                self.loaded += 1
                # The cover in this node's clock: server time plus this node's lead on it.
                return manifest.cover_ms + (survey.wall_ms - survey.server_ms)
            return None
        finally:
            self.sections = None

    async def _open_sections(self, manifest: Manifest) -> None:
        """While the index loads in the background (lookups then ask about keys it lacks),
        read the directory of ``manifest``'s body, so that those lookups can fetch the chunk
        of a key (``sections``); without one (an older writer's snapshot, or a directory
        that does not verify) they wait for the body. Raises only ``TierError``."""
        self.sections = None
        if not self._index.loading:
            return
        directory = directory_name(self._prefix, manifest.generation, manifest.writer)
        try:
            found = decode_directory(await self._get(directory, MAX_DIRECTORY_BYTES), manifest)
        except SnapshotError as exc:
            logger.debug("%s: no usable snapshot directory %s: %s", self.name, directory, exc)
            return
        self.sections = SnapshotSections(
            found,
            body=data_name(self._prefix, manifest.generation, manifest.writer),
            index=self._index,
            call=self._call,
            client=self._client,
            bucket=self._bucket,
            prefix=self._prefix,
            integrity_key=self._integrity_key,
            name=self.name,
        )

    async def _read_manifest(self, generation: int, name: str, size: int, mtime: int) -> Manifest:
        if not 0 < size <= MAX_MANIFEST_BYTES:
            raise SnapshotError(f"manifest of {size} bytes")
        data = await self._get(name, MAX_MANIFEST_BYTES)
        manifest = decode_manifest(
            data, self._prefix, generation, integrity_key=self._integrity_key
        )
        # A snapshot covers a moment before it was published, and not long before.
        if not mtime - self._lookback_ms // 2 <= manifest.cover_ms <= mtime + _DATE_SLACK_MS:
            raise SnapshotError("its cover is not shortly before its publication")
        if manifest.body_length > self._max_bytes:
            raise SnapshotError(
                f"body of {manifest.body_length} bytes, above index_snapshot_max_bytes"
            )
        return manifest

    async def _read_body(self, manifest: Manifest) -> int:
        """Index the body's entries as it arrives (``_snapshot_stream``); how many it held.
        Each GET's bytes are counted, a rejected or retried one's too."""
        name = data_name(self._prefix, manifest.generation, manifest.writer)
        made: list[BodyDecoder] = []

        def decoder() -> BodyDecoder:
            made.append(BodyDecoder(self._prefix, manifest, integrity_key=self._integrity_key))
            return made[-1]

        self.requests["get"] += 1
        streamed = None if self.sections is None else self.sections.streamed
        try:
            await stream_body(
                self._call, self._client(), self._bucket, name, decoder, self._index, streamed
            )
        finally:
            self.bytes_read += sum(d.received for d in made)
            self.entries_rejected += made[-1].rejected if made else 0
        return made[-1].entries

    async def _get(self, name: str, most: int) -> bytes:
        """One GET of at most ``most`` bytes; SnapshotError if it is gone or empty."""
        client = self._client()
        self.requests["get"] += 1
        get = functools.partial(get_bytes, client, self._bucket, name, 0, most)
        data = await self._call("snapshot", None, get, expected=_GET_ANSWERS)
        if isinstance(data, Fault):
            raise SnapshotError(f"{name} is gone or empty")
        self.bytes_read += len(data)
        return data

    # -- the periodic look ------------------------------------------------------------------

    def look_now(self) -> None:
        """Look at the folder at the next refresh (a node that found a gap in its view)."""
        self._next_look_ms = 0

    def due(self, wall_ms: int) -> bool:
        """Whether this node looks at the folder now (every ``every_ms``, phased)."""
        if self._next_look_ms is None:
            self._next_look_ms = wall_ms - wall_ms % self.every_ms + self._phase_ms
            if self._next_look_ms <= wall_ms:
                self._next_look_ms += self.every_ms
            return False
        if wall_ms < self._next_look_ms:
            return False
        self._next_look_ms = wall_ms + self.every_ms
        return True

    async def tick(self, wall_ms: int, cover_wall_ms: int) -> None:
        """The periodic look of a node whose index is complete up to ``cover_wall_ms``:
        compact if the newest snapshot is old enough. Raises only ``TierError``."""
        await self.compact(await self.survey(wall_ms), cover_wall_ms)

    # -- writing ------------------------------------------------------------------------------

    async def compact(self, survey: Survey, cover_wall_ms: int) -> bool:
        """Write and publish a snapshot of this index if one is due and nobody else is at
        it; whether this node published one."""
        newest = survey.newest()
        if newest is not None and survey.age_ms(survey.manifests[newest][2]) < self.every_ms:
            return False
        if any(
            generation > (newest or 0) and survey.age_ms(mtime) < self.every_ms
            for generation, mtime in survey.claims.items()
        ):
            return False  # another node claimed the next one lately
        generation = survey.highest() + 1
        if generation > MAX_GENERATION:
            return False
        client = self._client()
        claim = claim_name(self._prefix, generation)
        if not await self._put_new(client, claim, b""):
            self.lost += 1
            return False
        entries = self._index.entries_reader()

        def build() -> tuple[bytes, bytes, int]:
            listed = entries()
            body, table = encode_sorted_body(
                listed, self._prefix, integrity_key=self._integrity_key
            )
            return body, table, len(listed)

        body, table, count = await anyio.to_thread.run_sync(build)
        data = data_name(self._prefix, generation, self._writer)
        directory = directory_name(self._prefix, generation, self._writer)
        for name, content in ((data, body), (directory, table)):
            await self._put(client, name, content)
        cover_ms = cover_wall_ms - (survey.wall_ms - survey.server_ms)  # in server time
        manifest = Manifest(generation, cover_ms, len(body), body_digest(body), self._writer)
        encoded = encode_manifest(manifest, self._prefix, integrity_key=self._integrity_key)
        if not await self._put_new(client, manifest_name(self._prefix, generation), encoded):
            self.lost += 1
            await self._delete(client, data)
            await self._delete(client, directory)
            return False
        self.generation = generation
        self.published += 1
        logger.info(
            "%s: published index snapshot %d (%d keys, %d bytes)",
            self.name,
            generation,
            count,
            len(body),
        )
        await self._delete_older(client, survey, generation)
        return True

    async def _put(self, client: Any, name: str, body: bytes) -> None:
        """One plain PUT (a fresh body per attempt)."""
        self.requests["put"] += 1
        await self._call(
            "snapshot",
            None,
            lambda: client.put_object(Bucket=self._bucket, Key=name, Body=body_of(body)),
        )

    async def _put_new(self, client: Any, name: str, body: bytes) -> bool:
        return await put_if_absent(
            self._call, client, self._bucket, name, body, "snapshot", self.requests
        )

    async def _delete_older(self, client: Any, survey: Survey, generation: int) -> None:
        """Delete what the survey listed of generations before ``generation - 1`` (and
        claims before ``generation``): the folder stays a few objects."""
        names = [name for g, (name, _, _) in survey.manifests.items() if g < generation - 1]
        names += [name for g, name in survey.others if g < generation - 1]
        names += [claim_name(self._prefix, g) for g in survey.claims if g < generation]
        for name in names:
            await self._delete(client, name)

    async def _delete(self, client: Any, name: str) -> None:
        self.requests["delete"] += 1
        try:
            await delete_object(self._call, client, self._bucket, name, "snapshot")
        except TierError as exc:  # left for the next compactor
            self._log.warning(
                "snapshot-delete",
                "%s: could not delete %s (%s)",
                self.name,
                name,
                exc.reason,
            )


async def put_if_absent(
    call: Call,
    client: Any,
    bucket: str,
    name: str,
    body: bytes,
    operation: str,
    requests: dict[str, int],
) -> bool:
    """A conditional PUT (``If-None-Match: *``): False if the object was there (or being
    written), so that of two nodes publishing one name only one wins. A server that does not
    take the condition gets a plain PUT: both then publish, and the caller's object must be
    correct whichever stands."""
    requests["put"] += 1
    result = await call(
        operation,
        None,
        lambda: client.put_object(Bucket=bucket, Key=name, Body=body_of(body), IfNoneMatch="*"),
        expected=_CONDITIONAL_ANSWERS,
    )
    if result is Fault.UNSUPPORTED:
        requests["put"] += 1
        put = functools.partial(client.put_object, Bucket=bucket, Key=name, Body=body_of(body))
        await call(operation, None, put)
        return True
    return result not in _LOST


async def delete_object(call: Call, client: Any, bucket: str, name: str, operation: str) -> None:
    """One DELETE through the tier's requests; an object already gone is deleted."""
    await call(
        operation,
        None,
        functools.partial(client.delete_object, Bucket=bucket, Key=name),
        expected=frozenset({Fault.NOT_FOUND}),
    )


def _server_ms(response: Any, fallback: int) -> int:
    try:
        date = response["ResponseMetadata"]["HTTPHeaders"]["date"]
        return int(email.utils.parsedate_to_datetime(date).timestamp() * 1000)
    except (KeyError, TypeError, ValueError, IndexError):
        return fallback


def _mtime_ms(item: Any) -> int | None:
    modified = item.get("LastModified")
    try:
        return int(modified.timestamp() * 1000)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None
