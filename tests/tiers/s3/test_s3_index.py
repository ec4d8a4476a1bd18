"""The S3 tier's existence index: the pure state machine and its settings first, then the
index against a real SeaweedFS (what the bucket may hold, a full index, a refresh loop whose
credentials fail, clock skew) and moto's server (a DELETE the server refuses). The journal and
pack formats it reads are tested in ``test_s3_untrusted.py``."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from devtools.moto_server import MotoServer, create_bucket
from devtools.moto_server import raw_client as moto_client
from devtools.weed_server import (
    ACCESS_KEY,
    BUCKET,
    SECRET_KEY,
    WeedServer,
    raw_client,
)
from kvtier import BlockNotFoundError, InvalidArgumentError, LookupResult, MissReason
from kvtier.common._format import header_size
from kvtier.common._resilience import CircuitBreaker
from kvtier.tiers.s3 import S3Config, S3Tier
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3._requests import Requests
from kvtier.tiers.s3.index import ExistenceIndex, IndexSync
from kvtier.tiers.s3.index._journal_format import (
    MAX_SEGMENT_ENTRIES,
    encode_segment,
    journal_prefix,
    segment_time_ms,
    writer_id,
)
from tests.support import (
    CREDENTIALS_FROM_ENVIRONMENT,
    INDEX_BY_HAND,
    ManualClock,
    fresh_keys,
    s3_tier,
)
from tests.tiers.s3.s3_forge import forged_segment, forged_segment_name

BLOCK = 4096


def test_unknown_key_is_a_miss_and_known_a_hit() -> None:
    index = ExistenceIndex(miss_ttl=2.0, max_keys=10)
    key = os.urandom(16)
    assert index.lookup(key) is LookupResult.MISS
    index.wrote(key)
    assert index.lookup(key) is LookupResult.HIT
    assert index.take_unpublished() == [(key, None)]
    assert index.take_unpublished() == []
    stats = index.statistics()
    assert (stats.hits, stats.misses, stats.misses_by_reason) == (1, 1, {"not_found": 1})


def test_failed_load_suppresses_for_the_ttl_and_gone_object_is_dropped() -> None:
    clock = ManualClock(100.0)
    index = ExistenceIndex(miss_ttl=2.0, max_keys=10, clock=clock)
    a, b = os.urandom(16), os.urandom(16)
    index.add_many([(a, None), (b, None)])
    index.suppress(a, MissReason.TIMEOUT)
    assert index.lookup(a) is LookupResult.MISS  # no promotion loop on a flaky key
    clock.now += 2.5
    assert index.lookup(a) is LookupResult.HIT
    index.suppress(b, MissReason.NOT_FOUND)  # an index HIT whose GET found nothing
    assert b not in index
    assert index.lookup(b) is LookupResult.MISS


def test_max_keys_bounds_memory() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=2)
    keys = [os.urandom(16) for _ in range(3)]
    assert index.add_many([(key, None) for key in keys]) == keys
    assert index.full and len(index) == 2 and index.evictions == 1


def test_requeue_after_a_failed_publish() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    keys = [os.urandom(16) for _ in range(3)]
    for key in keys:
        index.wrote(key)
    taken = index.take_unpublished()
    index.requeue(taken)
    assert index.take_unpublished() == [(key, None) for key in keys]


def test_seen_segments_are_forgotten_past_the_lookback() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    index.seen("old", 1_000)
    index.seen("new", 5_000)
    assert index.unseen(["old", "new", "other"]) == ["other"]
    index.forget_seen_before(2_000)
    assert index.unseen(["old", "new"]) == ["old"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lookup_mode": "sometimes"}, "lookup_mode must be 'index'"),
        ({"index_refresh": 0}, "index_refresh"),
        ({"index_refresh": 10.0, "index_lookback": 15.0}, "index_lookback"),
        ({"index_max_keys": 0}, "index_max_keys"),
    ],
)
def test_index_settings_are_checked(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        S3Tier("bucket", **overrides)  # type: ignore[arg-type]


def test_index_settings_from_the_config_file() -> None:
    from kvtier.manager._stack_config import KVTierConfig

    pool = {"num_blocks": 4, "block_bytes": 4096}
    config = KVTierConfig.from_dict(
        {"pool": pool, "s3": {"bucket": "abc", "lookup_mode": "ask", "index_refresh": 1.0}}
    )
    (tier,) = config.build_tiers()
    assert isinstance(tier, S3Tier)
    assert (tier.config.lookup_mode, tier.config.index_refresh) == ("ask", 1.0)
    with pytest.raises(InvalidArgumentError, match="index_lookback"):
        KVTierConfig.from_dict({"pool": pool, "s3": {"bucket": "abc", "index_refresh": 40.0}})


def test_packed_keys_keep_their_location_until_dropped() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=10)
    a, b = os.urandom(16), os.urandom(16)
    where = Location("p/_kvtier_packs/ab/x-y-1", 100, 50)
    index.wrote(a, where)
    index.add(b)
    assert (index.location(a), index.location(b)) == (where, None)
    assert index.take_unpublished() == [(a, where)]
    index.add(a)  # its own object listed too: reading it from the pack stays cheaper
    assert index.location(a) == where
    index.suppress(a, MissReason.NOT_FOUND)  # the pack is gone
    assert a not in index and index.location(a) is None


# -- a full index ------------------------------------------------------------------------


def test_a_full_index_evicts_the_oldest_and_keeps_what_this_node_wrote(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    index = ExistenceIndex(miss_ttl=1.0, max_keys=4)
    listed = [os.urandom(16) for _ in range(4)]
    index.add_many([(key, None) for key in listed])
    written = [os.urandom(16) for _ in range(3)]
    for key in written:
        index.wrote(key)
        assert index.lookup(key) is LookupResult.HIT  # just written: a HIT at once
    assert [index.lookup(k) for k in listed] == [LookupResult.MISS] * 3 + [LookupResult.HIT]
    assert (len(index), index.evictions, index.full) == (4, 3, True)
    assert [k for k, _ in index.take_unpublished()] == written
    full = [r for r in caplog.records if "existence index full" in r.getMessage()]
    assert len(full) == 1  # once per burst, not per key


def test_a_key_dropped_and_indexed_again_is_evicted_by_its_new_place() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=3)
    a, b, c, d, e, f = (os.urandom(16) for _ in range(6))
    index.add_many([(a, None), (b, None), (c, None)])
    index.discard(a)  # a stale HIT: its GET found nothing
    index.add(a)  # written again: now the newest
    index.add(d)
    assert (a in index, b in index) == (True, False)
    index.add(e)
    assert (a in index, c in index) == (True, False)
    index.add(f)
    assert a not in index and all(k in index for k in (d, e, f))
    assert (len(index), index.evictions) == (3, 3)


def test_an_index_dropping_keys_below_its_bound_keeps_them_all() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=8)
    kept = [os.urandom(16) for _ in range(4)]
    index.add_many([(key, None) for key in kept])
    for _ in range(200):  # keys found gone and written again, many times over the bound
        churn = os.urandom(16)
        index.add(churn)
        index.discard(churn)
    assert all(key in index for key in kept) and len(index) == 4 and index.evictions == 0


def test_a_publish_takes_a_bounded_batch_and_a_failed_one_goes_first_again() -> None:
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    keys = [os.urandom(16) for _ in range(10)]
    for key in keys:
        index.wrote(key)
    first = index.take_unpublished(4)
    assert [k for k, _ in first] == keys[:4]
    index.requeue(first)  # its PUT failed
    late = os.urandom(16)
    index.wrote(late)
    assert [k for k, _ in index.take_unpublished()] == [*keys, late]
    with pytest.raises(ValueError, match="at most"):
        encode_segment([(os.urandom(16), None)] * (MAX_SEGMENT_ENTRIES + 1), "p")


# -- against a server --------------------------------------------------------------------


# refreshed by the tests, not by the loop
_tier = functools.partial(s3_tier, **INDEX_BY_HAND)


async def _exists(server: WeedServer, name: str) -> bool:
    async with raw_client(server.endpoint_url) as client:
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=name)
    return any(item["Key"] == name for item in page.get("Contents", ()))


async def test_journal_entries_naming_objects_outside_the_packs_folder_are_ignored(
    weed_server: WeedServer,
) -> None:
    """A segment pointing keys at objects outside this prefix's packs (another prefix's block
    and pack, a file of the prefix, a model file, a '..' path) teaches the reader nothing: the
    keys stay misses, their loads never touch those objects, and every object is still there."""
    prefix, other = f"idx/{uuid.uuid4().hex}", f"idx/{uuid.uuid4().hex}"
    theirs = fresh_keys(3)
    async with _tier(weed_server, other) as neighbour:
        await neighbour.store(theirs[0], memoryview(os.urandom(BLOCK)))
        async with anyio.create_task_group() as tg:  # stored together: one pack
            for key in theirs[1:]:
                tg.start_soon(neighbour.store, key, memoryview(os.urandom(BLOCK)))
    async with raw_client(weed_server.endpoint_url) as client:
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=f"{other}/_kvtier_packs/")
        (their_pack,) = [item["Key"] for item in page["Contents"]]
        for name in (f"{prefix}/notes.txt", f"models/{uuid.uuid4().hex}.bin"):
            await client.put_object(Bucket=BUCKET, Key=name, Body=os.urandom(2 * BLOCK))
    victims = [
        neighbour.object_key(theirs[0]),
        their_pack,
        f"{prefix}/notes.txt",
        f"{prefix}/_kvtier_packs/../notes.txt",
        name,
    ]
    keys = fresh_keys(len(victims))
    section = header_size(len(keys[0])) + BLOCK
    entries = [(key, victim, 100, section) for key, victim in zip(keys, victims, strict=True)]
    async with _tier(weed_server, prefix) as reader:
        async with raw_client(weed_server.endpoint_url) as client:
            body = forged_segment(entries)
            await client.put_object(Bucket=BUCKET, Key=forged_segment_name(prefix), Body=body)
        await reader.refresh_index()
        for key in keys:
            assert reader.lookup(key) is LookupResult.MISS
            with pytest.raises(BlockNotFoundError):
                await reader.load(key, memoryview(bytearray(BLOCK)))
        stats = reader.statistics()
        assert (stats.journal_entries_rejected, stats.corrupt_deleted) == (len(victims), 0)
    for victim in (*victims[:3], victims[4]):
        assert await _exists(weed_server, victim), victim


async def test_a_full_index_keeps_the_blocks_this_node_writes(
    weed_server: WeedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    keys = fresh_keys(7)
    async with _tier(weed_server, f"idx/{uuid.uuid4().hex}", index_max_keys=4) as tier:
        for key in keys:
            await tier.store(key, memoryview(os.urandom(BLOCK)))
        assert [tier.lookup(k) for k in keys] == [LookupResult.MISS] * 3 + [LookupResult.HIT] * 4
        await tier.store(keys[-1], memoryview(os.urandom(BLOCK)))  # indexed: nothing to send
        stats = tier.statistics()
        assert (stats.index_keys, stats.index_evictions, stats.stores_skipped_existing) == (4, 3, 1)
    assert sum("existence index full" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture
def credential_process(aws_environment: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An AWS environment whose only credentials come from a ``credential_process`` that
    answers while the file this returns exists and fails once it is gone. Credentials that
    expire within ten minutes are refreshed before every request, so each request runs the
    process."""
    script = tmp_path / "creds.sh"
    script.write_text(
        '[ -f "$(dirname "$0")/flag" ] || { echo "credential source gone" >&2; exit 1; }\n'
        'printf \'{"Version": 1, "AccessKeyId": "%s", "SecretAccessKey": "%s", '
        '"Expiration": "%s"}\' '
        f"{ACCESS_KEY} {SECRET_KEY} "
        '"$(date -u -d "+5 minutes" +%Y-%m-%dT%H:%M:%SZ)"\n'
    )
    (tmp_path / "config").write_text(f"[default]\ncredential_process = /bin/sh {script}\n")
    (tmp_path / "flag").touch()
    return tmp_path / "flag"


