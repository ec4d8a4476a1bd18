"""Journal digests on the run's SeaweedFS: two digesters racing, a digester crashing before
it publishes, corrupt, hostile and foreign digests, a skewed clock, a reader behind the
digests, and a node that predates digests, each ending with an index that holds every key
the fleet stored (``kvtier.tiers.s3.index._digest``).

Nodes are real ``S3Tier`` instances on one prefix whose refresh loop sleeps for most of an
interval (an hour): each test drives the rounds by hand and moves the nodes' wall clocks
instead of waiting.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from devtools.server_process import raw_client
from devtools.weed_server import BUCKET, WeedServer
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3._pack_format import Location, pack_name
from kvtier.tiers.s3.index._digest import CARRY_INTERVALS, DELETE_BATCH, MAX_CATCH_UP, Digests
from kvtier.tiers.s3.index._digest_format import Digest, digest_dir, digest_name, encode_digest
from kvtier.tiers.s3.index._journal_format import (
    encode_segment,
    journal_prefix,
    segment_name,
    segment_time_ms,
)
from tests.support import MakeS3Tier, ManualClock, fill, fresh_keys
from tests.tiers.s3.s3_fleet import assert_knows, fleet

pytestmark = pytest.mark.anyio

R = 3600.0  # index_refresh: one interval, moved by hand
SETTINGS: dict[str, Any] = {
    "index_refresh": R,
    "index_lookback": 4 * R,
    "index_snapshots": False,
    "index_digests": True,
}
SECRET = "correct horse battery staple 0123456789"


class Crash(Exception):
    """A digester dying between reading the segments and publishing."""


def _clock(offset: float = 0.0) -> ManualClock:
    """A wall clock in the middle of an interval (where the loop's round falls)."""
    return ManualClock((time.time() // R) * R + R / 2 + offset)


def ms(clock: ManualClock) -> int:
    return int(clock() * 1000)


@asynccontextmanager
async def nodes(
    make_tier: MakeS3Tier, *walls: ManualClock, **overrides: Any
) -> AsyncIterator[list[S3Tier]]:
    """Open one tier per wall clock, each with that clock as its journal's, and run each
    one's first round (which reads the journal: its next digest is the current one's)."""
    async with fleet(make_tier, walls, SETTINGS | overrides) as tiers:
        for tier in tiers:
            await tier._sync.refresh_once()
        yield tiers


def digests_of(tier: S3Tier) -> Digests:
    digests = tier._sync.digests
    assert digests is not None
    return digests


def prime(tier: S3Tier, clock: ManualClock, *writers: S3Tier) -> None:
    """Let ``tier`` know ``writers`` as if each had published a few intervals before: the
    digest's turn goes round them (a writer's segments count from ``CARRY_INTERVALS`` on)."""
    before = int((CARRY_INTERVALS + 1) * R * 1000)
    for writer in writers:
        name = segment_name(writer.prefix, ms(clock) - before, writer._sync._writer, 0)
        digests_of(tier).note(name)


async def publish(*tiers: S3Tier) -> None:
    for tier in tiers:
        await tier._sync.refresh_once(poll=False)


@asynccontextmanager
async def writer_and_reader(
    make_tier: MakeS3Tier,
    clock: ManualClock,
    keys: Sequence[bytes],
    *,
    turn: bool = True,
    **overrides: Any,
) -> AsyncIterator[tuple[S3Tier, S3Tier]]:
    """Two nodes on ``clock``: ``a`` has stored ``keys`` and published its segment (and, with
    ``turn``, knows itself the only writer, so the digest's turn is its own); ``c`` reads."""
    async with nodes(make_tier, clock, clock, **overrides) as (a, c):
        if turn:
            prime(a, clock, a)
        await fill(a, keys)
        await publish(a)
        yield a, c


async def test_two_digesters_racing_publish_one_digest(make_tier: MakeS3Tier) -> None:
    clock = _clock()
    keys = fresh_keys(8)
    async with nodes(make_tier, clock, clock, clock) as (a, b, c):
        prime(a, clock, a)  # each thinks itself the only writer: both take the turn
        prime(b, clock, b)
        await fill(a, keys[:4])
        await fill(b, keys[4:])
        await publish(a, b)
        interval = digests_of(a).interval_of(ms(clock))
        clock.advance(R)
        made: list[Digest | None] = []

        async def race(tier: S3Tier) -> None:
            made.append(await digests_of(tier).make(interval, ms(clock)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(race, a)
            tg.start_soon(race, b)
        assert sum(digest is not None for digest in made) == 1
        assert digests_of(a).lost + digests_of(b).lost == 1
        lists = c._sync.requests["list"]
        for tier in (a, b, c):
            await tier._sync.refresh_once()
            assert_knows(tier, keys)
        assert c._sync.requests["list"] == lists  # read by name: no listing
        assert (digests_of(c).read, digests_of(c).fallbacks) == (1, 1)  # the first round's


async def test_removals_travel_in_digests(make_tier: MakeS3Tier) -> None:
    clock = _clock()
    keys = fresh_keys(3)
    async with writer_and_reader(make_tier, clock, keys) as (a, c):
        clock.advance(R)
        await a._sync.refresh_once()  # its turn: digests the interval that ended
        await c._sync.refresh_once()
        assert_knows(c, keys)
        await a.delete(keys[0])
        await publish(a)
        clock.advance(R)
        await a._sync.refresh_once()
        await c._sync.refresh_once()
        assert keys[0] not in c._index
        assert_knows(c, keys[1:])
        assert digests_of(a).published >= 2 and digests_of(c).fallbacks == 1


async def test_a_digester_crashing_before_it_publishes_leaves_readers_correct(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _clock()
    keys = fresh_keys(4)
    async with writer_and_reader(make_tier, clock, keys) as (a, c):
        interval = digests_of(a).interval_of(ms(clock))
        clock.advance(R)

        async def crash(*args: Any) -> bool:
            raise Crash

        monkeypatch.setattr(digests_of(a), "_put_new", crash)
        await a._sync._digest_turn()  # it read the segments, then died
        assert a._sync.refresh_failures == 1
        async with raw_client(weed_server.endpoint_url) as client:
            page = await client.list_objects_v2(Bucket=BUCKET, Prefix=digest_dir(prefix))
            assert not page.get("Contents")
        await c._sync.refresh_once()  # the digester may be late: it waits
        assert digests_of(c).missing == 1 and keys[0] not in c._index
        clock.advance(R)
        await c._sync.refresh_once()  # an interval late: it still waits
        assert digests_of(c).fallbacks == 1 and keys[0] not in c._index
        clock.advance(R)
        await c._sync.refresh_once()  # missing an interval after it was due: the journal
        assert_knows(c, keys)
        assert digests_of(c).fallbacks == 2
        monkeypatch.undo()
        await a._sync.refresh_once()  # the next digests carry what the lost one held
        carried = await digests_of(c).fetch(interval + 1)
        assert carried is not None
        stamps = [segment_time_ms(name) or 0 for name, _ in carried.segments]
        assert interval in {digests_of(a).interval_of(stamp) for stamp in stamps}


def _hostile(prefix: str, interval: int, keys: Sequence[bytes]) -> bytes:
    """A digest with a valid seal whose segment names another prefix's pack and objects."""
    outside = Location(pack_name("elsewhere", keys[0], "0" * 16, 1), 4096, 4096)
    segment = encode_segment([(keys[0], outside)], prefix)
    name = segment_name(prefix, interval * int(R * 1000), "f" * 16, 1)
    return encode_digest(Digest(interval, int(R * 1000), "f" * 16, [(name, segment)]), prefix)


async def plant(server: WeedServer, prefix: str, interval: int, digest: bytes) -> None:
    """Put ``digest`` where the digest of ``interval`` goes, as anyone who can write the
    bucket could."""
    async with raw_client(server.endpoint_url) as client:
        name = digest_name(prefix, int(R * 1000), interval)
        await client.put_object(Bucket=BUCKET, Key=name, Body=digest)


async def assert_refused(tier: S3Tier, keys: Sequence[bytes], strangers: Sequence[bytes]) -> None:
    """``tier``'s next round refuses the planted digest whole and reads the journal instead:
    it learns ``keys`` and not the first of ``strangers``."""
    await tier._sync.refresh_once()
    assert digests_of(tier).rejected == 1 and digests_of(tier).fallbacks == 2
    assert_knows(tier, keys)
    assert strangers[0] not in tier._index


@pytest.mark.parametrize("case", ["garbage", "foreign", "another interval", "unsigned"])
async def test_a_bad_digest_is_ignored_and_counted(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str, case: str
) -> None:
    clock = _clock()
    keys, strangers = fresh_keys(4), fresh_keys(1)
    signing = {"integrity_key": SECRET} if case == "unsigned" else {}
    async with writer_and_reader(make_tier, clock, keys, turn=False, **signing) as (a, c):
        interval = digests_of(a).interval_of(ms(clock))
        clock.advance(R)
        good = Digest(interval, int(R * 1000), "f" * 16, [])
        planted = {
            "garbage": b"KVD1" + bytes(200),
            "foreign": encode_digest(good, "elsewhere"),
            "another interval": encode_digest(
                Digest(interval - 1, int(R * 1000), "f" * 16, []), prefix
            ),
            "unsigned": _hostile(prefix, interval, strangers),
        }[case]
        await plant(weed_server, prefix, interval, planted)
        await assert_refused(c, keys, strangers)


async def test_a_digest_carrying_a_segment_stamped_before_its_window_is_rejected(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    """A digester takes the segments stamped from ``CARRY_INTERVALS`` intervals before its
    own: a digest carrying an older one (a segment replayed from long ago, which readers have
    forgotten reading) is untrusted input out of bounds, refused whole like one stamped
    after its interval; the reader reads the journal instead."""
    clock = _clock()
    keys, strangers = fresh_keys(4), fresh_keys(1)
    async with writer_and_reader(make_tier, clock, keys, turn=False) as (a, c):
        interval = digests_of(a).interval_of(ms(clock))
        clock.advance(R)
        stale = digests_of(c).start_ms(interval - CARRY_INTERVALS) - 1
        name = segment_name(prefix, stale, "f" * 16, 1)
        segment = encode_segment([(strangers[0], None)], prefix)
        planted = encode_digest(
            Digest(interval, int(R * 1000), "f" * 16, [(name, segment)]), prefix
        )
        await plant(weed_server, prefix, interval, planted)
        await assert_refused(c, keys, strangers)


async def test_a_hostile_digest_names_nothing_outside_the_prefix(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    """An unsigned digest is only as trusted as the journal: its segments get a segment's
    checks, so an entry naming another prefix's pack is dropped and counted."""
    clock = _clock()
    strangers = fresh_keys(1)
    async with nodes(make_tier, clock) as (c,):
        interval = digests_of(c).interval_of(ms(clock))
        clock.advance(R)
        await plant(weed_server, prefix, interval, _hostile(prefix, interval, strangers))
        await c._sync.refresh_once()
        assert digests_of(c).read == 1 and c._sync.reader.entries_rejected == 1
        assert strangers[0] not in c._index


async def test_a_digester_with_a_clock_ahead_loses_no_key(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A digester whose clock runs most of an interval ahead digests it before its writers
    are done; what they publish after is carried by the next digest."""
    clock, ahead = _clock(), _clock(0.75 * R)
    keys = fresh_keys(6)
    async with nodes(make_tier, ahead, clock, clock) as (a, b, c):
        for tier, turn in ((a, True), (b, False), (c, False)):
            monkeypatch.setattr(digests_of(tier), "designated", lambda i, now, t=turn: t)
        await fill(b, keys[:3])
        await publish(b)
        await a._sync._digest_turn()  # by its clock the interval has ended
        clock.advance(0.4 * R)
        await fill(b, keys[3:])
        await publish(b)  # the same interval, by the writer's clock: after the digest
        clock.advance(0.6 * R)
        ahead.advance(R)
        await c._sync.refresh_once()
        assert_knows(c, keys[:3])
        await a._sync._digest_turn()
        clock.advance(R)
        await c._sync.refresh_once()
        assert_knows(c, keys)
        assert digests_of(c).fallbacks == 1 and digests_of(c).read == 2


async def test_a_reader_behind_the_digests_catches_up_by_name(make_tier: MakeS3Tier) -> None:
    clock = _clock()
    keys = fresh_keys(6)
    async with nodes(make_tier, clock, clock) as (a, c):
        prime(a, clock, a)
        for i in range(3):
            await fill(a, keys[2 * i : 2 * i + 2])
            await a._sync.refresh_once()  # publishes, and digests the interval before
            clock.advance(R)
        await a._sync.refresh_once()
        lists = c._sync.requests["list"]
        await c._sync.refresh_once()  # three intervals behind: three digests
        assert_knows(c, keys)
        assert c._sync.requests["list"] == lists and digests_of(c).read == 3
        clock.advance((MAX_CATCH_UP + 2) * R)
        await c._sync.refresh_once()  # too far behind: reads the journal
        assert digests_of(c).fallbacks == 2


async def test_a_node_that_predates_digests_shares_both_ways(make_tier: MakeS3Tier) -> None:
    clock = _clock()
    keys = fresh_keys(4)
    async with (
        nodes(make_tier, clock, clock) as (a, c),
        nodes(make_tier, clock, index_digests=False) as (old,),
    ):
        prime(a, clock, a)
        await fill(a, keys[:2])
        await fill(old, keys[2:])
        await publish(a, old)
        clock.advance(R)
        await a._sync.refresh_once()
        await c._sync.refresh_once()
        await old._sync.refresh_once()
        assert_knows(c, keys)
        assert_knows(old, keys[:2])
        assert digests_of(c).fallbacks == 1


async def test_a_writer_deletes_its_old_segments_in_one_request(
    make_tier: MakeS3Tier, weed_server: WeedServer, prefix: str
) -> None:
    clock = _clock()
    async with nodes(make_tier, clock) as (a,):
        for key in fresh_keys(DELETE_BATCH):
            await fill(a, [key])
            await publish(a)  # a segment each
        clock.advance(2 * SETTINGS["index_lookback"] + 1)
        deletes = a._sync.requests["delete"]
        await publish(a)
        assert a._sync.requests["delete"] == deletes + 1
        async with raw_client(weed_server.endpoint_url) as client:
            page = await client.list_objects_v2(Bucket=BUCKET, Prefix=journal_prefix(prefix))
            assert not page.get("Contents")


async def test_a_reader_passes_over_a_lost_digest_that_the_next_one_carries(
    make_tier: MakeS3Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _clock()
    keys = fresh_keys(4)
    async with writer_and_reader(make_tier, clock, keys[:2]) as (a, c):
        interval = digests_of(a).interval_of(ms(clock))
        clock.advance(R)
        monkeypatch.setattr(digests_of(a), "designated", lambda i, now: i != interval)
        await a._sync._digest_turn()  # not its turn: nobody digests the interval
        await c._sync.refresh_once()  # missing: it may still come
        await fill(a, keys[2:])
        await publish(a)
        clock.advance(R)
        await a._sync._digest_turn()  # the next digest carries the lost one's segments
        await c._sync.refresh_once()
        assert_knows(c, keys)
        assert digests_of(c).missing == 2 and digests_of(c).fallbacks == 1  # the first round's
