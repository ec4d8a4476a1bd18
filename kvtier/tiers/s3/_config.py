"""``S3Config``: every setting of an ``S3Tier``, defined once.

The ``[s3]`` section of a config file, the ``KVTIER_S3_*`` variables and ``S3Tier``'s keyword
arguments all land here, under the same names: each field holds its default and its parser
(``kvtier.common._settings``), and ``check_rules`` the rules across fields, so a setting is named,
defaulted and checked in this one place. What each setting trades is described in
``kvtier.tiers.s3``.

Not here: the integrity key (one secret for the whole stack, ``[integrity] key``, which
``KVTierConfig`` hands to every tier; ``S3Tier`` takes it as ``integrity_key``) and the clock
(a test hook). The shape of a bucket name is checked when a tier is built
(``check_bucket_name``): a config file naming a bucket S3 would refuse still loads, and
building it says which section is wrong.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from typing import ClassVar, TypedDict

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._settings import (
    BadValue,
    Section,
    choice,
    described,
    optional,
    parse_bool,
    parse_positive_int,
    parse_positive_size,
    parse_seconds,
    parse_text,
    spec,
)

__all__ = [
    "ADDRESSING_STYLES",
    "DEFAULT_PACK_BLOCKS",
    "LOOKUP_MODES",
    "MAX_PACK_BLOCKS",
    "S3Config",
    "S3Overrides",
    "check_bucket_name",
    "pack_blocks",
]

ADDRESSING_STYLES = ("auto", "path", "virtual")
LOOKUP_MODES = ("index", "ask")
# A pack's blocks are fetched together; past 64 a GET of one block's neighbours would waste
# more than packing saves, and the pack table grows past one probe (``_pack_format``).
MAX_PACK_BLOCKS = 64
DEFAULT_PACK_BLOCKS = 8  # 2 MiB objects for 256 KiB blocks
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")
_ENDPOINT = "an http:// or https:// URL such as 'http://127.0.0.1:9000'"


def _parse_prefix(value: object, text: bool) -> str:
    """A key-name prefix such as ``kvtier/llama-8b``, without its outer slashes."""
    expected = "a prefix such as 'kvtier/llama-8b' (no '//', at most 512 characters)"
    if not isinstance(value, str):
        raise BadValue(expected)
    prefix = value.strip("/")
    if "//" in prefix or len(prefix) > 512:
        raise BadValue(expected)
    return prefix


def _parse_endpoint(value: object, text: bool) -> str:
    """An ``http(s)://host[:port]`` URL without its trailing slash. A URL that carries
    credentials is refused without being shown (``InvalidArgumentError``, not ``BadValue``,
    whose message repeats the value)."""
    if not isinstance(value, str):
        raise BadValue(_ENDPOINT)
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BadValue(_ENDPOINT)
    if parsed.username is not None or parsed.password is not None:
        raise InvalidArgumentError(
            "endpoint_url must not carry credentials: pass aws_access_key_id and "
            "aws_secret_access_key (or use the AWS environment) instead"
        )
    if parsed.query or parsed.fragment:
        raise BadValue(_ENDPOINT + ", without a query or fragment")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise BadValue(_ENDPOINT + " (this one has an invalid port)") from None
    return value.rstrip("/")


_LOOKUP_MODE = described(
    choice(*LOOKUP_MODES),
    "'index' (answer from the existence index, unknown keys miss at once) or 'ask' (ask "
    "the server about unknown keys)",
)
_SECRET_TEXT = spec(optional(parse_text), secret=True)


def check_bucket_name(bucket: str) -> None:
    """Raise ``InvalidArgumentError`` for a name no S3 server takes as a bucket's."""
    if not _BUCKET_RE.match(bucket):
        raise InvalidArgumentError(
            f"bucket {bucket!r} is not a valid bucket name: use 3-255 letters, digits, "
            "'.', '-' or '_', starting and ending with a letter or digit"
        )