class _Heard(logging.Handler):
    """Sets an event when a log record says ``words`` (the loop under test has no other
    outward sign of a round that failed)."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words
        self.event = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


async def test_a_failing_credential_provider_does_not_stop_the_refresh_loop(
    credential_process: Path, weed_server: WeedServer
) -> None:
    """botocore raises CredentialRetrievalError, which kvtier does not translate, from inside
    the refresh loop's LIST; the loop logs and counts it and goes on, and the task that opened
    the tier (the engine's) is not cancelled."""
    heard = _Heard("index refresh failed")
    sync_logger = logging.getLogger("kvtier.tiers.s3.index._sync")
    sync_logger.addHandler(heard)
    try:
        prefix = f"idx/{uuid.uuid4().hex}"
        tier = s3_tier(weed_server, prefix, **CREDENTIALS_FROM_ENVIRONMENT, index_refresh=0.05)
        async with tier:
            await anyio.Path(credential_process).unlink()  # the credential source goes away
            with anyio.fail_after(30):
                await heard.event.wait()
            assert tier.statistics().index_refresh_failures >= 1
            await anyio.Path(credential_process).touch()  # and comes back: the tier works on
            (key,) = fresh_keys(1)
            block = os.urandom(BLOCK)
            await tier.store(key, memoryview(block))
            out = bytearray(BLOCK)
            await tier.load(key, memoryview(out))
            assert out == block
    finally:
        sync_logger.removeHandler(heard)


def _sync(
    client: Any, prefix: str, wall: Any, *, lookback: float = 60.0, index: ExistenceIndex
) -> IndexSync:
    """An IndexSync over ``client`` with the wall clock ``wall`` (the tier's, by hand)."""
    requests = Requests(
        name="s3",
        bucket=BUCKET,
        endpoint_label="test",
        max_attempts=1,
        max_concurrency=4,
        breaker=CircuitBreaker(100, 1.0),
    )
    config = S3Config(
        bucket=BUCKET,
        prefix=prefix,
        index_refresh=1.0,
        index_lookback=lookback,
        index_list_timeout=10.0,
    )
    return IndexSync(
        index,
        config,
        name="s3",
        writer=writer_id(),
        call=requests.call,
        client=lambda: client,
        notify=lambda keys: None,
        wall=wall,
    )


async def test_a_clock_behind_the_server_is_warned_about_once(
    weed_server: WeedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer whose clock is past the lookback behind stamps segments no reader lists: the
    server's Date header shows it, and it says so once."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    async with raw_client(weed_server.endpoint_url) as client:
        sync = _sync(client, f"idx/{uuid.uuid4().hex}", lambda: time.time() - 120, index=index)
        for key in fresh_keys(2):
            index.wrote(key)
            await sync.refresh_once()  # a PUT and a LIST, each with a Date header
        warned = [r.getMessage() for r in caplog.records if "clock is" in r.getMessage()]
        assert len(warned) == 1 and "behind" in warned[0]
        assert sync.segments_published == 2 and sync.refresh_failures == 0
        assert sync.clock_skew < -100


@pytest.fixture
async def deny_deletes() -> AsyncIterator[tuple[MotoServer, dict[str, str], Any]]:
    """moto's server with IAM auth on, and a user who may do anything but DELETE until the
    returned function allows it (the server refuses with AccessDenied: no fault injected
    into the client)."""
    server = MotoServer()
    await server.astart()
    try:
        statements: list[dict[str, Any]] = [
            {"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"},
            {"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "*"},
        ]
        async with moto_client(server.endpoint_url, "iam") as iam:
            await iam.create_user(UserName="kvtier")
            created = (await iam.create_access_key(UserName="kvtier"))["AccessKey"]
            document = json.dumps({"Version": "2012-10-17", "Statement": statements})
            await iam.put_user_policy(UserName="kvtier", PolicyName="s3", PolicyDocument=document)
        await create_bucket(server.endpoint_url, BUCKET)
        await anyio.to_thread.run_sync(server.set_auth, 0)
        credentials = {
            "aws_access_key_id": created["AccessKeyId"],
            "aws_secret_access_key": created["SecretAccessKey"],
        }

        async def allow_deletes() -> None:
            document = json.dumps({"Version": "2012-10-17", "Statement": statements[:1]})
            async with moto_client(server.endpoint_url, "iam", **credentials) as iam:
                await iam.put_user_policy(
                    UserName="kvtier", PolicyName="s3", PolicyDocument=document
                )

        yield server, credentials, allow_deletes
    finally:
        await server.astop()


async def test_an_old_segment_whose_delete_failed_is_deleted_later(
    deny_deletes: tuple[MotoServer, dict[str, str], Any],
) -> None:
    server, credentials, allow_deletes = deny_deletes
    now = [time.time()]
    index = ExistenceIndex(miss_ttl=1.0, max_keys=100)
    prefix = "journal"
    async with moto_client(server.endpoint_url, **credentials) as client:
        sync = _sync(client, prefix, lambda: now[0], lookback=10.0, index=index)
        first, second = fresh_keys(2)
        index.wrote(first)
        await sync.refresh_once(poll=False)
        now[0] += 30  # the first segment is past twice the lookback
        index.wrote(second)
        await sync.refresh_once(poll=False)  # its DELETE is refused
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=journal_prefix(prefix))
        assert len(page["Contents"]) == 2
        await allow_deletes()
        await sync.refresh_once(poll=False)  # nothing new to publish: the old one goes now
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=journal_prefix(prefix))
        (left,) = [item["Key"] for item in page["Contents"]]
        assert segment_time_ms(left) == int(now[0] * 1000)
