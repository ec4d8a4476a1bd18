"""A conformance kit for secondary tiers: every behaviour the tier contract promises.

``await check_tier(make_tier)`` runs every check against fresh tiers from ``make_tier`` (a
callable returning an unopened tier) and raises AssertionError naming the check that failed.
``CHECKS`` holds the checks by name so a test suite can parametrise over them.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence

import anyio

from kvtier.common._errors import BlockNotFoundError, CorruptBlockError, KVTierError, TierError
from kvtier.common._keys import block_keys
from kvtier.common._lookup import LookupResult, MissReason
from kvtier.manager import TieringManager
from kvtier.pools._base import BatchSink, ByteSink
from kvtier.pools._host import HostPool
from kvtier.tiers._base import SecondaryTier, TierStatistics, settled_lookup

__all__ = ["CHECKS", "check_tier", "resolve_lookup"]

MakeTier = Callable[[], SecondaryTier]
Check = Callable[[MakeTier, int], Awaitable[None]]


def _keys(n: int, tag: str) -> list[bytes]:
    return block_keys(
        list(range(n)), 1, namespace=f"kvtier.testing/{tag}/{os.urandom(8).hex()}".encode()
    )


async def resolve_lookup(
    tier: SecondaryTier,
    key: bytes,
    timeout: float = 10.0,  # noqa: ASYNC109 - a test helper's bound, not a cancellation API
) -> LookupResult:
    """Ask ``tier.lookup(key)`` until it stops answering RETRY, waking on the tier's
    notifications rather than polling on a timer."""
    with anyio.fail_after(timeout):
        return await settled_lookup(tier, key)


async def _assert_not_found(tier: SecondaryTier, key: bytes, block_bytes: int, what: str) -> None:
    try:
        await tier.load(key, memoryview(bytearray(block_bytes)))
    except BlockNotFoundError:
        return
    raise AssertionError(f"{what} must raise BlockNotFoundError")


async def check_round_trip(make_tier: MakeTier, block_bytes: int) -> None:
    keys = _keys(3, "round-trip")
    blocks = [os.urandom(block_bytes) for _ in keys]
    async with make_tier() as tier:
        for key, block in zip(keys, blocks, strict=True):
            await tier.store(key, memoryview(block))
        for key, block in zip(keys, blocks, strict=True):
            dst = bytearray(block_bytes)
            await tier.load(key, memoryview(dst))
            assert dst == block, "load returned other bytes than were stored"
        assert await tier.contains_many(keys) == [True, True, True]
        assert await resolve_lookup(tier, keys[0]) is LookupResult.HIT
        assert isinstance(tier.statistics(), TierStatistics)


async def check_unknown_keys(make_tier: MakeTier, block_bytes: int) -> None:
    (key,) = _keys(1, "unknown")
    async with make_tier() as tier:
        assert await tier.contains_many([key]) == [False]
        assert await resolve_lookup(tier, key) is LookupResult.MISS
        await _assert_not_found(tier, key, block_bytes, "load of an unknown key")
        await tier.delete(key)  # deleting what is not there is not an error


async def check_lookup_reason(make_tier: MakeTier, block_bytes: int) -> None:
    """``lookup_with_reason`` answers what ``lookup`` answers, with a ``MissReason`` for a
    miss and None otherwise; a key never stored is ``not_found``, counted under that reason."""
    stored, unknown = _keys(2, "reason")
    async with make_tier() as tier:
        await tier.store(stored, memoryview(os.urandom(block_bytes)))
        for key, expected in ((stored, LookupResult.HIT), (unknown, LookupResult.MISS)):
            assert await resolve_lookup(tier, key) is expected
            before = tier.statistics().lookups.misses_by_reason
            result, reason = tier.lookup_with_reason(key)
            after = tier.statistics().lookups.misses_by_reason
            assert result is expected, (
                f"lookup_with_reason said {result.name}, lookup {expected.name}"
            )
            if expected is LookupResult.HIT:
                assert reason is None, f"a hit came with a miss reason: {reason!r}"
                continue
            assert reason is MissReason.NOT_FOUND, f"an unknown key's reason was {reason!r}"
            assert after.get(reason, 0) == before.get(reason, 0) + 1, (
                f"the miss was not counted under its reason: {dict(before)} -> {dict(after)}"
            )
            assert tier.lookup(key) is result


async def check_survives_reopen(make_tier: MakeTier, block_bytes: int) -> None:
    (key,) = _keys(1, "reopen")
    block = os.urandom(block_bytes)
    tier = make_tier()
    async with tier:
        await tier.store(key, memoryview(block))
    async with tier:  # a closed tier can be opened again and still has its blocks
        dst = bytearray(block_bytes)
        await tier.load(key, memoryview(dst))
        assert dst == block


async def check_overwrite(make_tier: MakeTier, block_bytes: int) -> None:
    (key,) = _keys(1, "overwrite")
    first, second = os.urandom(block_bytes), os.urandom(block_bytes)
    async with make_tier() as tier:
        await tier.store(key, memoryview(first))
        await tier.store(key, memoryview(second))
        dst = bytearray(block_bytes)
        await tier.load(key, memoryview(dst))
        assert dst in (first, second), "a second store of a key must never mix bytes"


async def check_concurrent_stores(make_tier: MakeTier, block_bytes: int) -> None:
    (key,) = _keys(1, "concurrent")
    block = os.urandom(block_bytes)
    async with make_tier() as tier:
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(tier.store, key, memoryview(block))
        dst = bytearray(block_bytes)
        await tier.load(key, memoryview(dst))
        assert dst == block


async def check_delete(make_tier: MakeTier, block_bytes: int) -> None:
    (key,) = _keys(1, "delete")
    async with make_tier() as tier:
        await tier.store(key, memoryview(os.urandom(block_bytes)))
        await tier.delete(key)
        assert await tier.contains_many([key]) == [False]
        await _assert_not_found(tier, key, block_bytes, "load after delete")


async def check_cancellation(make_tier: MakeTier, block_bytes: int) -> None:
    """Cancel stores and loads at their first few checkpoints; the tier must stay consistent:
    a cancelled store leaves the key absent or intact, never torn, and the tier keeps working."""
    keys = _keys(6, "cancel")
    blocks = {key: os.urandom(block_bytes) for key in keys}
    async with make_tier() as tier:
        for i, key in enumerate(keys):
            with anyio.CancelScope() as scope:
                if i % 2 == 0:
                    scope.cancel()  # cancelled at its first checkpoint
                async with anyio.create_task_group() as tg:
                    tg.start_soon(tier.store, key, memoryview(blocks[key]))
                    for _ in range(i):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
            dst = bytearray(block_bytes)
            try:
                await tier.load(key, memoryview(dst))
            except BlockNotFoundError:
                pass
            else:
                assert dst == blocks[key], "a cancelled store left a torn block"
            with anyio.CancelScope() as scope:
                scope.cancel()
                try:
                    await tier.load(key, memoryview(bytearray(block_bytes)))
                except BlockNotFoundError:
                    pass
        for key in keys:  # everything still works after the cancellations
            await tier.store(key, memoryview(blocks[key]))
            dst = bytearray(block_bytes)
            await tier.load(key, memoryview(dst))
            assert dst == blocks[key]


async def check_aclose_idempotent(make_tier: MakeTier, block_bytes: int) -> None:
    tier = make_tier()
    await tier.open()
    await tier.aclose()
    await tier.aclose()
    unopened = make_tier()
    await unopened.aclose()


async def check_bad_destination(make_tier: MakeTier, block_bytes: int) -> None:
    (key,) = _keys(1, "bad-dst")
    async with make_tier() as tier:
        await tier.store(key, memoryview(os.urandom(block_bytes)))
        try:
            await tier.load(key, memoryview(bytearray(block_bytes + 1)))
        except (KVTierError, ValueError):
            pass
        else:
            raise AssertionError("load into a buffer of the wrong size must raise")


class _RejectingPool(HostPool):
    """Reads each promotion from the tier, then rejects the bytes, as a failed checksum
    would: a promotion that fails after the tier did its part."""

    async def fill(self, slot: int, sink: ByteSink) -> None:
        await super().fill(slot, sink)
        raise _rejected()

    async def fill_many(self, slots: Sequence[int], sink: BatchSink) -> Sequence[Exception | None]:
        await super().fill_many(slots, sink)
        return [_rejected() for _ in slots]


def _rejected() -> CorruptBlockError:
    return CorruptBlockError("rejected by the conformance kit", tier="kit", operation="load")


async def check_failed_promotion(make_tier: MakeTier, block_bytes: int) -> None:
    """A promotion from the tier that fails is not started again at every lookup: under a
    TieringManager the key settles as a MISS (reason kept) after one promotion, whatever the
    tier's ``record_miss`` does, instead of a RETRY livelock."""
    (key,) = _keys(1, "failed-promotion")
    pool = _RejectingPool(2, block_bytes, prefault=False)
    async with TieringManager(pool, [make_tier()], failure_ttl=60) as manager:
        (tier,) = manager.tiers
        await tier.store(key, memoryview(os.urandom(block_bytes)))
        result = LookupResult.RETRY
        with anyio.fail_after(10):
            for _ in range(20):  # enough changes to settle; a livelock never does
                changed = manager.watch([key])
                try:
                    result = manager.lookup(key)
                    if result not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                        break
                    await changed.wait()
                finally:
                    manager.unwatch([key], changed)
        stats = manager.statistics()
        assert result is LookupResult.MISS, f"a failed promotion left the key at {result.name}"
        assert stats.promotions.started == 1, (
            f"a failed promotion was started {stats.promotions.started} times"
        )
        assert stats.promotions.failed_by_reason == {"corrupt": 1}
        assert manager.statistics().pool.writing == 0


