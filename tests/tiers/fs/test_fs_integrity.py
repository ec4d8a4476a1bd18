"""The integrity key: signed blocks, forgeries refused, the secret never shown.

The threat: anyone who can write to a shared folder (or bucket) publishes a well-formed block
for someone else's key. Each test plays that writer with real files.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import xxhash

from kvtier import CorruptBlockError, IntegrityKey, InvalidArgumentError, KVTierConfig, LookupResult
from kvtier.common._format import (
    FLAG_BLAKE3,
    FLAG_MAC,
    MAC_BYTES,
    HeaderError,
    decode_header,
    encode_header,
    header_size,
    verify_block,
)
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier
from kvtier.tiers.fs._layout import MARKER_NAME
from tests.support import block_file, run_cli
from tests.tiers.fs.fs_worker import key_and_data, served
from tests.tiers.fs.fs_worker import key_of as worker_key

BLOCK = 4096
SECRET = "correct horse battery staple 0123456789"
OTHER = "another secret, also long enough"


key, data = key_and_data("i", BLOCK)


# -- the format ------------------------------------------------------------------------------


def test_signed_header_round_trip_and_refusals() -> None:
    ikey, payload, k = IntegrityKey(SECRET), data(1), key(1)
    head = encode_header(k, payload, integrity_key=ikey)
    assert len(head) == header_size(len(k), integrity_key=ikey) == header_size(len(k)) + MAC_BYTES
    header = decode_header(head, integrity_key=ikey)
    assert header.flags & FLAG_MAC and header.size == len(head)
    verify_block(k, header, payload, integrity_key=ikey)
    with pytest.raises(HeaderError, match="integrity check failed"):
        verify_block(k, header, payload[:-1] + b"\x00", integrity_key=ikey)
    with pytest.raises(HeaderError, match="integrity check failed"):
        verify_block(k, header, payload, integrity_key=IntegrityKey(OTHER))
    with pytest.raises(HeaderError, match="reader has none"):
        decode_header(head)  # a keyless reader cannot tell a forgery: refused
    with pytest.raises(HeaderError, match="not signed"):
        decode_header(encode_header(k, payload), integrity_key=ikey)
    # A signed block with its flag stripped (header checksum recomputed) is unsigned: refused.
    raw = bytearray(head[: header_size(len(k))])
    raw[6] &= ~(FLAG_MAC | FLAG_BLAKE3) & 0xFF
    body_end = len(raw) - 8
    raw[body_end:] = xxhash.xxh3_64_intdigest(bytes(raw[:body_end])).to_bytes(8, "little")
    with pytest.raises(HeaderError, match="not signed"):
        decode_header(raw, integrity_key=ikey)


def test_the_secret_is_never_shown() -> None:
    ikey = IntegrityKey(SECRET)
    assert SECRET not in repr(ikey) and "hidden" in repr(ikey)
    with pytest.raises(TypeError):
        pickle.dumps(ikey)
    with pytest.raises(InvalidArgumentError, match="at least 16 bytes"):
        IntegrityKey("short")
    assert IntegrityKey(SECRET).key_id == ikey.key_id != IntegrityKey(OTHER).key_id


# -- the FS tier ------------------------------------------------------------------------------


async def test_forged_blocks_are_corrupt_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "c"
    # shared: the forgeries come from another writer of the folder
    async with FSTier(root, integrity_key=SECRET, shared=True) as tier:
        await tier.store(key(1), memoryview(data(1)))
        good = block_file(root, key(1)).read_bytes()
        assert decode_header(good, integrity_key=IntegrityKey(SECRET)).flags & FLAG_MAC
        out = bytearray(BLOCK)
        await tier.load(key(1), memoryview(out))
        assert out == data(1)
        evil = b"\x66" * BLOCK
        forgeries = {
            2: encode_header(key(2), evil) + evil,  # well-formed, unsigned
            3: encode_header(key(3), evil, integrity_key=IntegrityKey(OTHER)) + evil,
            # a signed block's payload swapped, every xxh3 checksum made right again
            4: encode_header(key(4), evil, integrity_key=IntegrityKey(OTHER))[:-MAC_BYTES]
            + encode_header(key(4), data(4), integrity_key=IntegrityKey(SECRET))[-MAC_BYTES:]
            + evil,
        }
        for i, raw in forgeries.items():
            target = block_file(root, key(i))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)
            assert await resolve_lookup(tier, key(i)) is LookupResult.HIT  # it is there...
            with pytest.raises(CorruptBlockError):  # ...but never served
                await tier.load(key(i), memoryview(bytearray(BLOCK)))
            assert not target.exists()
            assert tier.lookup(key(i)) is LookupResult.MISS
        assert tier.statistics().failures_by_reason == {"corrupt": 3}
        assert SECRET not in repr(tier)
    assert SECRET not in caplog.text


async def test_nodes_must_agree_on_the_key(tmp_path: Path) -> None:
    signed, plain = tmp_path / "signed", tmp_path / "plain"
    async with FSTier(signed, integrity_key=SECRET) as tier:
        await tier.store(key(1), memoryview(data(1)))
    async with FSTier(plain) as tier:
        await tier.store(key(1), memoryview(data(1)))
    with pytest.raises(InvalidArgumentError, match="set integrity_key"):
        await FSTier(signed).open()
    with pytest.raises(InvalidArgumentError, match="another integrity key"):
        await FSTier(signed, integrity_key=OTHER).open()
    with pytest.raises(InvalidArgumentError, match="unsigned blocks"):
        await FSTier(plain, integrity_key=SECRET).open()
    # Nothing removed.
    assert block_file(signed, key(1)).exists() and block_file(plain, key(1)).exists()
    async with FSTier(signed, integrity_key=IntegrityKey(SECRET)) as tier:  # a restart
        out = bytearray(BLOCK)
        await tier.load(key(1), memoryview(out))
        assert out == data(1)


async def test_two_first_opens_racing_on_an_empty_folder_never_both_open(
    tmp_path: Path,
) -> None:
    """A signed and an unsigned tier both find the folder empty and both write a marker: the
    first one's stands, and the other reads it and refuses, before touching a block."""
    root = tmp_path / "c"
    async with (
        served(root, "auto", "--hold-marker", "--key", SECRET) as signed,
        served(root, "auto", "--hold-marker") as plain,
    ):
        assert await signed.line() == "holding"
        assert await plain.line() == "holding"  # both found it empty: neither wrote yet
        assert await signed.ask("go") == "opened owner=True"
        refused = await plain.ask("go")
        assert refused.startswith("refused") and "set integrity_key" in refused, refused
        assert "at the same time" in refused
        assert await signed.ask("store 1") == "stored 1"
        await signed.quit()
    marker = json.loads((root / MARKER_NAME).read_text())
    assert marker["integrity"]["key_id"] == IntegrityKey(SECRET).key_id
    async with FSTier(root, integrity_key=SECRET) as tier:
        assert await resolve_lookup(tier, worker_key("w", 1)) is LookupResult.HIT


