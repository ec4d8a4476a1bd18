"""What the FS catalog's packed index is keyed by: an *ident* per block file name.

A block file is named by its key's hex, or, for a key too long for a file name, by ``h`` and
a hash of it (``_layout.name_of``). The index keys a file by the bytes its name stands for,
so a lookup asks with the key it was given and never builds a name:

- a hex name's ident is the key itself (1 to ``MAX_HEX_KEY`` bytes);
- a hashed name's ident is ``PAD`` followed by the 32-byte hash: longer than any key named by
  its hex, so the two kinds never meet.

The ident's length is its *lane* in the index (``HASHED_LANE`` for hashed names). Only names
``name_of`` gives have an ident: a name of odd length, or with capitals, names no key.
"""

from __future__ import annotations

import hashlib
from typing import Final

__all__ = [
    "HASHED_LANE",
    "MAX_HEX_KEY",
    "MAX_LANE",
    "PAD",
    "ident_of_key",
    "ident_of_name",
    "lane_of",
    "name_of_ident",
]

MAX_HEX_KEY: Final = 100
"""The longest key named by its hex (``_layout``)."""
HASHED_LANE: Final = MAX_HEX_KEY + 1
MAX_LANE: Final = HASHED_LANE
PAD: Final = bytes(HASHED_LANE - 32)


def ident_of_key(key: bytes) -> bytes:
    """The ident of ``key``'s file."""
    if len(key) <= MAX_HEX_KEY:
        return key
    return PAD + hashlib.blake2b(key, digest_size=32).digest()


def ident_of_name(name: str) -> bytes | None:
    """The ident of the file ``name``; None for a name ``name_of`` never gives.

    The catalog turns a name into its ident at every call, so the usual name (a key's hex)
    costs one ``fromhex`` and two checks: no whitespace (``fromhex`` skips it, so the name
    would be longer than twice its bytes) and no capitals (a name of digits alone has no
    letter to be lower case)."""
    if name[:1] == "h":
        if len(name) != 65:
            return None
        digits = name[1:]
    elif 2 <= len(name) <= 2 * MAX_HEX_KEY:
        digits = name
    else:
        return None
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        return None
    if 2 * len(raw) != len(digits) or not (digits.islower() or digits.isdigit()):
        return None
    return raw if digits is name else PAD + raw


def name_of_ident(ident: bytes) -> str:
    """The file name ``ident`` stands for."""
    if len(ident) == HASHED_LANE:
        return "h" + ident[len(PAD) :].hex()
    return ident.hex()


def lane_of(ident: bytes) -> int | None:
    """The lane of ``ident``; None when it is not one ``ident_of_name`` gives."""
    n = len(ident)
    if 0 < n <= MAX_HEX_KEY:
        return n
    if n == HASHED_LANE and ident[: len(PAD)] == PAD:
        return n
    return None
