"""The one place where botocore and network errors become kvtier errors (S3 tier).

``translate(exc, ...)`` classifies a native error into a ``Fault`` (which decides whether the
request is retried and whether it counts against the endpoint in the circuit breaker) and
builds the ``TierError`` the caller raises ``from`` the original. Messages are composed here
from the error code and HTTP status only, never from request details, so credentials cannot
leak into them (botocore's own messages can carry a proxy URL with a password).

botocore is imported lazily, inside the function, so ``import kvtier`` works without the
``s3`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvtier.common._errors import (
    BlockNotFoundError,
    TierError,
    TierTimeoutError,
    TierUnavailableError,
)

__all__ = ["Fault", "Translated", "translate"]


class Fault(Enum):
    NOT_FOUND = "not_found"
    NO_BUCKET = "no_bucket"
    DENIED = "denied"
    NO_CREDENTIALS = "no_credentials"
    PRECONDITION = "precondition"  # a conditional put found the object: it exists
    CONFLICT = "conflict"  # a concurrent conditional write of the same key
    UNSUPPORTED = "unsupported"  # the server does not implement a header we sent
    REJECTED = "rejected"  # any other 4xx
    THROTTLED = "throttled"
    SERVER = "server"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"

    @property
    def retryable(self) -> bool:
        """Worth another attempt after a backoff: the condition is likely transient."""
        return self in _TRANSIENT

    @property
    def endpoint_down(self) -> bool:
        """Counts against the endpoint in the circuit breaker (it did not answer usefully)."""
        return self in _TRANSIENT


_TRANSIENT = frozenset({Fault.THROTTLED, Fault.SERVER, Fault.UNREACHABLE, Fault.TIMEOUT})

_THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestThrottled",
        "SlowDown",
        "SlowDownRead",
        "SlowDownWrite",
    }
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "InvalidClientTokenId",
        "AuthorizationHeaderMalformed",
    }
)
_TIMEOUT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException"})
_UNSUPPORTED_CODES = frozenset({"NotImplemented"})


@dataclass(frozen=True, slots=True)
class Translated:
    fault: Fault
    error: TierError
    code: str = ""


def _client_fault(status: int, code: str) -> Fault:
    if code == "NoSuchBucket":
        return Fault.NO_BUCKET
    if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
        return Fault.NOT_FOUND
    if status == 412 or code == "PreconditionFailed":
        return Fault.PRECONDITION
    if code in ("ConditionalRequestConflict", "OperationAborted"):
        return Fault.CONFLICT
    if status == 501 or code in _UNSUPPORTED_CODES:
        return Fault.UNSUPPORTED
    if status in (401, 403) or code in _DENIED_CODES:
        return Fault.DENIED
    if status == 429 or code in _THROTTLING_CODES:
        return Fault.THROTTLED
    if code in _TIMEOUT_CODES:
        return Fault.TIMEOUT
    if status >= 500:
        return Fault.SERVER
    return Fault.REJECTED


def _classify(exc: BaseException) -> tuple[Fault, str, int] | None:
    import botocore.exceptions as bce

    if isinstance(exc, bce.ClientError):
        response: Any = getattr(exc, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", "") or "")
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return _client_fault(status, code), code, status
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return Fault.NO_CREDENTIALS, "", 0
    if isinstance(exc, bce.ConnectTimeoutError | bce.ReadTimeoutError | TimeoutError):
        return Fault.TIMEOUT, "", 0
    if isinstance(exc, bce.ConnectionError | bce.HTTPClientError | bce.IncompleteReadError):
        return Fault.UNREACHABLE, "", 0
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiobotocore depends on aiohttp
        aiohttp_errors: tuple[type[BaseException], ...] = ()
    else:
        aiohttp_errors = (aiohttp.ClientError,)
    if isinstance(exc, (OSError, *aiohttp_errors)):
        return Fault.UNREACHABLE, "", 0
    return None


def translate(
    exc: BaseException,
    *,
    tier: str,
    operation: str,
    key: bytes | None,
    bucket: str,
    endpoint: str,
) -> Translated | None:
    """Classify ``exc`` and build the kvtier error for it; None for errors that are not
    about storage or network (programming errors), which the caller lets propagate."""
    classified = _classify(exc)
    if classified is None:
        return None
    fault, code, status = classified
    kind = type(exc).__name__
    error_type: type[TierError] = TierUnavailableError
    if fault is Fault.NOT_FOUND:
        error_type = BlockNotFoundError
        message = "no such object"
    elif fault is Fault.NO_BUCKET:
        message = (
            f"bucket {bucket!r} does not exist at {endpoint}: create it, or fix bucket= "
            "or endpoint_url="
        )
    elif fault is Fault.DENIED:
        message = (
            f"access denied by {endpoint} ({code or status}): check the credentials "
            "(aws_access_key_id / aws_secret_access_key / aws_session_token, or the AWS "
            f"environment and config files) and that they may use bucket {bucket!r}"
        )
    elif fault is Fault.NO_CREDENTIALS:
        message = (
            "no usable AWS credentials found: pass aws_access_key_id and "
            "aws_secret_access_key, or set them in the environment or the AWS config files"
        )
    elif fault is Fault.TIMEOUT:
        error_type = TierTimeoutError
        message = f"timed out talking to {endpoint} ({code or kind})"
    elif fault is Fault.UNREACHABLE:
        message = f"endpoint {endpoint} unreachable ({kind})"
    elif fault is Fault.THROTTLED:
        message = f"throttled by {endpoint} ({code or status})"
    elif fault is Fault.SERVER:
        message = f"server error from {endpoint} (HTTP {status} {code})"
    else:
        message = f"request rejected by {endpoint} (HTTP {status} {code})"
    return Translated(fault, error_type(message, tier=tier, operation=operation, key=key), code)
