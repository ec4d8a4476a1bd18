"""The S3 tier's integrity marker: which key, if any, signs the blocks under a prefix.

With an integrity key (``kvtier.common._format``) every block an S3 tier stores carries a MAC, and
a block that does not verify is a ``corrupt`` miss, which the tier deletes. A node with no key,
or with another key, would therefore call every block its peers wrote corrupt and delete it.
So a prefix whose blocks are signed says so in one small object,
``<prefix>/_kvtier_integrity.json`` = ``{"mac": "blake3", "key_id": <public fingerprint>}``,
and every tier checks it when it opens:

- a marker that says ``"blake2b-256"`` (blocks signed before kvtier moved to BLAKE3; they still
  verify) is rewritten as ``"blake3"`` by the first signing tier that opens the prefix, so a
  kvtier that knows only BLAKE2b refuses the prefix instead of deleting the new blocks;
- a tier with a key whose ``key_id`` differs from the marker's refuses to open;
- a tier without a key refuses a prefix that has a marker;
- a tier with a key over a prefix with no marker creates it, with a conditional put
  (``If-None-Match: *``) so two nodes racing to claim an empty prefix agree on one key;
- a tier with a key over a prefix that already holds blocks but no marker (unsigned blocks,
  written by tiers without a key) refuses to open, as the FS tier does for a folder: a signed
  tier there would delete every block the unsigned nodes wrote, and they would keep writing
  them. Point it at an empty prefix, or empty this one.

A tier without a key writes no marker, so an unsigned prefix is exactly what it was before
signing existed (no extra object, no write at open: read-only nodes keep working). The price:
an unsigned node that opened an empty prefix *before* a signing node claimed it does not notice
until it reopens; its blocks are meanwhile corrupt misses for the signing nodes. On a server
without conditional puts two nodes with different keys racing on an empty prefix may both open
(each re-reads the marker after writing it, which narrows that window but cannot close it).

The marker names no secret: ``key_id`` is a MAC of a constant. Someone who can write the
prefix can delete or replace the marker, which makes signing nodes refuse to open (a denial of
service, as deleting blocks would be), never serve a forged block.

The marker's name does not have the ``<2 hex>/<hex key>`` shape of a block, so the listing at
open and ``key_from_object`` never take it for one; nor does the cache identity manifest's,
``<prefix>/_kvtier_identity.json``, which a tier given a ``CacheIdentity`` checks (and on a
prefix that has none, creates with a conditional put) right after the marker.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvtier.common._errors import InvalidArgumentError, TierUnavailableError
from kvtier.common._format import LEGACY_MAC_NAME, MAC_NAME, IntegrityKey
from kvtier.common._identity import MAX_MANIFEST_BYTES, CacheIdentity, ManifestError, check_manifest
from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._names import under_prefix
from kvtier.tiers.s3._pack_format import PACK_DIR
from kvtier.tiers.s3._requests import Call, get_bytes

__all__ = [
    "IDENTITY_NAME",
    "MARKER_NAME",
    "OpenPlace",
    "check_marker",
    "claim_identity",
    "holds_blocks",
    "identity_key",
    "marker_body",
    "marker_key",
    "marker_problem",
    "unsigned_blocks_problem",
]

MARKER_NAME = "_kvtier_integrity.json"
IDENTITY_NAME = "_kvtier_identity.json"  # the cache identity manifest (kvtier.common._identity)
_SHARD = re.compile(r"[0-9a-f]{2}/")


@dataclass(frozen=True, slots=True)
class OpenPlace:
    """Where a tier opening checks its prefix's markers, and how: its request sender and
    client, the bucket and prefix, and the tier's name for the errors it raises."""

    call: Call
    client: Any
    bucket: str
    prefix: str
    tier: str


def marker_key(prefix: str) -> str:
    return under_prefix(prefix, MARKER_NAME)


def marker_body(integrity_key: IntegrityKey) -> bytes:
    return json.dumps({"mac": MAC_NAME, "key_id": integrity_key.key_id}).encode()


