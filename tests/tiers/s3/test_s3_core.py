"""The S3 tier's core and settings without an event loop or a server: the state machine under
the async shell (``kvtier.tiers.s3._core``) and ``S3Config``, driven by hand with a fake clock."""

from __future__ import annotations

import os
import struct

import pytest

from kvtier import (
    AsyncLookupManager,
    CorruptBlockError,
    EventKind,
    IntegrityKey,
    InvalidArgumentError,
    LookupResult,
    MissReason,
    TierEvent,
)
from kvtier.common._format import FLAG_MAC, FORMAT_VERSION, MAGIC, header_size
from kvtier.tiers.s3 import S3Config, S3Tier
from kvtier.tiers.s3._config import pack_blocks
from kvtier.tiers.s3._core import S3Core
from kvtier.tiers.s3._pack_format import Location
from tests.support import ManualClock

BLOCK = 4096


async def _never(keys: list[bytes]) -> list[bool]:  # pragma: no cover - never asked
    raise AssertionError("the core never asks the server")


def _core(clock: ManualClock, **settings: object) -> S3Core:
    config = S3Config.from_keywords(None, bucket="bucket", **settings)
    lookups = AsyncLookupManager(_never, miss_ttl=config.miss_ttl, clock=clock)
    return S3Core(config, integrity_key=None, lookups=lookups, clock=clock)


def test_a_failed_load_suppresses_an_indexed_key_for_miss_ttl() -> None:
    clock = ManualClock(100.0)
    core = _core(clock, miss_ttl=2.0)
    key = os.urandom(16)
    core.wrote(key)
    assert core.index.lookup_with_reason(key) == (LookupResult.HIT, None)
    core.record_miss(key, MissReason.TIMEOUT)
    assert core.index.lookup_with_reason(key) == (LookupResult.MISS, MissReason.TIMEOUT)
    clock.now += 2.5
    assert core.index.lookup(key) is LookupResult.HIT
    core.record_miss(key, MissReason.NOT_FOUND)  # a stale HIT: dropped, not suppressed
    assert core.index.lookup_with_reason(key) == (LookupResult.MISS, MissReason.NOT_FOUND)
    assert core.lookup_statistics().misses_by_reason == {"timeout": 1, "not_found": 1}


def test_stores_of_indexed_keys_are_skipped_in_the_index_mode_only() -> None:
    clock = ManualClock(100.0)
    key = os.urandom(16)
    indexed, asking = _core(clock), _core(clock, lookup_mode="ask")
    for core in (indexed, asking):
        assert not core.should_skip_store(key)
        core.wrote(key)
    assert indexed.should_skip_store(key) and not asking.should_skip_store(key)
    assert (indexed.skipped_existing, asking.skipped_existing) == (1, 0)


def test_a_location_not_a_blocks_size_is_refused_before_any_request() -> None:
    core = _core(ManualClock(100.0))
    key = os.urandom(16)
    good = header_size(len(key)) + BLOCK
    core.check_location(key, Location("p", 64, good), BLOCK)
    with pytest.raises(CorruptBlockError, match="locates this block"):
        core.check_location(key, Location("p", 64, 1 << 40), BLOCK)
    assert core.locations_rejected == 1


def test_corrupt_deletes_are_bounded_and_one_per_object() -> None:
    core = _core(ManualClock(100.0), max_concurrency=2)
    assert core.start_delete("a") and not core.start_delete("a")
    assert core.start_delete("b") and not core.start_delete("c")  # two at once at most
    core.end_delete("a", b"ka", deleted=True)
    core.end_delete("b", b"kb", deleted=False)
    assert core.start_delete("c") and core.corrupt_deleted == 1
    assert core.index.take_removals() == [(b"ka", "corrupt")]  # for the next refresh