@dataclass(frozen=True, slots=True, repr=False)
class S3Config(Section):
    """An ``S3Tier``: ``S3Tier(bucket, config=S3Config(...), **overrides)``, or the ``[s3]``
    section of ``KVTierConfig``. Credentials are optional and never shown."""

    SECTION: ClassVar[str] = "s3"

    bucket: str = field(metadata=spec(parse_text))
    # Objects live under "<prefix>/"; outer slashes are dropped.
    prefix: str = field(default="", metadata=spec(_parse_prefix))
    endpoint_url: str | None = field(default=None, metadata=spec(optional(_parse_endpoint)))
    region_name: str | None = field(default=None, metadata=spec(optional(parse_text)))
    # None: the standard AWS chain (environment, config files, instance roles).
    aws_access_key_id: str | None = field(default=None, metadata=_SECRET_TEXT)
    aws_secret_access_key: str | None = field(default=None, metadata=_SECRET_TEXT)
    aws_session_token: str | None = field(default=None, metadata=_SECRET_TEXT)
    addressing_style: str = field(default="auto", metadata=spec(choice(*ADDRESSING_STYLES)))
    name: str = field(default="s3", metadata=spec(parse_text))
    connect_timeout: float = field(default=2.0, metadata=spec(parse_seconds))
    read_timeout: float = field(default=10.0, metadata=spec(parse_seconds))
    # Attempts per request (kvtier retries transient faults, with backoff).
    max_attempts: int = field(default=3, metadata=spec(parse_positive_int))
    # Requests at once (connections); write-through may use a quarter of them.
    max_concurrency: int = field(default=32, metadata=spec(parse_positive_int))
    # How long a miss (ask mode) or a failed load (index mode) is remembered.
    miss_ttl: float = field(default=2.0, metadata=spec(parse_seconds))
    # Ask mode: keys per batch of HEADs, and the bound on one batch.
    lookup_batch_size: int = field(default=64, metadata=spec(parse_positive_int))
    # The circuit breaker: consecutive failures that open it, seconds before a trial.
    breaker_threshold: int = field(default=5, metadata=spec(parse_positive_int))
    breaker_reset: float = field(default=5.0, metadata=spec(parse_seconds))
    lookup_timeout: float = field(default=5.0, metadata=spec(parse_seconds))
    # "index" answers lookup() without a request (unknown keys miss at once); "ask" sends
    # HEADs for unknown keys.
    lookup_mode: str = field(default="index", metadata=spec(_LOOKUP_MODE))
    # Seconds between journal rounds (another node's write is a HIT within about twice
    # this), how far back a poll lists segments, the bound on the listing at open, and the
    # bound on the index's memory.
    index_refresh: float = field(default=2.0, metadata=spec(parse_seconds))
    index_lookback: float = field(default=60.0, metadata=spec(parse_seconds))
    index_list_timeout: float = field(default=60.0, metadata=spec(parse_seconds))
    index_max_keys: int = field(default=10_000_000, metadata=spec(parse_positive_int))
    # Nodes compact the index into shared snapshots, which a new node loads instead of
    # listing the prefix (``_snapshot``; their size per key: docs/design.md, "Measurements
    # behind the defaults").
    index_snapshots: bool = field(default=True, metadata=spec(parse_bool))
    # Seconds between snapshots, by the server's clock (None: a quarter of index_lookback;
    # at most half of it, the age past which a snapshot is not loaded).
    index_snapshot_every: float | None = field(default=None, metadata=spec(optional(parse_seconds)))
    # The largest snapshot a node reads; a larger one is ignored and the prefix listed.
    index_snapshot_max_bytes: int = field(default=1 << 30, metadata=spec(parse_positive_size))
    # Each interval of index_refresh, one node copies the journal segments stamped in it into
    # one digest, which the others read by name instead of listing the journal and reading
    # every writer's segments: a node's upkeep stays flat as nodes are added (``_digest``).
    index_digests: bool = field(default=False, metadata=spec(parse_bool))
    # Load the index (snapshot or listing) in the background: open() returns once the bucket
    # answers, so a large prefix never holds up a manager's open; until the load ends, keys
    # it has not brought yet are asked of the bucket (lookups answer RETRY meanwhile; those
    # requests count in index_load_requests, not request_path_requests), and
    # ``S3Tier.wait_index_loaded()`` / index_listing_complete say when it is whole. False:
    # open() lists (bounded by index_list_timeout) before it returns.
    index_background_load: bool = field(default=False, metadata=spec(parse_bool))
    # Seconds between audits of the index against a listing of the prefix, one node of the
    # fleet at a time (``_audit``): objects removed behind kvtier's back that nobody loads,
    # and stores or deletes a killed node never published, are found within about this plus
    # one listing. None: never (each node then learns them only by loading).
    index_audit_every: float | None = field(default=600.0, metadata=spec(optional(parse_seconds)))
    # Blocks stored together per object (a pack, ``_pack_format``); None: 8 in the index mode, 1
    # in the ask mode (a HEAD by key cannot see a block inside a pack). See ``pack_blocks``.
    pack_blocks: int | None = field(default=None, metadata=spec(optional(parse_positive_int)))
    # With a cache identity: keep its blocks under <prefix>/id-<digest> (each identity its own
    # prefix) instead of refusing a prefix that records another identity
    # (``kvtier.common._identity``); no effect on a tier without an identity.
    separate_identities: bool = field(default=False, metadata=spec(parse_bool))

    def check_rules(self) -> None:
        if self.index_lookback < 2 * self.index_refresh:
            raise InvalidArgumentError(
                f"s3.index_lookback ({self.index_lookback} s) must be at least 2 x "
                f"s3.index_refresh ({self.index_refresh} s): a journal segment must still be "
                "listed at the next poll after its upload"
            )
        every = self.index_snapshot_every
        if every is not None and every > self.index_lookback / 2:
            raise InvalidArgumentError(
                f"s3.index_snapshot_every ({every} s) must be at most s3.index_lookback / 2 "
                f"({self.index_lookback / 2} s): a snapshot older than that is not loaded"
            )
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            raise InvalidArgumentError(
                "aws_access_key_id and aws_secret_access_key go together: set both, or "
                "neither to use the AWS environment and config files"
            )
        if self.aws_session_token is not None and self.aws_access_key_id is None:
            raise InvalidArgumentError("aws_session_token needs aws_access_key_id too")
        blocks = self.pack_blocks
        if blocks is not None and blocks > 1 and self.lookup_mode != "index":
            raise InvalidArgumentError(
                f"pack_blocks={blocks} needs lookup_mode='index': blocks in a pack are found "
                "through the existence index, not by asking the server; set pack_blocks=1"
            )
        if blocks is not None and blocks > MAX_PACK_BLOCKS:
            raise InvalidArgumentError(
                f"pack_blocks must be 1 (one object per block) to {MAX_PACK_BLOCKS}, got {blocks}"
            )

    @property
    def has_credentials(self) -> bool:
        return self.aws_access_key_id is not None

    @property
    def credentials(self) -> dict[str, str]:
        """The explicit credentials as client arguments (empty: use the AWS chain)."""
        given = {
            "aws_access_key_id": self.aws_access_key_id,
            "aws_secret_access_key": self.aws_secret_access_key,
            "aws_session_token": self.aws_session_token,
        }
        return {k: v for k, v in given.items() if v is not None}

    @property
    def endpoint_label(self) -> str:
        """Where requests go, for messages (the URL carries no credentials: checked)."""
        if self.endpoint_url is not None:
            return self.endpoint_url
        return f"AWS S3 ({self.region_name or 'default region'})"

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{name}={value!r}"
            for name, value in self.as_dict().items()
            if not name.startswith("aws_")
        )
        return f"S3Config({shown}, credentials={'set' if self.has_credentials else 'unset'})"


