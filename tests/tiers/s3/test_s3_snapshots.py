"""Index snapshots on the run's SeaweedFS: compaction races, a crash mid-compaction, corrupt
and hostile snapshots, skewed clocks and a reader with a gap, each ending with an index that
holds every key the fleet stored (``kvtier.tiers.s3.index._snapshot``).

Nodes are real ``S3Tier`` instances on one prefix, with a refresh loop too slow to run during
a test: each test drives the journal and the compaction by hand, and moves a node's wall
clock instead of waiting. Compaction is due by the server's clock; a test makes it due by
moving the survey's server time, never by sleeping.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import pytest

from devtools.server_process import raw_client
from devtools.weed_server import BUCKET, WeedServer
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index import _snapshot as compaction
from kvtier.tiers.s3.index._snapshot import Survey
from kvtier.tiers.s3.index._snapshot_format import (
    Manifest,
    body_digest,
    data_name,
    encode_body,
    encode_manifest,
    manifest_name,
    snapshot_dir,
)
from tests.support import MakeS3Tier, ManualClock, fill, fresh_keys
from tests.tiers.s3.s3_fleet import assert_knows, fleet

pytestmark = pytest.mark.anyio

EVERY = 60.0  # index_snapshot_every: compaction is made due by moving the survey's clock
LOOKBACK = 7200.0
SETTINGS: dict[str, Any] = {
    "index_refresh": 3600.0,
    "index_lookback": LOOKBACK,
    "index_snapshot_every": EVERY,
}


class Crash(Exception):
    """A compactor dying at the point a test picks."""


def _wall(offset: float = 0.0) -> ManualClock:
    return ManualClock(time.time() + offset)


def nodes(
    make_tier: MakeS3Tier, *walls: ManualClock, **overrides: Any
) -> AbstractAsyncContextManager[list[S3Tier]]:
    """Open one tier per wall clock, each with that clock as its journal's."""
    return fleet(make_tier, walls, SETTINGS | overrides)


async def survey(tier: S3Tier, *, later: float = 0.0) -> Survey:
    """The tier's look at the snapshot folder, ``later`` seconds on by the server's clock."""
    found = await snapshots_of(tier).survey(int(tier._sync._wall() * 1000))
    back = int(later * 1000)  # what the folder holds looks that much older
    found.manifests = {
        g: (n, size, mtime - back) for g, (n, size, mtime) in found.manifests.items()
    }
    found.claims = {g: mtime - back for g, mtime in found.claims.items()}
    return found


async def compact(tier: S3Tier, found: Survey | None = None) -> bool:
    assert tier._sync.covered_ms is not None
    return await snapshots_of(tier).compact(found or await survey(tier), tier._sync.covered_ms)


async def share(*tiers: S3Tier) -> None:
    """Every node publishes what it wrote, then every node reads the others'."""
    for tier in tiers:
        await tier._sync.refresh_once(poll=False)
    for tier in tiers:
        await tier._sync.refresh_once()


def snapshots_of(tier: S3Tier) -> compaction.Snapshots:
    snapshots = tier._sync.snapshots
    assert snapshots is not None
    return snapshots


def loaded(tier: S3Tier) -> int:
    return snapshots_of(tier).loaded


async def test_two_compactors_racing_publish_one_snapshot(make_tier: MakeS3Tier) -> None:
    keys = fresh_keys(12)
    async with nodes(make_tier, _wall(), _wall()) as (a, b):
        await fill(a, keys[:6])
        await fill(b, keys[6:])
        await share(a, b)
        seen_a, seen_b = await survey(a), await survey(b)
        results: list[bool] = []

        async def race(tier: S3Tier, found: Survey) -> None:
            results.append(await compact(tier, found))

        async with anyio.create_task_group() as tg:
            tg.start_soon(race, a, seen_a)
            tg.start_soon(race, b, seen_b)
        assert sorted(results) == [False, True]
        # The loser, trying again from what it saw before, loses again: the claim is taken.
        loser, seen = (b, seen_b) if snapshots_of(a).published else (a, seen_a)
        assert await compact(loser, seen) is False
        after = await survey(a)
        assert set(after.manifests) == {1}
        # One body and its directory: the loser never wrote either.
        assert sorted(name.rsplit("/", 1)[1][:4] for _, name in after.others) == ["data", "dir-"]
    async with nodes(make_tier, _wall()) as (new,):
        assert loaded(new) == 1 and new._sync.listing_complete
        assert_knows(new, keys)
        assert len(new._index) == len(keys)


async def test_a_crash_between_writing_and_publishing_is_never_read(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = fresh_keys(8)
    async with nodes(make_tier, _wall(), _wall()) as (a, b):
        await fill(a, keys[:4])
        await share(a, b)

        def crash(*args: object, **kwargs: object) -> bytes:
            raise Crash

        with monkeypatch.context() as patched:
            patched.setattr(compaction, "encode_manifest", crash)
            with pytest.raises(Crash):
                await compact(a)
        left = await survey(b)
        # A body and its directory, which no manifest names.
        assert (set(left.claims), left.manifests, len(left.others)) == ({1}, {}, 2)
        async with nodes(make_tier, _wall()) as (new,):
            assert loaded(new) == 0 and new._sync.listing_complete  # listed instead
            assert_knows(new, keys[:4])
        # The claim holds the generation while it is recent; once it is old, another node
        # compacts the next one, and a later compaction deletes the leftovers.
        assert await compact(b, left) is False
        await fill(b, keys[4:])
        await share(b, a)
        assert await compact(b, await survey(b, later=EVERY)) is True
        assert await compact(b, await survey(b, later=2 * EVERY)) is True
        after = await survey(b)
        assert set(after.manifests) == {2, 3}
        assert 1 not in after.claims and all(g >= 2 for g, _ in after.others)
    async with nodes(make_tier, _wall()) as (new,):
        assert loaded(new) == 1 and snapshots_of(new).generation == 3
        assert_knows(new, keys)


async def _overwrite(server: WeedServer, name: str, change: Any) -> None:
    async with raw_client(server.endpoint_url) as client:
        response = await client.get_object(Bucket=BUCKET, Key=name)
        async with response["Body"] as body:
            data = await body.read()
        await client.put_object(Bucket=BUCKET, Key=name, Body=change(data))


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :]