# -- configuration --------------------------------------------------------------------------


async def test_config_from_the_environment(tmp_path: Path) -> None:
    env = {
        "KVTIER_POOL_NUM_BLOCKS": "4",
        "KVTIER_POOL_BLOCK_BYTES": str(BLOCK),
        "KVTIER_FS_ROOT": str(tmp_path / "c"),
        "KVTIER_FS_SHARED": "false",
        "KVTIER_INTEGRITY_KEY": SECRET,
    }
    config = KVTierConfig.from_env(env)
    assert SECRET not in repr(config) and SECRET not in str(config.to_dict())
    assert config.to_dict()["integrity"] == {"key": "***"}
    (tier,) = config.build_tiers()
    assert isinstance(tier, FSTier) and tier.integrity_key is not None and not tier.shared
    assert tier.integrity_key.key_id == IntegrityKey(SECRET).key_id
    with pytest.raises(InvalidArgumentError) as err:
        KVTierConfig.from_env({**env, "KVTIER_INTEGRITY_KEY": "too-short-secret"[:10]})
    assert "KVTIER_INTEGRITY_KEY must be a secret of at least 16 bytes" in str(err.value)
    assert "too-short" not in str(err.value)


# -- the command line ------------------------------------------------------------------------


async def test_verify_a_signed_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "c"
    async with FSTier(root, integrity_key=SECRET) as tier:
        for i in range(3):
            await tier.store(key(i), memoryview(data(i)))
    evil = b"\x66" * BLOCK
    block_file(root, key(9)).parent.mkdir(parents=True, exist_ok=True)
    block_file(root, key(9)).write_bytes(encode_header(key(9), evil) + evil)  # unsigned forgery
    monkeypatch.delenv("KVTIER_INTEGRITY_KEY", raising=False)
    code, _, err = run_cli("verify", str(root))
    assert code == 2 and "KVTIER_INTEGRITY_KEY" in err
    monkeypatch.setenv("KVTIER_INTEGRITY_KEY", OTHER)
    code, _, err = run_cli("verify", str(root))
    assert code == 2 and "another integrity key" in err and OTHER not in err
    monkeypatch.setenv("KVTIER_INTEGRITY_KEY", SECRET)
    code, out, err = run_cli("verify", str(root), "--remove")
    assert code == 1, out + err
    assert "4 blocks checked" in out and "1 corrupt (1 removed)" in out and "not signed" in out
    assert SECRET not in out + err
    code, out, _ = run_cli("inspect", str(root), "--json")
    assert code == 0 and json.loads(out)["signed"] is True
