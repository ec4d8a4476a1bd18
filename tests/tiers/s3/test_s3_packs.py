"""Pack objects of the S3 tier against a real SeaweedFS: stores that arrive together share one
PUT, loads that start together share one ranged GET, and every way a pack can go wrong (gone,
corrupt, its writer cancelled) is a miss, never wrong bytes."""

from __future__ import annotations

import os
import time

import anyio
import pytest

from devtools.weed_server import (
    BUCKET,
    WeedServer,
    raw_client,
)
from kvtier import (
    BlockNotFoundError,
    CorruptBlockError,
    EventKind,
    InvalidArgumentError,
    LookupResult,
    TierUnavailableError,
)
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3._pack import PackReads, PackWriter, PendingStore
from kvtier.tiers.s3._pack_format import PACK_DIR, Location, decode_table
from kvtier.tiers.s3.index._journal_format import encode_segment, segment_name, writer_id
from tests.support import INDEX_BY_HAND, fresh_keys, s3_tier

BLOCK = 4096


def _keys_and_blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    keys = fresh_keys(n)
    return keys, [os.urandom(BLOCK) for _ in keys]


async def _store_together(tier: S3Tier, keys: list[bytes], blocks: list[bytes]) -> None:
    """Start every store in one event-loop tick, as the manager's write-through does."""
    async with anyio.create_task_group() as tg:
        for key, block in zip(keys, blocks, strict=True):
            tg.start_soon(tier.store, key, memoryview(block))


async def _load_together(tier: S3Tier, keys: list[bytes]) -> list[bytes]:
    out = [bytearray(BLOCK) for _ in keys]
    async with anyio.create_task_group() as tg:
        for key, dst in zip(keys, out, strict=True):
            tg.start_soon(tier.load, key, memoryview(dst))
    return [bytes(b) for b in out]


async def _objects(server: WeedServer, prefix: str) -> list[str]:
    async with raw_client(server.endpoint_url) as client:
        page = await client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return [item["Key"] for item in page.get("Contents", ())]


async def _packs(server: WeedServer, prefix: str) -> list[str]:
    return [name for name in await _objects(server, prefix) if f"/{PACK_DIR}/" in name]


async def _read(server: WeedServer, name: str) -> bytes:
    async with raw_client(server.endpoint_url) as client:
        response = await client.get_object(Bucket=BUCKET, Key=name)
        return bytes(await response["Body"].read())


async def _one_pack(
    server: WeedServer, prefix: str, tier: S3Tier, keys: list[bytes], blocks: list[bytes]
) -> str:
    """Store ``blocks`` together, in one pack; its object name."""
    await _store_together(tier, keys, blocks)
    (pack,) = await _packs(server, prefix)
    return pack


async def test_stores_together_share_a_pack_and_another_node_loads_it_with_one_get(
    weed_server: WeedServer, prefix: str
) -> None:
    keys, blocks = _keys_and_blocks(11)
    async with s3_tier(weed_server, prefix, pack_blocks=4) as writer:
        assert writer.write_batch == 4
        await _store_together(writer, keys, blocks)
        stats = writer.statistics()
        # 11 stores in one tick: the first to get a PUT slot sends 4, the next waiting one
        # the next 4, then the last 3; one PUT each, no block object.
        assert (stats.stores, stats.packs_written, stats.blocks_packed) == (11, 3, 11)
        names = await _objects(weed_server, prefix)
        assert len(names) == 3 and all(f"/{PACK_DIR}/" in n for n in names)
        # The writer itself loads the packed blocks from the index's locations.
        assert await _load_together(writer, keys) == blocks

    # Another node: its load at open (the journal, then a listing that reads the pack
    # tables) knows every block's pack.
    async with s3_tier(weed_server, prefix, pack_blocks=4) as reader:
        assert await reader.wait_index_loaded()
        assert reader.statistics().index_keys == 11
        assert all(reader.lookup(k) is LookupResult.HIT for k in keys)
        assert await _load_together(reader, keys) == blocks
        stats = reader.statistics()
        # The loads of each pack started together: one ranged GET per pack, not per block.
        assert (stats.loads, stats.pack_gets, stats.pack_sections_read) == (11, 3, 11)


