"""Settings, statistics and the shared botocore session of the S3 tier.

Arguments are checked once, here, with messages that say what to change; the tier keeps the
result as a frozen ``S3Settings``. Credentials are not part of it: the tier keeps them in a
closure so that no repr, ``vars()`` dump or log line can show them.
"""

from __future__ import annotations

import datetime
import email.utils
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvtier._errors import InvalidArgumentError
from kvtier._validate import positive_int, positive_number
from kvtier._version import version
from kvtier.tiers._base import TierStatistics

__all__ = [
    "BYTES_BODY_LIMIT",
    "S3Settings",
    "S3TierStatistics",
    "check_credentials",
    "client_config",
    "parse_timestamp",
    "send_bodies_as_given",
    "shared_session",
    "warm_session",
]

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")
ADDRESSING_STYLES = ("auto", "path", "virtual")
LOOKUP_MODES = ("index", "ask")
# A pack's blocks are fetched together; past 64 a GET of one block's neighbours would waste
# more than packing saves, and the pack table grows past one probe (``_pack``).
MAX_PACK_BLOCKS = 64
DEFAULT_PACK_BLOCKS = 8  # 2 MiB objects for 256 KiB blocks


@dataclass(frozen=True, slots=True)
class S3TierStatistics(TierStatistics):
    """``TierStatistics`` plus what is particular to a remote store."""

    # ``blocks`` and ``bytes_stored`` stay 0: counting a shared bucket would need a listing.
    breaker_state: str = "closed"
    breaker_opened: int = 0
    requests_rejected_by_breaker: int = 0
    retries: int = 0
    stores_skipped_existing: int = 0
    corrupt_deleted: int = 0
    conditional_put: bool = True
    lookup_mode: str = "index"
    index_keys: int = 0
    index_listed: int = 0
    index_learnt: int = 0
    index_listing_complete: bool = False
    index_refreshes: int = 0
    journal_segments_published: int = 0
    journal_segments_read: int = 0
    packs_written: int = 0  # PUTs that carried more than one block
    blocks_packed: int = 0  # blocks those PUTs carried
    pack_gets: int = 0  # ranged GETs of packs
    pack_sections_read: int = 0  # blocks those GETs served
    pack_bytes_read: int = 0  # bytes those GETs fetched (never more than their sections)
    index_evictions: int = 0  # keys evicted from a full index (index_max_keys), oldest first
    index_locations_rejected: int = 0  # pack locations not a block's size: never fetched
    index_refresh_failures: int = 0  # journal rounds that failed (retried at the next)
    journal_segments_rejected: int = 0  # unparsable, unauthenticated or oversized segments
    journal_entries_rejected: int = 0  # entries naming no pack of this prefix, or a bad key
    journal_clock_skew: float = 0.0  # this node's wall clock minus the server's, seconds


def _pack_blocks(value: object, lookup_mode: str) -> int:
    """Packs are found through the existence index (a HEAD by key cannot see a block inside
    a pack), so the ``ask`` mode stores one object per block."""
    if value is None:
        return DEFAULT_PACK_BLOCKS if lookup_mode == "index" else 1
    blocks = positive_int(value, "pack_blocks")
    if blocks > 1 and lookup_mode != "index":
        raise InvalidArgumentError(
            f"pack_blocks={blocks} needs lookup_mode='index': blocks in a pack are found "
            "through the existence index, not by asking the server; set pack_blocks=1"
        )
    if blocks > MAX_PACK_BLOCKS:
        raise InvalidArgumentError(
            f"pack_blocks must be 1 (one object per block) to {MAX_PACK_BLOCKS}, got {blocks}"
        )
    return blocks