@pytest.mark.parametrize("mode", ["index", "ask"])
def test_events_say_what_was_stored_and_what_held_went(mode: str) -> None:
    core = _core(ManualClock(100.0), lookup_mode=mode)
    held, gone, slow, unknown = (os.urandom(16) for _ in range(4))
    for key in (held, gone, slow):
        core.wrote(key)
    assert core.events.drain() == [
        TierEvent(EventKind.STORED, (k,), core.name) for k in (held, gone, slow)
    ]
    core.lost(gone, MissReason.NOT_FOUND)
    core.lost(slow, MissReason.TIMEOUT)  # a failure, not a removal
    core.lost(unknown, MissReason.CORRUPT)  # never held: nothing to tell
    core.deleted(unknown, "deleted")
    core.deleted(held, "deleted")
    removed = [(e.keys, e.reason) for e in core.events.drain() if e.kind is EventKind.REMOVED]
    assert removed == [((gone,), "not_found"), ((held,), "deleted")]
    # A held block found gone is published as deleted (nobody else will tell the others).
    assert core.index.take_removals() == [
        (gone, "deleted"),
        (unknown, "deleted"),
        (held, "deleted"),
    ]


def test_newer_formats_and_signed_blocks_are_kept_by_a_tier_without_a_key() -> None:
    core = _core(ManualClock(100.0))
    newer = MAGIC + struct.pack("<HH", FORMAT_VERSION + 1, 0)
    signed = MAGIC + struct.pack("<HH", FORMAT_VERSION, FLAG_MAC)
    assert "newer format" in core.keep_corrupt(newer)
    assert "no integrity key" in core.keep_corrupt(signed)
    assert core.keep_corrupt(b"garbage!") == ""
    core.integrity_key = IntegrityKey(b"k" * 32)  # a signing tier checks them: a bad one goes
    assert core.keep_corrupt(signed) == ""


def test_breaker_refusals_count_as_unavailable_misses() -> None:
    clock = ManualClock(100.0)
    core = _core(clock, breaker_threshold=1, breaker_reset=5.0)
    permit = core.breaker.allow()
    core.breaker.failure(permit)
    assert core.breaker.rejecting()
    core.breaker_misses += 1
    stats = core.statistics(retries=0)
    assert stats.breaker_state == "open" and stats.lookups.misses_by_reason == {"unavailable": 1}
    clock.now += 5.0
    assert not core.breaker.rejecting()


def test_names_and_packs() -> None:
    core = _core(ManualClock(100.0), prefix="/kv/llama/")
    key = bytes(range(16))
    assert core.object_key(key) == f"kv/llama/00/{key.hex()}"
    first, second = core.next_pack_name(key), core.next_pack_name(key)
    assert first != second and first.startswith("kv/llama/_kvtier_packs/")
    assert core.where == "s3://bucket/kv/llama"


def test_one_definition_per_setting() -> None:
    """The tier takes each setting by the name and default ``S3Config`` gives it; the
    collaborators get it under that name."""
    config = S3Config(bucket="bucket")
    tier = S3Tier("bucket")
    assert tier.config == config
    assert pack_blocks(config) == tier.write_batch == 8
    assert pack_blocks(S3Config(bucket="b", lookup_mode="ask")) == 1
    tier = S3Tier("bucket", config=S3Config(bucket="other", index_refresh=3.0), miss_ttl=9.0)
    assert (tier.bucket, tier.config.index_refresh, tier.config.miss_ttl) == ("bucket", 3.0, 9.0)
    assert tier._sync.index_refresh == 3.0
    with pytest.raises(InvalidArgumentError, match=r"^index_refresh must be"):
        S3Tier("bucket", index_refresh=0)
    with pytest.raises(InvalidArgumentError, match=r"^s3\.index_refresh must be"):
        S3Config(bucket="bucket", index_refresh=0)
    with pytest.raises(TypeError, match="index_refrsh"):
        S3Tier("bucket", index_refrsh=1.0)  # type: ignore[call-arg]


def test_the_tier_keeps_no_credentials_in_its_config() -> None:
    tier = S3Tier(
        "bucket",
        config=S3Config(
            bucket="bucket", aws_access_key_id="AKIDHIDDEN", aws_secret_access_key="shh-secret"
        ),
        integrity_key=IntegrityKey(b"k" * 32),
    )
    assert not tier.config.has_credentials
    assert "shh-secret" not in repr(vars(tier)) and "AKIDHIDDEN" not in repr(vars(tier))
    assert tier._credentials() == {
        "aws_access_key_id": "AKIDHIDDEN",
        "aws_secret_access_key": "shh-secret",
    }