async def test_a_packed_block_stored_again_on_its_own_after_a_delete_stays_a_hit(
    weed_server: WeedServer, prefix: str
) -> None:
    """Node A deletes a packed block (its pack goes with it); node B stores it again as its
    own object. C knew it in the pack: the removal's check finds the pack gone and the
    block's own object there, so C keeps the block, forgets the pack, and loads it."""
    keys, blocks = _keys_and_blocks(2)
    async with (
        s3_tier(weed_server, prefix, name="a", pack_blocks=4, **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", pack_blocks=1, **INDEX_BY_HAND) as b,
        s3_tier(weed_server, prefix, name="c", **INDEX_BY_HAND) as c,
    ):
        await _store_together(a, keys, blocks)
        await a.refresh_index()
        await c.refresh_index()
        assert c._index.location(keys[0]) is not None
        await a.delete(keys[0])  # the pack too: keys[1] goes with it
        await b.store(keys[0], memoryview(blocks[0]))
        await b.refresh_index()
        await a.refresh_index()
        await c.refresh_index()
        assert c.lookup(keys[0]) is LookupResult.HIT
        assert c._index.location(keys[0]) is None
        assert await _load_together(c, keys[:1]) == blocks[:1]
        assert c.statistics().pack_gets == 0


async def test_a_pack_written_after_open_is_learnt_from_the_journal(
    weed_server: WeedServer, prefix: str
) -> None:
    keys, blocks = _keys_and_blocks(4)
    async with (
        s3_tier(weed_server, prefix, **INDEX_BY_HAND) as reader,
        s3_tier(weed_server, prefix, **INDEX_BY_HAND) as writer,
    ):
        await _store_together(writer, keys, blocks)
        assert writer.statistics().packs_written == 1
        assert [reader.lookup(k) for k in keys] == [LookupResult.MISS] * 4
        await writer.refresh_index()  # publishes a journal segment naming the pack sections
        await reader.refresh_index()
        assert [reader.lookup(k) for k in keys] == [LookupResult.HIT] * 4
        assert await _load_together(reader, keys) == blocks
        assert reader.statistics().pack_gets == 1


async def test_a_deleted_pack_is_a_miss_that_fixes_the_index(
    weed_server: WeedServer, prefix: str
) -> None:
    keys, blocks = _keys_and_blocks(3)
    async with s3_tier(weed_server, prefix) as tier:
        pack = await _one_pack(weed_server, prefix, tier, keys, blocks)
        async with raw_client(weed_server.endpoint_url) as client:
            await client.delete_object(Bucket=BUCKET, Key=pack)
        for key in keys:
            with pytest.raises(BlockNotFoundError):
                await tier.load(key, memoryview(bytearray(BLOCK)))
            assert tier.lookup(key) is LookupResult.MISS
        assert tier.statistics().lookups.misses_by_reason == {"not_found": 3}


async def test_delete_of_a_packed_key_deletes_its_pack(
    weed_server: WeedServer, prefix: str
) -> None:
    keys, blocks = _keys_and_blocks(2)
    async with s3_tier(weed_server, prefix) as tier:
        await _store_together(tier, keys, blocks)
        await tier.delete(keys[0])
        assert await _objects(weed_server, prefix) == []
        assert tier.lookup(keys[0]) is LookupResult.MISS
        with pytest.raises(BlockNotFoundError):  # its neighbour went with the pack
            await tier.load(keys[1], memoryview(bytearray(BLOCK)))
        assert tier.lookup(keys[1]) is LookupResult.MISS


async def test_a_deleted_packs_other_keys_are_removed_with_it_here_and_on_other_nodes(
    weed_server: WeedServer, prefix: str
) -> None:
    """The pack's table is read before the delete: its other keys are announced as removed
    at once (a router learns it without waiting for a load) and published in the journal,
    so another node drops them too, with no load of its own."""
    keys, blocks = _keys_and_blocks(3)
    async with (
        s3_tier(weed_server, prefix, name="a", pack_blocks=4, **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        await _store_together(a, keys, blocks)
        await a.refresh_index()
        await b.refresh_index()
        assert all(b.lookup(k) is LookupResult.HIT for k in keys)
        a.events.drain()
        await a.delete(keys[1])
        removed = [e.keys for e in a.events.drain() if e.kind is EventKind.REMOVED]
        assert sorted(removed) == sorted((k,) for k in keys)
        assert [a.lookup(k) for k in keys] == [LookupResult.MISS] * 3
        await a.refresh_index()  # publishes the three removals
        await b.refresh_index()  # checks each against the bucket, then drops it
        assert [b.lookup(k) for k in keys] == [LookupResult.MISS] * 3
        assert b.statistics().loads == 0


@pytest.mark.parametrize("damage", ["payload", "table offset", "truncated"])
async def test_a_damaged_pack_is_a_corrupt_miss_and_is_kept(
    weed_server: WeedServer, prefix: str, damage: str
) -> None:
    """A section that fails its check is a corrupt miss that drops the key from the index; the
    pack stays: S3 cannot delete part of an object, and its other sections, each with its own
    header and checksum, still serve every node."""
    keys, blocks = _keys_and_blocks(3)
    async with s3_tier(weed_server, prefix) as tier:
        pack = await _one_pack(weed_server, prefix, tier, keys, blocks)
        data = bytearray(await _read(weed_server, pack))
        if damage == "payload":
            data[-100] ^= 0xFF  # inside the last block's payload
        elif damage == "table offset":
            data = data[:200] + data[201:] + b"\0"  # every section shifted by one byte
        else:
            data = data[: len(data) - BLOCK // 2]
        async with raw_client(weed_server.endpoint_url) as client:
            await client.put_object(Bucket=BUCKET, Key=pack, Body=bytes(data))
        with pytest.raises(CorruptBlockError):
            await tier.load(keys[-1], memoryview(bytearray(BLOCK)))
        assert tier.lookup(keys[-1]) is LookupResult.MISS
        stats = tier.statistics()
        assert stats.corrupt_deleted == 0 and stats.failures_by_reason == {"corrupt": 1}
        if damage != "table offset":  # there, every section is shifted: none is intact
            assert await _load_together(tier, keys[:-1]) == blocks[:-1]
        assert await _packs(weed_server, prefix) == [pack]


async def test_ask_mode_refuses_packs() -> None:
    with pytest.raises(InvalidArgumentError, match="lookup_mode='index'"):
        S3Tier(BUCKET, lookup_mode="ask", pack_blocks=4)
    assert S3Tier(BUCKET, lookup_mode="ask").write_batch == 1
    assert S3Tier(BUCKET).write_batch == 8
    with pytest.raises(InvalidArgumentError, match="pack_blocks"):
        S3Tier(BUCKET, pack_blocks=65)


# -- the group commit and the coalesced reads, without a server ----------------------------


async def test_a_cancelled_sender_hands_its_pack_to_the_others() -> None:
    sent: list[list[bytes]] = []
    entered = anyio.Event()

    async def put_pack(items: list[PendingStore]) -> None:
        sent.append([item.key for item in items])
        if len(sent) == 1:
            entered.set()
            await anyio.sleep_forever()  # until its store is cancelled

    async def put_single(item: PendingStore) -> None:
        sent.append([item.key])

    writer = PackWriter(
        pack_blocks=4,
        limiter=anyio.CapacityLimiter(1),
        put_single=put_single,
        put_pack=put_pack,
    )
    items = [PendingStore(bytes([i]), b"", {}, "") for i in range(3)]
    first = anyio.CancelScope()

    async def store_first() -> None:
        with first:
            await writer.store(items[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(store_first)
        for item in items[1:]:
            tg.start_soon(writer.store, item)
        await entered.wait()
        first.cancel()
    # The first store took all three into its PUT; cancelled, it gave the other two back and
    # the first of them sent them.
    assert sent == [[b"\0", b"\1", b"\2"], [b"\1", b"\2"]]
    assert writer.queued == 0 and all(item.error is None for item in items)


async def test_stores_cancelled_while_another_sends_them_are_not_queued_again() -> None:
    sent: list[list[bytes]] = []
    entered = anyio.Event()

    async def put_pack(items: list[PendingStore]) -> None:
        sent.append([item.key for item in items])
        entered.set()
        await anyio.sleep_forever()  # until its store is cancelled

    async def put_single(item: PendingStore) -> None:
        raise AssertionError("sent alone")

    writer = PackWriter(
        pack_blocks=4, limiter=anyio.CapacityLimiter(1), put_single=put_single, put_pack=put_pack
    )
    scopes = [anyio.CancelScope() for _ in range(3)]

    async def store(i: int) -> None:
        with scopes[i]:
            await writer.store(PendingStore(bytes([i]), b"", {}, ""))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(store, i)
        await entered.wait()
        for scope in scopes[1:]:  # the stores carried by store 0's PUT give up first
            scope.cancel()
        await anyio.wait_all_tasks_blocked()
        scopes[0].cancel()
    # Nobody is left to send blocks 1 and 2: they are dropped, not left queued forever.
    assert sent == [[b"\0", b"\1", b"\2"]] and writer.queued == 0


async def test_a_failed_pack_fails_every_store_in_it() -> None:
    async def put_pack(items: list[PendingStore]) -> None:
        raise TierUnavailableError("down", tier="s3", operation="store")

    async def put_single(item: PendingStore) -> None:
        raise AssertionError("sent alone")

    writer = PackWriter(
        pack_blocks=4, limiter=anyio.CapacityLimiter(2), put_single=put_single, put_pack=put_pack
    )
    failed: list[bytes] = []

    async def store(item: PendingStore) -> None:
        with pytest.raises(TierUnavailableError):
            await writer.store(item)
        failed.append(item.key)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(store, PendingStore(bytes([i]), b"", {}, ""))
    assert sorted(failed) == [b"\0", b"\1", b"\2"] and writer.queued == 0


async def test_a_cancelled_leader_hands_the_fetch_to_the_others() -> None:
    calls: list[tuple[int, int]] = []
    entered = anyio.Event()

    async def fetch(name: str, lo: int, hi: int) -> bytes | None:
        calls.append((lo, hi))
        if len(calls) == 1:
            entered.set()
            await anyio.sleep_forever()  # until the leading load is cancelled
        return bytes(range(lo, hi))

    reads = PackReads(fetch)
    a, b = Location("p", 10, 5), Location("p", 15, 5)
    got: dict[str, bytes] = {}
    leader = anyio.CancelScope()

    async def lead() -> None:
        with leader:
            await reads.read(a)

    async def follow() -> None:
        section = await reads.read(b)
        assert section is not None
        got["b"] = bytes(section)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lead)
        tg.start_soon(follow)
        await entered.wait()
        leader.cancel()
    # Both loads joined one ranged GET; its leader cancelled, the other sent its own.
    assert calls == [(10, 20), (15, 20)]
    assert got == {"b": bytes(range(15, 20))}


@pytest.mark.parametrize("claim", ["another key's section", "inside a section"])
async def test_a_wrong_journal_location_is_a_corrupt_miss_and_keeps_the_pack(
    weed_server: WeedServer, prefix: str, claim: str
) -> None:
    """A journal segment that puts a key at the wrong place of a good pack (another key's
    section, or the middle of one) is evidence against that entry, not against the pack: the
    load is a corrupt miss that drops the entry, and every block of the pack stays loadable,
    here and on any other node."""
    keys, blocks = _keys_and_blocks(3)
    async with s3_tier(weed_server, prefix) as writer:
        pack = await _one_pack(weed_server, prefix, writer, keys, blocks)
    sections = dict(decode_table(await _read(weed_server, pack), pack))
    right = sections[keys[1]]
    shift = 0 if claim == "another key's section" else 100
    wrong = Location(pack, right.offset + shift, right.length)
    async with s3_tier(weed_server, prefix, **INDEX_BY_HAND) as reader:
        assert await reader.wait_index_loaded()
        assert reader.statistics().index_keys == 3
        async with raw_client(weed_server.endpoint_url) as client:
            name = segment_name(prefix, int(time.time() * 1000), writer_id(), 1)
            body = encode_segment([(keys[0], wrong)], prefix)
            await client.put_object(Bucket=BUCKET, Key=name, Body=body)
        await reader.refresh_index()
        with pytest.raises(CorruptBlockError):
            await reader.load(keys[0], memoryview(bytearray(BLOCK)))
        assert reader.lookup(keys[0]) is LookupResult.MISS  # the entry is gone
        assert reader.statistics().corrupt_deleted == 0
        assert await _load_together(reader, keys[1:]) == blocks[1:]
    assert await _packs(weed_server, prefix) == [pack]
    async with s3_tier(weed_server, prefix) as other:  # another node lists the pack again
        assert await other.wait_index_loaded()
        assert await _load_together(other, keys) == blocks


async def test_a_journal_location_longer_than_a_block_is_never_fetched(
    weed_server: WeedServer, prefix: str
) -> None:
    """A journal entry may claim any length; a load reads a section only if it is exactly a
    header and a block, so an entry claiming 2**40 bytes costs no GET (it would otherwise
    download the whole pack for one block) and leaves the pack alone."""
    from kvtier.common._format import header_size
    from kvtier.tiers.s3._pack_format import table_length
    from tests.tiers.s3.s3_forge import forged_segment, forged_segment_name

    keys, blocks = _keys_and_blocks(4)
    async with s3_tier(weed_server, prefix) as writer:
        pack = await _one_pack(weed_server, prefix, writer, keys[:3], blocks[:3])
    first = table_length(3, len(keys[0]))
    section = header_size(len(keys[0])) + BLOCK
    lengths = {keys[3]: 2**40, keys[0]: section + 1}  # a stranger, and a known key re-pointed
    async with s3_tier(weed_server, prefix, **INDEX_BY_HAND) as reader:
        async with raw_client(weed_server.endpoint_url) as client:
            body = forged_segment([(key, pack, first, n) for key, n in lengths.items()])
            await client.put_object(Bucket=BUCKET, Key=forged_segment_name(prefix), Body=body)
        await reader.refresh_index()
        for key in lengths:
            with pytest.raises(CorruptBlockError):
                await reader.load(key, memoryview(bytearray(BLOCK)))
            assert reader.lookup(key) is LookupResult.MISS  # the entry is dropped
        stats = reader.statistics()
        assert stats.pack_gets == 0 and stats.index_locations_rejected == 2
        assert await _load_together(reader, keys[1:3]) == blocks[1:3]
    left = [name for name in await _objects(weed_server, prefix) if "/_kvtier_journal/" not in name]
    assert left == [pack]


async def test_loads_of_sections_far_apart_never_share_a_get() -> None:
    """Loads of one pack share a GET only while its span stays within the sections it
    serves: locations from the bucket may claim sections anywhere in the pack."""
    calls: list[tuple[int, int]] = []

    async def fetch(name: str, lo: int, hi: int) -> bytes | None:
        calls.append((lo, hi))
        return bytes((lo + i) % 251 for i in range(min(hi - lo, 1 << 16)))

    reads = PackReads(fetch)
    near = [Location("p", 100 + 10 * i, 10) for i in range(3)]
    far = Location("p", 10**12, 10)
    other_length = Location("p", 130, 20)
    got: dict[Location, bytes | None] = {}

    async def load(where: Location) -> None:
        section = await reads.read(where)
        got[where] = None if section is None else bytes(section)

    async with anyio.create_task_group() as tg:
        for where in [*near, far, other_length]:
            tg.start_soon(load, where)
    assert sorted(calls) == [(100, 130), (130, 150), (10**12, 10**12 + 10)]
    assert reads.bytes == 30 + 20 + 10
    for where, section in got.items():
        assert section == bytes((where.offset + i) % 251 for i in range(where.length))