async def check_batch_round_trip(make_tier: MakeTier, block_bytes: int) -> None:
    """``store_many`` then ``load_many``, pinned and not: every block made it, byte for byte,
    and a key repeated in one batch is harmless."""
    keys = _keys(5, "batch")
    blocks = [os.urandom(block_bytes) for _ in keys]
    async with make_tier() as tier:
        for pinned in (False, True):
            got = await tier.store_many(
                [*keys, keys[0]], [memoryview(b) for b in [*blocks, blocks[0]]], pinned=pinned
            )
            assert got == [None] * (len(keys) + 1), f"store_many failed: {got}"
            dst = bytearray(block_bytes * len(keys))
            views = [memoryview(dst)[i * block_bytes : (i + 1) * block_bytes] for i in range(5)]
            assert await tier.load_many(keys, views, pinned=pinned) == [None] * len(keys)
            assert dst == b"".join(blocks), "load_many returned other bytes than were stored"
        assert await tier.store_many([], []) == []
        assert await tier.load_many([], [], timeout=1.0) == []


async def check_batch_partial(make_tier: MakeTier, block_bytes: int) -> None:
    """A batch where some keys are missing: the others still load, and the result says
    which key failed and why."""
    keys = _keys(4, "batch-partial")
    blocks = {k: os.urandom(block_bytes) for k in keys[::2]}
    async with make_tier() as tier:
        assert await tier.store_many(list(blocks), [memoryview(b) for b in blocks.values()]) == [
            None,
            None,
        ]
        for pinned in (False, True):
            dsts = [bytearray(block_bytes) for _ in keys]
            got = await tier.load_many(keys, [memoryview(d) for d in dsts], pinned=pinned)
            for key, dst, error in zip(keys, dsts, got, strict=True):
                if key in blocks:
                    assert error is None and dst == blocks[key], f"a stored key failed: {error}"
                else:
                    assert isinstance(error, BlockNotFoundError), (
                        f"a missing key must fail with BlockNotFoundError, got {error!r}"
                    )
                    assert isinstance(error, TierError) and error.key == key