def marker_problem(found: bytes, integrity_key: IntegrityKey | None, where: str) -> str | None:
    """Why a tier with ``integrity_key`` must not open a prefix whose marker holds ``found``;
    None when it may."""
    try:
        marker: Any = json.loads(found)
    except ValueError:
        marker = None
    if (
        not isinstance(marker, dict)
        or marker.get("mac") not in (MAC_NAME, LEGACY_MAC_NAME)
        or not isinstance(marker.get("key_id"), str)
    ):
        return (
            f"{where}/{MARKER_NAME} is not an integrity marker this kvtier reads (a newer "
            "kvtier, or not kvtier's); point the tier at another prefix"
        )
    have = marker["key_id"]
    if integrity_key is None:
        return (
            f"{where} holds blocks signed with an integrity key (key id {have!r}); set "
            "integrity_key (KVTIER_INTEGRITY_KEY) to the key every node sharing this prefix uses"
        )
    if have != integrity_key.key_id:
        return (
            f"{where} is signed with another integrity key (key id {have!r}, this tier's "
            f"{integrity_key.key_id!r}); every node sharing a prefix must set the same key"
        )
    return None


def unsigned_blocks_problem(where: str) -> str:
    return (
        f"{where} holds unsigned blocks (no {MARKER_NAME}), and this tier has an integrity "
        "key: point it at an empty prefix, or empty this one, to start a signed cache"
    )


def holds_blocks(listing: dict[str, Any], prefix: str) -> bool:
    """Whether a ``Delimiter="/"`` listing of the prefix shows a block shard folder or the
    folder of packs (``_pack_format``)."""
    start = len(prefix) + 1 if prefix else 0
    return any(
        _SHARD.fullmatch(folder := item.get("Prefix", "")[start:]) is not None
        or folder == f"{PACK_DIR}/"
        for item in listing.get("CommonPrefixes", ())
    )


async def check_marker(
    place: OpenPlace,
    *,
    integrity_key: IntegrityKey | None,
    conditional_put: bool,
    where: str,
) -> bool:
    """Check (and with a key, claim) the prefix's marker at open; raise
    ``InvalidArgumentError`` saying what to fix when this tier must not use the prefix.

    Requests: a tier without a key, one GET. A tier with a key, one GET when the marker is
    there; else a LIST (one page: at most 256 shard folders), a conditional PUT, and a GET
    again only when another node won the race. Returns whether conditional puts still look
    supported (False once the server rejected one as not implemented).
    """
    call, client, bucket, prefix, tier = (
        place.call,
        place.client,
        place.bucket,
        place.prefix,
        place.tier,
    )
    name = marker_key(prefix)

    async def get() -> bytes | None:
        return await _get(call, client, bucket, name)

    def settle(found: bytes) -> None:
        problem = marker_problem(found, integrity_key, where)
        if problem is not None:
            raise InvalidArgumentError(problem)

    found = await get()
    if found is not None:
        settle(found)
        if integrity_key is not None and json.loads(found)["mac"] == LEGACY_MAC_NAME:
            await _move_up(call, client, bucket, name, integrity_key)
        return conditional_put
    if integrity_key is None:
        return conditional_put
    if await _lists_blocks(call, client, bucket, prefix):
        # A signing node may have claimed the prefix and stored blocks since the GET above
        # (it writes the marker before its first block): read the marker once more.
        found = await get()
        if found is None:
            raise InvalidArgumentError(unsigned_blocks_problem(where))
        settle(found)
        return conditional_put
    put = functools.partial(client.put_object, Bucket=bucket, Key=name)
    result, conditional_put = await _put_marker(
        call, put, marker_body(integrity_key), conditional_put, tier=tier, where=where
    )
    if result in (Fault.PRECONDITION, Fault.CONFLICT) or not conditional_put:
        found = await get()  # another node claimed it first (or no conditional put): whose?
        if found is None:
            raise TierUnavailableError(
                f"{where}: the integrity marker vanished right after it was written; retry",
                tier=tier,
                operation="open",
            )
        settle(found)
    return conditional_put


async def _move_up(
    call: Call, client: Any, bucket: str, name: str, integrity_key: IntegrityKey
) -> None:
    """A prefix signed with BLAKE2b before: the same key says BLAKE3 from now on."""
    put = functools.partial(client.put_object, Bucket=bucket, Key=name)
    await call("open", None, functools.partial(put, Body=marker_body(integrity_key)))