def _optional_str(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty string or None")
    return value


def _endpoint(endpoint_url: object) -> str | None:
    if endpoint_url is None:
        return None
    if not isinstance(endpoint_url, str):
        raise InvalidArgumentError(
            f"endpoint_url must be a URL string such as 'http://127.0.0.1:9000', got "
            f"{type(endpoint_url).__name__}"
        )
    parsed = urllib.parse.urlsplit(endpoint_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InvalidArgumentError(
            "endpoint_url must be an http:// or https:// URL with a host, such as "
            "'http://127.0.0.1:9000'"
        )
    if parsed.username is not None or parsed.password is not None:
        raise InvalidArgumentError(
            "endpoint_url must not carry credentials: pass aws_access_key_id and "
            "aws_secret_access_key (or use the AWS environment) instead"
        )
    if parsed.query or parsed.fragment:
        raise InvalidArgumentError("endpoint_url must not have a query or fragment")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise InvalidArgumentError("endpoint_url has an invalid port") from None
    return endpoint_url.rstrip("/")


def check_credentials(access_key: object, secret_key: object, token: object) -> dict[str, str]:
    """The explicit credentials as client arguments (empty: use the AWS chain)."""
    access = _optional_str(access_key, "aws_access_key_id")
    secret = _optional_str(secret_key, "aws_secret_access_key")
    session_token = _optional_str(token, "aws_session_token")
    if (access is None) != (secret is None):
        raise InvalidArgumentError(
            "pass aws_access_key_id and aws_secret_access_key together (or neither, to use "
            "the AWS environment and config files)"
        )
    if session_token is not None and access is None:
        raise InvalidArgumentError("aws_session_token needs aws_access_key_id too")
    given = {
        "aws_access_key_id": access,
        "aws_secret_access_key": secret,
        "aws_session_token": session_token,
    }
    return {k: v for k, v in given.items() if v is not None}


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Checked, normalised arguments of an ``S3Tier`` (no credentials)."""

    bucket: str
    prefix: str
    endpoint_url: str | None
    region_name: str | None
    addressing_style: str
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
    pack_blocks: int

    @classmethod
    def check(
        cls,
        bucket: object,
        *,
        prefix: object,
        endpoint_url: object,
        region_name: object,
        addressing_style: object,
        connect_timeout: object,
        read_timeout: object,
        max_attempts: object,
        max_concurrency: object,
        miss_ttl: object,
        lookup_batch_size: object,
        breaker_threshold: object,
        breaker_reset: object,
        lookup_timeout: object,
        lookup_mode: object = "index",
        index_refresh: object = 2.0,
        index_lookback: object = 60.0,
        index_list_timeout: object = 60.0,
        index_max_keys: object = 10_000_000,
        pack_blocks: object = None,
    ) -> S3Settings:
        if not isinstance(bucket, str) or not bucket:
            raise InvalidArgumentError("bucket must be a non-empty bucket name")
        if not _BUCKET_RE.match(bucket):
            raise InvalidArgumentError(
                f"bucket {bucket!r} is not a valid bucket name: use 3-255 letters, digits, "
                "'.', '-' or '_', starting and ending with a letter or digit"
            )
        if not isinstance(prefix, str):
            raise InvalidArgumentError("prefix must be a string such as 'kvtier/llama-8b'")
        prefix = prefix.strip("/")
        if "//" in prefix or len(prefix) > 512:
            raise InvalidArgumentError("prefix must not contain '//' and be at most 512 chars")
        if addressing_style not in ADDRESSING_STYLES:
            raise InvalidArgumentError(
                f"addressing_style must be one of {ADDRESSING_STYLES}, got {addressing_style!r}"
            )
        if lookup_mode not in LOOKUP_MODES:
            raise InvalidArgumentError(
                f"lookup_mode must be 'index' (answer from the existence index, unknown keys "
                f"miss at once) or 'ask' (ask the server about unknown keys), got {lookup_mode!r}"
            )
        refresh = positive_number(index_refresh, "index_refresh", " of seconds")
        lookback = positive_number(index_lookback, "index_lookback", " of seconds")
        if lookback < 2 * refresh:
            raise InvalidArgumentError(
                f"index_lookback ({lookback} s) must be at least 2 x index_refresh ({refresh} s): "
                "a journal segment must still be listed at the next poll after its upload"
            )
        return cls(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=_endpoint(endpoint_url),
            region_name=_optional_str(region_name, "region_name"),
            addressing_style=str(addressing_style),
            connect_timeout=positive_number(connect_timeout, "connect_timeout", " of seconds"),
            read_timeout=positive_number(read_timeout, "read_timeout", " of seconds"),
            max_attempts=positive_int(max_attempts, "max_attempts"),
            max_concurrency=positive_int(max_concurrency, "max_concurrency"),
            miss_ttl=positive_number(miss_ttl, "miss_ttl", " of seconds"),
            lookup_batch_size=positive_int(lookup_batch_size, "lookup_batch_size"),
            breaker_threshold=positive_int(breaker_threshold, "breaker_threshold"),
            breaker_reset=positive_number(breaker_reset, "breaker_reset", " of seconds"),
            lookup_timeout=positive_number(lookup_timeout, "lookup_timeout", " of seconds"),
            lookup_mode=str(lookup_mode),
            index_refresh=refresh,
            index_lookback=lookback,
            index_list_timeout=positive_number(
                index_list_timeout, "index_list_timeout", " of seconds"
            ),
            index_max_keys=positive_int(index_max_keys, "index_max_keys"),
            pack_blocks=_pack_blocks(pack_blocks, str(lookup_mode)),
        )

    @property
    def endpoint_label(self) -> str:
        """Where requests go, for messages (the URL carries no credentials: checked)."""
        if self.endpoint_url is not None:
            return self.endpoint_url
        return f"AWS S3 ({self.region_name or 'default region'})"


# One botocore session per process, like boto3's default session: creating a client from a
# fresh session parses the S3 service model again (~0.5 s of CPU). The model files are read
# once in a worker thread (``warm_session``) so that creating a client never blocks the loop.
_session: Any = None
_warmed: Any = None  # the session whose caches are filled
_session_lock = threading.Lock()
_warm_lock = threading.Lock()


def shared_session() -> Any:
    global _session
    with _session_lock:
        if _session is None:
            from aiobotocore.session import get_session

            session = get_session()
            # Every response's timestamps (the Last-Modified of each GET) go through this
            # parser; botocore's default, dateutil, cost ~0.1 ms of the ~1.3 ms of client CPU
            # of a 256 KiB GET (benchmarks/bench_s3_cpu.py). Only kvtier's clients use it.
            factory = session.get_component("response_parser_factory")
            factory.set_parser_defaults(timestamp_parser=parse_timestamp)
            _session = session
        return _session


def parse_timestamp(value: Any) -> datetime.datetime:
    """What botocore's timestamp parser returns (an aware datetime) for the two forms S3
    sends, HTTP dates in headers and ISO 8601 in listings, without dateutil; anything else
    goes to botocore's own parser."""
    if isinstance(value, str):
        try:
            if value[:1].isdigit():  # "2026-12-01T12:24:08.000Z"
                parsed = datetime.datetime.fromisoformat(value)
            else:  # "Tue, 01 Dec 2026 12:24:08 GMT"
                parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return parsed
    from botocore.utils import parse_timestamp as botocore_parse

    result: datetime.datetime = botocore_parse(value)
    return result


# Bodies up to this size go to aiohttp as ``bytes`` (one write); larger ones as a ``BytesIO``,
# which aiohttp sends chunk by chunk: it warns that one write of a larger ``bytes`` body may
# hold the event loop while the unsent part is copied.
BYTES_BODY_LIMIT = 1 << 20


def send_bodies_as_given(client: Any) -> None:
    """Let the client send a PutObject body as the caller gave it, without waiting for
    ``100 Continue``.

    botocore wraps every PutObject body in a ``BytesIO``, and a file-like body gets an
    ``Expect: 100-continue`` header: aiohttp then waits for the server's interim answer before
    it sends the body (one more round trip, one more loop iteration) and copies the body out
    of the ``BytesIO`` chunk by chunk. The tier passes ``bytes`` up to ``BYTES_BODY_LIMIT``
    and a fresh ``BytesIO`` above: 256 KiB put, client CPU 1.24 -> 1.03 ms
    (benchmarks/bench_s3_cpu.py, loaded 2-core machine). The cost: a conditional put of an
    object that exists sends its body before the 412 (the index skips most of those). Only
    this client's copy of the event handlers changes.
    """
    from botocore.handlers import add_expect_header, convert_body_to_file_like_object

    events = client.meta.events
    events.unregister("before-parameter-build.s3.PutObject", convert_body_to_file_like_object)
    events.unregister("before-call.s3", add_expect_header)


def client_config(settings: S3Settings) -> Any:
    """The ``AioConfig`` of the tier's client. Client CPU per request, 256 KiB GET / PUT on
    SeaweedFS, one at a time (benchmarks/bench_s3_cpu.py, ms, this 2-core machine, loaded):
    botocore's defaults 1.38 / 1.61; no payload signing and checksums only when required
    1.26 / 1.28 (the block carries its own checksum, verified on every load); a fixed
    ``user_agent`` (botocore rebuilds its default one twice per request: -0.09 ms); no
    parameter validation (the tier builds every parameter itself: -0.02 ms).
    """
    import aiobotocore
    import aiobotocore.config

    return aiobotocore.config.AioConfig(
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        retries={"total_max_attempts": 1},  # kvtier retries, so the breaker sees attempts
        max_pool_connections=settings.max_concurrency,
        s3={"addressing_style": settings.addressing_style, "payload_signing_enabled": False},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent=f"kvtier/{version()} aiobotocore/{aiobotocore.__version__}",
        parameter_validation=False,
    )


def warm_session(session: Any) -> None:
    """Load the S3 model and endpoint data into the session's cache (run in a thread)."""
    global _warmed
    with _warm_lock:
        if _warmed is session:
            return
        loader = session.get_component("data_loader")
        for type_name in ("service-2", "endpoint-rule-set-1"):
            loader.load_service_model("s3", type_name)
        for name in ("endpoints", "partitions", "sdk-default-configuration", "_retry"):
            loader.load_data(name)
        _warmed = session