async def check_batch_bad_arguments(make_tier: MakeTier, block_bytes: int) -> None:
    keys = _keys(2, "batch-bad")
    async with make_tier() as tier:
        for call in (tier.load_many, tier.store_many):
            try:
                await call(keys, [memoryview(bytearray(block_bytes))])
            except ValueError:
                pass
            else:
                raise AssertionError("a batch with fewer buffers than keys must raise")


CHECKS: dict[str, Check] = {
    "round_trip": check_round_trip,
    "unknown_keys": check_unknown_keys,
    "lookup_reason": check_lookup_reason,
    "survives_reopen": check_survives_reopen,
    "overwrite": check_overwrite,
    "concurrent_stores": check_concurrent_stores,
    "delete": check_delete,
    "cancellation": check_cancellation,
    "aclose_idempotent": check_aclose_idempotent,
    "bad_destination": check_bad_destination,
    "failed_promotion": check_failed_promotion,
    "batch_round_trip": check_batch_round_trip,
    "batch_partial": check_batch_partial,
    "batch_bad_arguments": check_batch_bad_arguments,
}


async def check_tier(make_tier: MakeTier, *, block_bytes: int = 4096) -> None:
    """Run every conformance check; raise AssertionError naming the first that fails."""
    for name, check in CHECKS.items():
        try:
            await check(make_tier, block_bytes)
        except AssertionError as exc:
            raise AssertionError(f"tier conformance check {name!r} failed: {exc}") from exc