def pack_blocks(config: S3Config) -> int:
    """The blocks one pack holds under ``config``: ``pack_blocks``, or by default 8 in the
    index mode and 1 (no packs) in the ask mode."""
    if config.pack_blocks is not None:
        return config.pack_blocks
    return DEFAULT_PACK_BLOCKS if config.lookup_mode == "index" else 1


class S3Overrides(TypedDict, total=False):
    """``S3Tier``'s keyword arguments: the fields of ``S3Config`` but ``bucket`` (which is
    positional), for type checkers; the values are checked by ``S3Config``."""

    prefix: str
    endpoint_url: str | None
    region_name: str | None
    aws_access_key_id: str | None
    aws_secret_access_key: str | None
    aws_session_token: str | None
    addressing_style: str
    name: str
    connect_timeout: float
    read_timeout: float
    max_attempts: int
    max_concurrency: int
    miss_ttl: float
    lookup_batch_size: int
    breaker_threshold: int
    breaker_reset: float
    lookup_timeout: float
    lookup_mode: str
    index_refresh: float
    index_lookback: float
    index_list_timeout: float
    index_max_keys: int
    index_snapshots: bool
    index_snapshot_every: float | None
    index_snapshot_max_bytes: int
    index_digests: bool
    index_background_load: bool
    index_audit_every: float | None
    pack_blocks: int | None
    separate_identities: bool
