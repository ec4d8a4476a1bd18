"""What a cache holds: ``CacheIdentity``, the keys it derives, and the manifest that records it.

The right bytes for the wrong cache cannot be caught by a checksum: a block written by an
engine with another KV dtype, layout, parallel layout or positional encoding has the same
length and a valid checksum. So every block key derives from a ``CacheIdentity`` (its
``namespace`` goes into every key of ``block_keys``: two identities never share a key), and a
tier given an identity records it once, at open, in a small *manifest* beside its blocks
(``<root>/.kvtier-fs-identity.json``, ``<prefix>/_kvtier_identity.json``). A tier opened with
another identity refuses with ``IdentityMismatchError``, naming the fields that differ; with
``separate_identities`` each identity keeps its blocks in a folder (prefix) of its own instead.

The manifest is written with a conditional create (a racing opener with the same identity is
accepted, one with another identity refused) and never overwritten: a manifest that does not
parse is ``ManifestError``, for the operator to look at. It is untrusted input, read from a
folder or bucket others can write: read bounded (``MAX_MANIFEST_BYTES``) and validated field by
field. It is not signed: whoever can replace it can make tiers refuse to open, as deleting
blocks would, but never make a tier serve a block across identities, because the keys carry
the identity whatever the manifest says.

A bare ``namespace`` (bytes for ``block_keys``, text for the vLLM adapter's ``namespace``)
still works: the caller vouches that it names everything that changes the bytes, and a tier
without an identity neither writes nor checks a manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._keys import block_keys

__all__ = [
    "AGNOSTIC",
    "KVTIER_FORMAT",
    "MAX_MANIFEST_BYTES",
    "CacheIdentity",
    "IdentityMismatchError",
    "ManifestError",
    "check_manifest",
    "scoped_name",
]

AGNOSTIC = "agnostic"  # a block's bytes do not depend on the parallel layout
KVTIER_FORMAT = 1  # kvtier's format of keys and blocks; raised when either changes
MAX_MANIFEST_BYTES = 16 * 1024  # a reader reads no more (the largest valid one is far smaller)
_MAX_TEXT = 256
_MAX_EXTRA = 32
_EXTRA_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FORMAT = "kvtier-identity"
_VERSION = 1
_PERSON = b"kvtier-identity"


class IdentityMismatchError(InvalidArgumentError):
    """A tier's folder or prefix holds the blocks of another cache identity.

    ``differences`` names each differing field as ``(name, recorded, this tier's)``."""

    def __init__(self, where: str, differences: Sequence[tuple[str, object, object]]) -> None:
        self.differences = tuple(differences)
        listed = "; ".join(f"{n}: {old!r} there, {new!r} here" for n, old, new in differences)
        super().__init__(
            f"{where} records another cache identity ({listed}): point this tier "
            "at another folder or prefix, set separate_identities=True to keep each identity "
            "apart under this one, or fix the identity if the engine's settings are wrong"
        )


class ManifestError(InvalidArgumentError):
    """A cache identity manifest that does not parse or is not valid; never overwritten."""


def _text(value: object, name: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT or (not empty and not value):
        size = "1" if not empty else "0"
        raise InvalidArgumentError(f"{name} must be text of {size} to {_MAX_TEXT} characters")
    return value


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """What the blocks of a cache are: every setting that changes a block's bytes.

    ``model`` (the model id and revision), ``kv_dtype`` (``"bfloat16"``, ``"fp8_e4m3"``...),
    ``block_size`` (tokens per block), ``layout`` (the engine's KV layout: per-layer order,
    ``NHD``/``HND``, what one block holds), ``parallel`` (``"agnostic"`` when the bytes do not
    depend on the parallel layout, else text naming the layout and this process's place in it,
    such as ``"tp=4 rank=1"``), ``positional`` (RoPE or other positional settings, where the
    engine applies them before caching), ``kvtier_format`` (kvtier's own format of keys and
    blocks) and ``extra`` (anything else a caller wants to tell caches apart by: names of 1 to
    64 letters, digits, ``_.-``; text values).

    ``namespace`` goes into every key (``block_keys``), so two identities never share a block;
    tiers given the identity record it and refuse another one (``kvtier.common._identity``).
    """

    model: str
    kv_dtype: str
    block_size: int
    layout: str = ""
    parallel: str = AGNOSTIC
    positional: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    kvtier_format: int = KVTIER_FORMAT

    def __post_init__(self) -> None:
        _text(self.model, "model", empty=False)
        _text(self.kv_dtype, "kv_dtype", empty=False)
        _text(self.layout, "layout")
        _text(self.parallel, "parallel", empty=False)
        _text(self.positional, "positional")
        for name in ("block_size", "kvtier_format"):
            value = getattr(self, name)
            if type(value) is not int or not 0 < value < 2**31:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.extra, Mapping) or len(self.extra) > _MAX_EXTRA:
            raise InvalidArgumentError(f"extra must be a mapping of at most {_MAX_EXTRA} entries")
        for name, value in self.extra.items():
            if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
                raise InvalidArgumentError(
                    f"extra names are 1 to 64 letters, digits, '_', '.' or '-', got {name!r}"
                )
            _text(value, f"extra[{name!r}]")
        frozen = MappingProxyType(dict(sorted(self.extra.items())))
        object.__setattr__(self, "extra", frozen)

    def __hash__(self) -> int:
        return hash(self.digest)

    def fields(self) -> dict[str, Any]:
        """The identity as the manifest records it (JSON values, fixed order)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @property
    def digest(self) -> bytes:
        """32 bytes that stand for the whole identity: equal exactly when the fields are."""
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=32, person=_PERSON).digest()

    @property
    def namespace(self) -> bytes:
        """The ``namespace`` of ``block_keys``: every key derives from the whole identity."""
        return b"kvtier-identity:" + self.digest

    def block_keys(self, token_ids: Any, *, parent: bytes | None = None) -> list[bytes]:
        """``kvtier.block_keys`` of ``token_ids`` under this identity and its block size."""
        return block_keys(token_ids, self.block_size, namespace=self, parent=parent)

    def differences(self, other: CacheIdentity) -> list[tuple[str, object, object]]:
        """``(field, other's value, this one's)`` for each field where the two differ."""
        mine, theirs = self.fields(), other.fields()
        return [(name, theirs[name], mine[name]) for name in mine if theirs[name] != mine[name]]

    def manifest(self) -> bytes:
        """The manifest that records this identity (JSON; ``from_manifest`` reads it)."""
        body = {"format": _FORMAT, "version": _VERSION, "identity": self.fields()}
        return json.dumps(body, indent=1).encode() + b"\n"

    @classmethod
    def from_manifest(cls, raw: bytes, where: str = "the manifest") -> CacheIdentity:
        """The identity a manifest records; ``ManifestError`` saying what is wrong with one
        that is too large, does not parse or holds anything but a valid identity."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where} is {len(raw)} bytes, more than any kvtier writes")
        try:
            found = json.loads(raw)
        except ValueError:
            found = None
        names = {f.name for f in fields(cls)}
        if (
            not isinstance(found, dict)
            or set(found) != {"format", "version", "identity"}
            or found["format"] != _FORMAT
            or not isinstance(found["identity"], dict)
            or set(found["identity"]) != names
        ):
            raise ManifestError(
                f"{where} is not a cache identity manifest this kvtier reads: it was damaged, "
                "or written by something else; look at it, then remove it or point the tier "
                "elsewhere"
            )
        if found["version"] != _VERSION:
            raise ManifestError(
                f"{where} is a cache identity manifest of version {found['version']!r}, this "
                f"kvtier reads version {_VERSION}: open it with a newer kvtier"
            )
        try:
            return cls(**found["identity"])
        except (InvalidArgumentError, TypeError) as exc:
            raise ManifestError(f"{where} records an invalid identity: {exc}") from None


def _plain(value: object) -> object:
    return dict(value) if isinstance(value, Mapping) else value


def check_manifest(raw: bytes, identity: CacheIdentity, where: str) -> None:
    """Raise unless the manifest ``raw`` found at ``where`` records ``identity``:
    ``ManifestError`` for one that is not valid, ``IdentityMismatchError`` for another
    identity (naming the differing fields)."""
    found = CacheIdentity.from_manifest(raw, where)
    if found != identity:
        raise IdentityMismatchError(where, identity.differences(found))


def scoped_name(identity: CacheIdentity) -> str:
    """The folder (prefix) name that keeps ``identity``'s blocks apart from other identities'
    under one root, with ``separate_identities``: ``id-`` and 16 hex digits of its digest."""
    return "id-" + identity.digest[:8].hex()
