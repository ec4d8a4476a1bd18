"""The block format at rest (docs/design.md, "Data at rest"), shared by every tier that writes
bytes.

A block is a fixed header followed by its payload. The header names the key it belongs to, so
a file or object renamed, truncated or swapped can never be served as another block, and
carries an xxh3-64 checksum of the payload (xxh3 runs at memory speed, far above disk and
network, so verifying every load costs little) plus a checksum of the header itself.

**Integrity key (signed blocks).** xxh3 catches corruption, not forgery: anyone who can write
to a shared folder or bucket can publish a well-formed block for any key. With an
``IntegrityKey`` (a secret every node sharing the tier sets), a block also carries a keyed
MAC over its header and payload, and only blocks whose MAC verifies are served.
How a signed block differs at rest (the decision, and why):

- the header's ``flags`` has ``FLAG_MAC`` set and 32 bytes of MAC follow the header checksum,
  so a signed header is ``MAC_BYTES`` longer (``header_size(n, integrity_key=k)``). The format
  version stays 1: an unsigned block is byte for byte what it was, and the flag is covered by
  the header checksum and by the MAC, so stripping it is caught.
- the MAC is keyed BLAKE3 (``FLAG_BLAKE3`` set too): it runs several times faster than
  BLAKE2b on one core, so a signed load keeps up with an unsigned one. Blocks signed before it
  (``FLAG_MAC`` alone: keyed BLAKE2b-256) still verify; the flags are covered by the MAC, so a
  block cannot be moved from one MAC to the other. One thread per MAC: the tiers already hash
  many blocks at once in their worker threads, and on a few cores BLAKE3's own threads were
  slower for a block (docs/design.md has the figures).
- a reader with a key refuses an unsigned block, and a signed block whose MAC does not verify
  (forged, or signed with another key): ``HeaderError``, which tiers turn into a ``corrupt``
  miss. A reader without a key refuses a signed block (it cannot tell a forgery), and a reader
  from before this flag existed refuses it too (its length check fails on the 32 extra bytes).
- the xxh3 payload checksum is still written, so keyless tools (``kvtier verify``) can still
  find bit rot; with a key, loads check the MAC instead (it covers the same bytes).

How a codec uses it (the FS tier does exactly this; the S3 codec can do the same)::

    ikey = IntegrityKey(secret)                     # once, from config; None when unset
    head = encode_header(key, payload, integrity_key=ikey)          # write: head + payload
    size = header_size(len(key), integrity_key=ikey)               # bytes before the payload
    header = decode_header(raw[:size], integrity_key=ikey)          # read: check the header
    verify_block(key, header, raw[size:], integrity_key=ikey)       # then the payload

Pass the same ``integrity_key`` (or ``None``) to all four. ``decode_header`` needs only the
first ``header_size(...)`` bytes; ``verify_block`` checks the key, the length and then the MAC
(with a key) or the xxh3 checksum (without).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

import blake3
import xxhash

from kvtier.common._settings import Section, parse_secret, spec

__all__ = [
    "ALIGNED_FORMAT_VERSION",
    "FLAG_BLAKE3",
    "FLAG_MAC",
    "FORMAT_VERSION",
    "LEGACY_MAC_NAME",
    "MAC_BYTES",
    "MAC_NAME",
    "MAGIC",
    "PAYLOAD_ALIGN",
    "BlockHeader",
    "HeaderError",
    "IntegrityConfig",
    "IntegrityKey",
    "PayloadCheck",
    "checksum",
    "decode_header",
    "encode_header",
    "header_size",
    "verify_block",
]

MAGIC = b"KVTB"
FORMAT_VERSION = 1
# Version 2 differs only in where the payload starts: at the first multiple of PAYLOAD_ALIGN
# after the header (zero bytes between), so a file's payload can move by O_DIRECT straight
# between the disk and an aligned buffer. The FS tier writes it; objects in S3 stay version 1.
ALIGNED_FORMAT_VERSION = 2
PAYLOAD_ALIGN = 4096
# magic, version, flags, key length, reserved, payload length, payload checksum
_FIXED = struct.Struct("<4sHHHHQQ")
_HEADER_SUM = struct.Struct("<Q")
MAX_KEY_BYTES = 255
FLAG_MAC = 0x0001  # a MAC under the tier's integrity key follows the header checksum
FLAG_BLAKE3 = 0x0002  # with FLAG_MAC: that MAC is keyed BLAKE3 (alone: keyed BLAKE2b-256)
MAC_BYTES = 32
# What a signed folder's or prefix's marker names as its MAC, now and before BLAKE3.
MAC_NAME = "blake3"
LEGACY_MAC_NAME = "blake2b-256"
_KNOWN_FLAGS = FLAG_MAC | FLAG_BLAKE3
MIN_SECRET_BYTES = 16


class HeaderError(ValueError):
    """The bytes are not a valid block header; the caller maps it to a ``corrupt`` miss."""


class IntegrityKey:
    """The secret that signs and verifies blocks (see the module docstring).

    Built from a secret of at least 16 bytes (str or bytes; a str is UTF-8 encoded); the MAC
    keys (one for BLAKE3, one for the BLAKE2b of older blocks) are derived from it with
    BLAKE2b, so a secret of any length works. The secret is never shown: not in ``repr``, not
    in error messages. ``key_id`` is a short public fingerprint (a MAC of a constant), for
    telling keys apart in a folder marker without revealing them.
    """

    __slots__ = ("_b3_key", "_mac_key", "key_id")

    def __init__(self, secret: str | bytes) -> None:
        if isinstance(secret, str):
            raw = secret.encode()
        elif isinstance(secret, bytes | bytearray):
            raw = bytes(secret)
        else:
            raise _invalid(f"an integrity key must be str or bytes, got {type(secret).__name__}")
        if len(raw) < MIN_SECRET_BYTES:
            raise _invalid(
                f"an integrity key must be at least {MIN_SECRET_BYTES} bytes; use a random "
                "secret such as the output of `python -c 'import secrets; "
                "print(secrets.token_hex(32))'`"
            )
        self._mac_key = hashlib.blake2b(raw, digest_size=32, person=b"kvtier-mac-key").digest()
        self._b3_key = hashlib.blake2b(raw, digest_size=32, person=b"kvtier-mac-b3").digest()
        self.key_id = hashlib.blake2b(
            b"key-id", key=self._mac_key, digest_size=8, person=b"kvtier-key-id"
        ).hexdigest()

    def mac(
        self, signed: bytes | bytearray | memoryview, payload: object, *, legacy: bool = False
    ) -> bytes:
        """The MAC of a block: its header (up to the header checksum) and its payload; keyed
        BLAKE3, or with ``legacy`` the keyed BLAKE2b of blocks signed before it."""
        h = self.hasher(signed, legacy=legacy)
        h.update(payload)
        digest: bytes = h.digest()
        return digest

    def hasher(self, signed: bytes | bytearray | memoryview, *, legacy: bool = False) -> Any:
        """A MAC in progress over ``signed``; feed it the payload, then take ``digest()``."""
        if legacy:
            h: Any = hashlib.blake2b(
                key=self._mac_key, digest_size=MAC_BYTES, person=b"kvtier-block"
            )
        else:
            h = blake3.blake3(key=self._b3_key)
        h.update(signed)
        return h

    def __repr__(self) -> str:
        return "<IntegrityKey (secret hidden)>"

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("an IntegrityKey is not picklable: pass the secret explicitly")


@dataclass(frozen=True, slots=True, repr=False)
class IntegrityConfig(Section):
    """The secret every node sharing a tier sets, so only blocks signed with it are served:
    the ``[integrity]`` section, best set with ``KVTIER_INTEGRITY_KEY``; never shown. One
    key for the whole stack, not per tier: every tier that shares blocks with other nodes
    signs them with the same secret. It becomes each tier's ``IntegrityKey``."""

    SECTION: ClassVar[str] = "integrity"

    key: str = field(repr=False, metadata=spec(parse_secret, secret=True))


