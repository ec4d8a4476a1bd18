"""ListObjectsV2 pages parsed off the event loop, into the shape botocore gives.

botocore parses a response on the thread that awaits it: for a page of 1,000 objects that is
tens of milliseconds of the event loop (a ``Contents`` entry is a dozen model-driven calls
and a timestamp), and an index that lists a prefix of many objects at open or in an audit
parses page after page. ``parse_listings_off_the_loop`` hooks the client's ``before-parse``
event for ``ListObjectsV2``: a page larger than ``THREAD_BODY_BYTES`` is parsed in a worker
thread with ElementTree (C expat) by ``parse_page``, and botocore is handed a body with
nothing left to parse, so what the caller receives is ``parse_page``'s result with
botocore's ``ResponseMetadata`` and its after-call handlers (the URL decoding of keys it
asked for) applied as to any page.

``parse_page`` keeps what kvtier reads of a page (``Contents``: ``Key``, ``LastModified``,
``ETag``, ``Size``, ``StorageClass``; ``CommonPrefixes``; the page's scalar fields) and
leaves a body it cannot read to botocore, which then raises its usual error. The body comes
from the server and is untrusted: expat refuses external entities and bounds entity
expansion, and a value that does not convert makes the page botocore's.
"""

from __future__ import annotations

import functools
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from kvtier.tiers.s3._client import parse_timestamp

__all__ = ["THREAD_BODY_BYTES", "parse_listings_off_the_loop", "parse_page"]

THREAD_BODY_BYTES = 32 * 1024
"""A page body above this is parsed in a worker thread (about 150 objects); a smaller one
is parsed where it arrives, as a thread's round trip would cost more than the parse."""

_EMPTY_PAGE = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"></ListBucketResult>'
)


def _as_bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(f"not a boolean: {text!r}")
    return text == "true"


_SCALARS: dict[str, Callable[[str], object]] = {
    "Name": str,
    "Prefix": str,
    "Delimiter": str,
    "EncodingType": str,
    "ContinuationToken": str,
    "NextContinuationToken": str,
    "StartAfter": str,
    "MaxKeys": int,
    "KeyCount": int,
    "IsTruncated": _as_bool,
}
_OBJECT_FIELDS: dict[str, Callable[[str], object]] = {
    "Key": str,
    "LastModified": parse_timestamp,
    "ETag": str,
    "Size": int,
    "StorageClass": str,
}


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def parse_page(body: bytes) -> dict[str, Any] | None:
    """The fields of one ``ListBucketResult`` body as botocore names and types them; None
    where the body is not one this reads (left to botocore)."""
    try:
        root = ET.fromstring(body)
        if _local(root.tag) != "ListBucketResult":
            return None
        page: dict[str, Any] = {}
        contents: list[dict[str, object]] = []
        prefixes: list[dict[str, str]] = []
        for child in root:
            name = _local(child.tag)
            if name == "Contents":
                item: dict[str, object] = {}
                for field in child:
                    tag = _local(field.tag)
                    if (convert := _OBJECT_FIELDS.get(tag)) is not None:
                        item[tag] = convert(field.text or "")
                contents.append(item)
            elif name == "CommonPrefixes":
                prefixes.extend(
                    {"Prefix": field.text or ""} for field in child if _local(field.tag) == "Prefix"
                )
            elif (convert := _SCALARS.get(name)) is not None:
                page[name] = convert(child.text or "")
    except (ET.ParseError, ValueError, TypeError):
        return None
    if contents:
        page["Contents"] = contents
    if prefixes:
        page["CommonPrefixes"] = prefixes
    return page


async def _before_parse(
    check_200: Callable[..., None] | None,
    operation_model: Any,
    response_dict: dict[str, Any],
    customized_response_dict: dict[str, Any],
    **kwargs: Any,
) -> None:
    body = response_dict.get("body")
    if (
        operation_model.name == "ListObjectsV2"
        and response_dict.get("status_code") == 200
        and isinstance(body, bytes)
        and len(body) > THREAD_BODY_BYTES
    ):
        page = await anyio.to_thread.run_sync(parse_page, body)
        if page is not None:  # a page, so not an error in a 200
            customized_response_dict.update(page)
            response_dict["body"] = _EMPTY_PAGE
            return
    if check_200 is not None:
        check_200(operation_model=operation_model, response_dict=response_dict, **kwargs)


def parse_listings_off_the_loop(client: Any) -> None:
    """Parse this client's large ``ListObjectsV2`` pages in a worker thread (see the module
    docstring); only this client's copy of the event handlers changes.

    botocore reads every S3 response body once before parsing it, for an error sent with
    status 200 (``_handle_200_error``, first of the ``before-parse`` handlers): that read
    moves into the same hook, which does it for every other response as before and, for a
    large listing page, lets the thread's parse stand for it (a body that is not a whole
    ``ListBucketResult`` goes through botocore's check and parse as ever). A botocore
    without that handler keeps its own check.
    """
    import botocore.handlers

    events = client.meta.events
    check_200 = getattr(botocore.handlers, "_handle_200_error", None)
    if check_200 is not None:
        events.unregister("before-parse.s3.*", check_200)
    events.register_first("before-parse.s3.*", functools.partial(_before_parse, check_200))
