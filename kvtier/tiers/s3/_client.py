"""The S3 tier's client: one shared botocore session, the client's configuration and how
it sends bodies.

Client CPU per request decides whether an S3 load beats recomputing the block on a machine
with few cores, so the client is trimmed for it here (``client_config``,
``send_bodies_as_given``, ``parse_timestamp``); ``benchmarks/bench_s3_cpu.py`` measures it
beside raw aiobotocore. botocore and aiobotocore are imported inside the functions, so
``import kvtier`` works without the ``s3`` extra.
"""

from __future__ import annotations

import datetime
import email.utils
import threading
from typing import Any

from kvtier.common._version import version
from kvtier.tiers.s3._config import S3Config

__all__ = [
    "client_config",
    "parse_timestamp",
    "send_bodies_as_given",
    "shared_session",
    "warm_session",
]

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
            # parser, and botocore's default, dateutil, is a noticeable share of a GET's
            # client CPU. Only kvtier's clients use it.
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


def send_bodies_as_given(client: Any) -> None:
    """Let the client send a PutObject body as the caller gave it, without waiting for
    ``100 Continue``.

    botocore wraps every PutObject body in a ``BytesIO``, and a file-like body gets an
    ``Expect: 100-continue`` header: aiohttp then waits for the server's interim answer before
    it sends the body (one more round trip, one more loop iteration) and copies the body out
    of the ``BytesIO`` chunk by chunk. The tier passes ``bytes`` up to
    ``_requests.BYTES_BODY_LIMIT`` and a fresh ``BytesIO`` above, which saves client CPU on
    every put (figures in docs/design.md). The cost: a
    conditional put of an object that exists sends its body before the 412 (the index skips
    most of those). Only this client's copy of the event handlers changes.
    """
    from botocore.handlers import add_expect_header, convert_body_to_file_like_object

    events = client.meta.events
    events.unregister("before-parameter-build.s3.PutObject", convert_body_to_file_like_object)
    events.unregister("before-call.s3", add_expect_header)


def client_config(config: S3Config) -> Any:
    """The ``AioConfig`` of the tier's client, set for client CPU per request (figures in
    docs/design.md): no payload signing and checksums only when required (the block carries
    its own checksum, verified on every load); a fixed ``user_agent`` (botocore rebuilds its
    default one twice per request); no parameter validation (the tier builds every parameter
    itself).
    """
    import aiobotocore
    import aiobotocore.config

    return aiobotocore.config.AioConfig(
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        retries={"total_max_attempts": 1},  # kvtier retries, so the breaker sees attempts
        max_pool_connections=config.max_concurrency,
        s3={"addressing_style": config.addressing_style, "payload_signing_enabled": False},
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