@pytest.mark.parametrize("where", ["body", "manifest", "manifest claims a huge body"])
async def test_a_corrupt_snapshot_is_ignored_and_the_prefix_listed(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, where: str
) -> None:
    keys = fresh_keys(6)
    async with nodes(make_tier, _wall()) as (a,):
        await fill(a, keys)
        await share(a)
        assert await compact(a)
        writer = a._sync._writer
    if where == "body":
        await _overwrite(weed_server, data_name(prefix, 1, writer), _flip)
    elif where == "manifest":
        await _overwrite(weed_server, manifest_name(prefix, 1), _flip)
    else:
        huge = Manifest(1, int(time.time() * 1000), 1 << 40, b"\0" * 16, writer)
        await _overwrite(
            weed_server, manifest_name(prefix, 1), lambda _: encode_manifest(huge, prefix)
        )
    async with nodes(make_tier, _wall()) as (new,):
        snapshots = snapshots_of(new)
        assert (snapshots.loaded, snapshots.rejected) == (0, 1)
        assert new._sync.listing_complete
        assert_knows(new, keys)
        assert snapshots.bytes_read < 1 << 20  # the huge body was never asked for


async def test_a_hostile_snapshot_teaches_nothing_outside_the_prefix(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    """A well-formed snapshot whose entries name another prefix's packs: those entries are
    ignored and counted, the rest indexed."""
    own, foreign = fresh_keys(2), fresh_keys(3)
    elsewhere = pack_name("other", foreign[0], "f" * 16, 1)
    entries: list[tuple[bytes, Location | None]] = [(k, None) for k in own]
    entries += [(k, Location(elsewhere, 100, 100)) for k in foreign]
    body = encode_body(entries, prefix)
    manifest = Manifest(1, int(time.time() * 1000), len(body), body_digest(body), "a" * 16)
    async with raw_client(weed_server.endpoint_url) as client:
        await client.put_object(Bucket=BUCKET, Key=data_name(prefix, 1, "a" * 16), Body=body)
        encoded = encode_manifest(manifest, prefix)
        await client.put_object(Bucket=BUCKET, Key=manifest_name(prefix, 1), Body=encoded)
    async with nodes(make_tier, _wall()) as (new,):
        snapshots = snapshots_of(new)
        assert (snapshots.loaded, snapshots.entries_rejected) == (1, len(foreign))
        assert_knows(new, own)
        assert not any(key in new._index for key in foreign)


@pytest.mark.parametrize("skew", [3000.0, -3000.0])
async def test_a_skewed_clock_still_loads_a_snapshot_and_what_came_after(
    make_tier: MakeS3Tier, skew: float
) -> None:
    """The compactor's clock is ``skew`` seconds off the server's (well within the lookback):
    its snapshot's cover is in server time, so a node with a true clock loads it, and reads
    the segment a third node published after it."""
    keys = fresh_keys(6)
    async with nodes(make_tier, _wall(skew), _wall()) as (skewed, writer):
        await fill(skewed, keys[:4])
        await share(skewed, writer)
        assert await compact(skewed)
        async with nodes(make_tier, _wall(), _wall(-skew)) as (new, other):
            assert loaded(new) == 1 and loaded(other) == 1
            await fill(writer, keys[4:])
            await share(writer, new, other)
            assert_knows(new, keys)
            assert_knows(other, keys)


async def test_a_reader_with_a_gap_loads_a_newer_snapshot(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    """A node that has not polled for longer than the lookback may have missed segments its
    writers deleted since: it loads the newer snapshot another node published, then polls
    from there."""
    keys = fresh_keys(6)
    reader_wall = _wall()
    async with nodes(make_tier, reader_wall, _wall()) as (reader, writer):
        await fill(writer, keys)
        await share(writer)
        async with raw_client(weed_server.endpoint_url) as client:  # deleted by their writer
            page = await client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/_kvtier_journal/")
            for item in page.get("Contents", ()):
                await client.delete_object(Bucket=BUCKET, Key=item["Key"])
        assert await compact(writer)
        reader_wall.advance(LOOKBACK + 1)
        await reader.refresh_index()
        assert loaded(reader) == 1 and reader._sync.view_complete
        assert_knows(reader, keys)
        listed = await survey(reader)
        assert snapshot_dir(prefix) in next(iter(listed.manifests.values()))[0]


async def test_the_refresh_round_compacts_only_a_complete_index(make_tier: MakeS3Tier) -> None:
    """The periodic look compacts when a snapshot is due, but not from an index that filled
    (it lost keys), and a tier with snapshots off never looks."""
    keys = fresh_keys(4)
    async with nodes(make_tier, _wall(), index_max_keys=2) as (full,):
        await fill(full, keys)
        snapshots_of(full).look_now()
        await full.refresh_index()
        assert (await survey(full)).manifests == {}
    async with nodes(make_tier, _wall(), index_snapshots=False) as (off,):
        assert off._sync.snapshots is None
        await off.refresh_index()
    async with nodes(make_tier, _wall()) as (complete,):
        assert_knows(complete, keys)  # listed: no snapshot yet
        snapshots_of(complete).look_now()
        await complete.refresh_index()
        assert set((await survey(complete)).manifests) == {1}
        assert snapshots_of(complete).published == 1