async def _lists_blocks(call: Call, client: Any, bucket: str, prefix: str) -> bool:
    """Whether one ``Delimiter="/"`` page of the prefix shows blocks (``holds_blocks``)."""
    listing = await call(
        "open",
        None,
        functools.partial(
            client.list_objects_v2,
            Bucket=bucket,
            Prefix=f"{prefix}/" if prefix else "",
            Delimiter="/",
            MaxKeys=1000,
        ),
    )
    assert not isinstance(listing, Fault)
    return holds_blocks(listing, prefix)


async def _put_marker(
    call: Call,
    put: Callable[..., Awaitable[Any]],
    body: bytes,
    conditional_put: bool,
    *,
    tier: str,
    where: str,
) -> tuple[object, bool]:
    """Put a marker (``where`` names it), conditionally while the server takes it; (the
    answer: a response, or PRECONDITION / CONFLICT when another node's is there; whether
    conditional puts still look supported)."""
    extra = {"IfNoneMatch": "*"} if conditional_put else {}
    expected = frozenset({Fault.PRECONDITION, Fault.CONFLICT, Fault.UNSUPPORTED})
    result = await call("open", None, functools.partial(put, Body=body, **extra), expected=expected)
    if result is Fault.UNSUPPORTED and conditional_put:
        conditional_put = False
        result = await call("open", None, functools.partial(put, Body=body), expected=expected)
    if result is Fault.UNSUPPORTED:
        raise TierUnavailableError(
            f"{where}: the server rejected the put of a kvtier marker as not implemented",
            tier=tier,
            operation="open",
        )
    return result, conditional_put


async def _get(
    call: Call, client: Any, bucket: str, name: str, most: int | None = None
) -> bytes | None:
    """Object ``name``, or None when there is none; with ``most``, a larger one is not read
    (``ManifestError``: what kvtier writes there is far smaller)."""
    attempt = functools.partial(get_bytes, client, bucket, name)
    if most is not None:
        attempt = functools.partial(_get_bounded, client, bucket, name, most)
    found = await call("open", None, attempt, expected=frozenset({Fault.NOT_FOUND}))
    return None if isinstance(found, Fault) else found


async def _get_bounded(client: Any, bucket: str, name: str, most: int) -> bytes:
    response = await client.get_object(Bucket=bucket, Key=name)
    async with response["Body"] as body:
        if response.get("ContentLength", most + 1) > most:
            raise ManifestError(f"s3://{bucket}/{name} is larger than any kvtier writes")
        data: bytes = await body.read()
    return data


def identity_key(prefix: str) -> str:
    return under_prefix(prefix, IDENTITY_NAME)


async def claim_identity(
    place: OpenPlace, *, identity: CacheIdentity, conditional_put: bool
) -> bool:
    """Check that the prefix records ``identity`` (``kvtier.common._identity``), recording it first
    with a conditional put where the prefix records none; raise ``IdentityMismatchError`` or
    ``ManifestError``. Requests: one bounded GET; a PUT and a GET again when there was no
    manifest yet. Returns whether conditional puts still look supported. A manifest is never
    replaced; without conditional puts two openers racing on a new prefix may both write,
    and each reads back what stands."""
    call, client, bucket, tier = place.call, place.client, place.bucket, place.tier
    name = identity_key(place.prefix)
    found = await _get(call, client, bucket, name, MAX_MANIFEST_BYTES)
    if found is None:
        put = functools.partial(client.put_object, Bucket=bucket, Key=name)
        result, conditional_put = await _put_marker(
            call, put, identity.manifest(), conditional_put, tier=tier, where=name
        )
        if conditional_put and result not in (Fault.PRECONDITION, Fault.CONFLICT):
            return conditional_put
        found = await _get(call, client, bucket, name, MAX_MANIFEST_BYTES)
        if found is None:
            raise TierUnavailableError(
                f"{name}: the identity manifest vanished right after it was written; retry",
                tier=tier,
                operation="open",
            )
    check_manifest(found, identity, f"s3://{bucket}/{name}")
    return conditional_put
