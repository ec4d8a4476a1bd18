"""What bytes a block may hold: a function of (key, version), so every load can be judged.

A payload starts with a header (magic, key length, version, the key) and the rest is a
deterministic expansion of (key, version). A version names its writer (a worker incarnation,
``slot``) and that writer's store counter (``seq``); a writer raises its published high-water
mark (``shared.Counters``) before it hands a block to kvtier, so a reader can tell whether any
writer could have stored a version at all.

``judge`` sorts a loaded payload into:

- ``ok``: a (key, version) that a writer of that key could have stored;
- ``foreign``: a well-formed payload of *another* key (kvtier served another block's bytes);
- ``wrong``: anything else (torn, flipped, garbage, or a version nobody wrote).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Callable

__all__ = ["HEADER", "Verdict", "judge", "make_version", "payload", "split_version"]

_MAGIC = b"SOAK"
_HEAD = struct.Struct("<4sHQ")  # magic, key length, version
HEADER = _HEAD.size
_MAX_KEY = 64
_SEQ_BITS = 40


class Verdict(enum.Enum):
    OK = "ok"
    FOREIGN = "foreign"
    WRONG = "wrong"


def make_version(slot: int, seq: int) -> int:
    """Writer ``slot`` (worker * 256 + incarnation), its ``seq``-th store."""
    return (slot << _SEQ_BITS) | seq


def split_version(version: int) -> tuple[int, int]:
    return version >> _SEQ_BITS, version & ((1 << _SEQ_BITS) - 1)


def _fill(key: bytes, version: int, nbytes: int) -> bytes:
    return hashlib.shake_128(key + version.to_bytes(8, "little")).digest(nbytes)


def payload(key: bytes, version: int, block_bytes: int) -> bytes:
    """The one payload of ``key`` at ``version``."""
    head = _HEAD.pack(_MAGIC, len(key), version) + key
    return head + _fill(key, version, block_bytes - len(head))


def judge(key: bytes, data: bytes | memoryview, written: Callable[[int, int], bool]) -> Verdict:
    """The verdict on ``data`` loaded for ``key``; ``written(slot, seq)`` says whether that
    writer could have stored that version (its high-water mark has reached it)."""
    data = bytes(data)
    if len(data) < HEADER:
        return Verdict.WRONG
    magic, klen, version = _HEAD.unpack_from(data)
    if magic != _MAGIC or not 0 < klen <= _MAX_KEY or HEADER + klen > len(data):
        return Verdict.WRONG
    found = data[HEADER : HEADER + klen]
    if data[HEADER + klen :] != _fill(found, version, len(data) - HEADER - klen):
        return Verdict.WRONG
    if found != key:
        return Verdict.FOREIGN
    return Verdict.OK if written(*split_version(version)) else Verdict.WRONG