def _invalid(message: str) -> ValueError:
    from kvtier.common._errors import (
        InvalidArgumentError,  # the error tree imports nothing from here
    )

    return InvalidArgumentError(message)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: bytes
    payload_length: int
    payload_checksum: int
    flags: int = 0
    mac: bytes = field(default=b"", repr=False)
    signed: bytes = field(default=b"", repr=False, compare=False)  # what the MAC covers
    version: int = FORMAT_VERSION

    @property
    def size(self) -> int:
        return header_size(len(self.key)) + (MAC_BYTES if self.flags & FLAG_MAC else 0)

    @property
    def payload_offset(self) -> int:
        """Where the payload starts: right after the header (version 1) or aligned (2)."""
        return payload_offset(self.size, self.version)


def header_size(key_length: int, *, integrity_key: IntegrityKey | None = None) -> int:
    """Bytes before the payload for a key of ``key_length`` bytes (more when signed)."""
    mac = MAC_BYTES if integrity_key is not None else 0
    return _FIXED.size + key_length + _HEADER_SUM.size + mac


def payload_offset(header_bytes: int, version: int = FORMAT_VERSION) -> int:
    """Where the payload starts after a header of ``header_bytes`` in format ``version``."""
    if version == ALIGNED_FORMAT_VERSION:
        return -(-header_bytes // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    return header_bytes


# From this size on a payload is hashed by the streaming hasher, which lets go of the GIL while
# it runs (the one-shot function holds it): the same value, and a block's checksum no longer
# stalls every other thread of the process (a reader, a writer, the event loop) meanwhile.
_GIL_FREE_BYTES = 64 << 10


def checksum(payload: bytes | bytearray | memoryview) -> int:
    if memoryview(payload).nbytes >= _GIL_FREE_BYTES:
        return int(xxhash.xxh3_64(payload).intdigest())
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(
    key: bytes,
    payload: bytes | bytearray | memoryview,
    flags: int = 0,
    *,
    integrity_key: IntegrityKey | None = None,
    version: int = FORMAT_VERSION,
    legacy_mac: bool = False,
) -> bytes:
    """Header bytes for ``payload`` stored under ``key``; signed when ``integrity_key`` is set.
    For ``ALIGNED_FORMAT_VERSION`` the caller pads the header to ``payload_offset``.
    ``legacy_mac`` signs with BLAKE2b as kvtier did before BLAKE3 (to make old blocks)."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1 to {MAX_KEY_BYTES} bytes")
    if integrity_key is not None:
        flags |= FLAG_MAC if legacy_mac else FLAG_MAC | FLAG_BLAKE3
    fixed = _FIXED.pack(
        MAGIC, version, flags, len(key), 0, memoryview(payload).nbytes, checksum(payload)
    )
    body = fixed + key
    head = body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))
    if integrity_key is None:
        return head
    return head + integrity_key.mac(body, payload, legacy=legacy_mac)


def decode_header(
    data: bytes | bytearray | memoryview,
    *,
    integrity_key: IntegrityKey | None = None,
    versions: tuple[int, ...] = (FORMAT_VERSION,),
) -> BlockHeader:
    """Parse and check a header; raise ``HeaderError`` saying what is wrong.

    With ``integrity_key`` an unsigned block is refused; without one a signed block is refused
    (its MAC cannot be checked). The MAC itself is checked by ``verify_block``. ``versions``
    are the format versions the caller reads (the FS tier reads both, S3 only version 1).
    """
    view = memoryview(data)
    if view.nbytes < _FIXED.size:
        raise HeaderError(f"header truncated: {view.nbytes} bytes")
    magic, version, flags, key_len, _, length, payload_sum = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise HeaderError("bad magic: not a kvtier block")
    if version not in versions:
        readable = " and ".join(map(str, versions))
        raise HeaderError(f"format version {version}, this reader takes {readable}")
    end = _FIXED.size + key_len
    if key_len == 0 or view.nbytes < end + _HEADER_SUM.size:
        raise HeaderError("header truncated")
    (stored_sum,) = _HEADER_SUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored_sum:
        raise HeaderError("header checksum mismatch")
    if flags & ~_KNOWN_FLAGS or flags & (FLAG_MAC | FLAG_BLAKE3) == FLAG_BLAKE3:
        raise HeaderError(f"unknown header flags {flags:#06x}")
    mac = b""
    if flags & FLAG_MAC:
        if integrity_key is None:
            raise HeaderError(
                "block is signed with an integrity key and this reader has none; set the "
                "integrity key every node of this tier uses"
            )
        start = end + _HEADER_SUM.size
        if view.nbytes < start + MAC_BYTES:
            raise HeaderError("header truncated")
        mac = bytes(view[start : start + MAC_BYTES])
    elif integrity_key is not None:
        raise HeaderError("block is not signed, and an integrity key is set: refused")
    signed = bytes(view[:end]) if mac else b""
    key = bytes(view[_FIXED.size : end])
    return BlockHeader(key, length, payload_sum, flags, mac, signed, version)


class PayloadCheck:
    """``verify_block`` for a payload that arrives in pieces (a reader that streams a file
    through a small buffer): feed each piece to ``update``, then ``finish`` raises
    ``HeaderError`` unless the whole is the intact (and, with a key, authentic) payload."""

    __slots__ = ("_hasher", "_header", "_keyed", "_seen")

    def __init__(
        self,
        expected_key: bytes,
        header: BlockHeader,
        *,
        integrity_key: IntegrityKey | None = None,
    ) -> None:
        if header.key != expected_key:
            raise HeaderError("block belongs to another key")
        if bool(header.flags & FLAG_MAC) != (integrity_key is not None):
            raise HeaderError("block signing does not match this reader's integrity key setting")
        self._header = header
        self._keyed = integrity_key is not None
        self._hasher: Any = (
            xxhash.xxh3_64()
            if integrity_key is None
            else integrity_key.hasher(header.signed, legacy=not header.flags & FLAG_BLAKE3)
        )
        self._seen = 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        self._hasher.update(piece)
        self._seen += memoryview(piece).nbytes

    def finish(self) -> None:
        header = self._header
        if self._seen != header.payload_length:
            raise HeaderError(f"payload is {self._seen} bytes, header says {header.payload_length}")
        if self._keyed:
            if not hmac.compare_digest(self._hasher.digest(), header.mac):
                raise HeaderError("integrity check failed: block not signed with this tier's key")
        elif self._hasher.intdigest() != header.payload_checksum:
            raise HeaderError("payload checksum mismatch")


def verify_block(
    expected_key: bytes,
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    *,
    integrity_key: IntegrityKey | None = None,
) -> None:
    """Raise ``HeaderError`` unless ``payload`` is the intact block of ``expected_key``: the
    MAC must verify under ``integrity_key`` when one is set, else the xxh3 checksum must."""
    check = PayloadCheck(expected_key, header, integrity_key=integrity_key)
    if memoryview(payload).nbytes != header.payload_length:
        raise HeaderError(
            f"payload is {memoryview(payload).nbytes} bytes, header says {header.payload_length}"
        )
    check.update(payload)
    check.finish()
