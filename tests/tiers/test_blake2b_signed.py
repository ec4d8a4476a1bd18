"""What kvtier signed with keyed BLAKE2b before it moved to BLAKE3 still loads: FS block files,
S3 objects and journal segments, with their folder's or prefix's marker moved up to BLAKE3 at
open; new blocks are signed with BLAKE3, and neither MAC passes for the other."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from devtools.weed_server import BUCKET, WeedServer, raw_client
from kvtier import IntegrityKey
from kvtier.common._format import (
    FLAG_BLAKE3,
    FLAG_MAC,
    HeaderError,
    decode_header,
    encode_header,
    verify_block,
)
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._layout import MARKER_NAME
from kvtier.tiers.fs._marker import read_marker
from kvtier.tiers.s3._integrity import marker_key
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3._requests import get_bytes
from kvtier.tiers.s3.index._journal_format import decode_segment, encode_segment, journal_prefix
from tests.support import block_file, fresh_keys, s3_tier

SECRET = "correct horse battery staple 0123456789"
BLOCK = 64 * 1024


def _old_block(key: bytes, payload: bytes, ikey: IntegrityKey) -> bytes:
    """A block as kvtier signed it before BLAKE3 (format 1, keyed BLAKE2b)."""
    return encode_header(key, payload, integrity_key=ikey, legacy_mac=True) + payload


def test_both_macs_verify_and_neither_passes_for_the_other() -> None:
    (key,) = fresh_keys(1)
    payload, ikey = os.urandom(BLOCK), IntegrityKey(SECRET)
    for legacy, flags in ((False, FLAG_MAC | FLAG_BLAKE3), (True, FLAG_MAC)):
        head = encode_header(key, payload, integrity_key=ikey, legacy_mac=legacy)
        header = decode_header(head, integrity_key=ikey)
        assert header.flags == flags
        verify_block(key, header, payload, integrity_key=ikey)
        # The other MAC's bytes in place of this one's: refused.
        swapped = ikey.mac(header.signed, payload, legacy=not legacy)
        with pytest.raises(HeaderError, match="integrity check failed"):
            verify_block(
                key,
                decode_header(head[:-32] + swapped, integrity_key=ikey),
                payload,
                integrity_key=ikey,
            )


async def test_fs_loads_blocks_signed_with_blake2b(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    old, new = fresh_keys(2)
    payload, ikey = os.urandom(BLOCK), IntegrityKey(SECRET)
    async with FSTier(root, integrity_key=ikey, direct_io=False) as tier:
        await tier.store(new, memoryview(payload))
        path = block_file(root, old)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_old_block(old, payload, ikey))
    marker = json.loads(read_marker(root))
    marker["integrity"]["mac"] = "blake2b-256"  # as a folder signed before BLAKE3 says
    (root / MARKER_NAME).write_text(json.dumps(marker))
    async with FSTier(root, integrity_key=ikey) as tier:
        for key in (old, new):
            out = bytearray(BLOCK)
            await tier.load(key, memoryview(out))
            assert bytes(out) == payload
    assert json.loads(read_marker(root))["integrity"]["mac"] == "blake3"


async def test_s3_loads_objects_signed_with_blake2b(weed_server: WeedServer) -> None:
    prefix = f"t/{uuid.uuid4().hex}"
    old, new = fresh_keys(2)
    payload, ikey = os.urandom(BLOCK), IntegrityKey(SECRET)
    async with s3_tier(weed_server, prefix, integrity_key=ikey) as tier:
        await tier.store(new, memoryview(payload))
        name = tier.object_key(old)
    async with raw_client(weed_server.endpoint_url) as client:
        await client.put_object(Bucket=BUCKET, Key=name, Body=_old_block(old, payload, ikey))
        body = json.dumps({"mac": "blake2b-256", "key_id": ikey.key_id}).encode()
        await client.put_object(Bucket=BUCKET, Key=marker_key(prefix), Body=body)
        async with s3_tier(weed_server, prefix, integrity_key=ikey, lookup_mode="ask") as tier:
            for key in (old, new):
                out = bytearray(BLOCK)
                await tier.load(key, memoryview(out))
                assert bytes(out) == payload
        marker = json.loads(await get_bytes(client, BUCKET, marker_key(prefix)))
    assert marker == {"mac": "blake3", "key_id": ikey.key_id}


def test_journal_segments_signed_with_blake2b_still_verify() -> None:
    ikey = IntegrityKey(SECRET)
    entries: list[tuple[bytes, Location | None]] = [(key, None) for key in fresh_keys(3)]
    new = encode_segment(entries, "p", integrity_key=ikey)
    assert new[:4] == b"KVJ4"
    body = b"KVJ3" + new[4:-32]
    old = body + ikey.mac(body, journal_prefix("p").encode(), legacy=True)
    for segment in (new, old):
        assert decode_segment(segment, "p", integrity_key=ikey) == (entries, 0)
