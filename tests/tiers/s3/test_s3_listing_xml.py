"""Listing pages parsed off the event loop: the same fields botocore would give, botocore's own
check for an error sent with status 200 kept, a body it cannot read left to botocore, and a
real listing through the hook."""

from __future__ import annotations

import os
from typing import Any
from xml.sax.saxutils import escape

import botocore.handlers
import botocore.session
import pytest
from botocore.parsers import ResponseParserFactory

from devtools.weed_server import WeedServer
from kvtier import LookupResult
from kvtier.tiers.s3 import _listing_xml
from kvtier.tiers.s3._client import parse_timestamp
from kvtier.tiers.s3._listing_xml import THREAD_BODY_BYTES, parse_page
from tests.support import INDEX_BY_HAND, fresh_keys, s3_tier

_NS = "http://s3.amazonaws.com/doc/2006-03-01/"


def page_body(names: list[str], *, truncated: bool = True, prefixes: list[str] = ()) -> bytes:  # type: ignore[assignment]
    items = "".join(
        f"<Contents><Key>{escape(name)}</Key><LastModified>2026-12-07T22:40:0{i % 10}.000Z"
        f"</LastModified><ETag>&quot;{i:032x}&quot;</ETag><ChecksumAlgorithm>CRC32"
        f"</ChecksumAlgorithm><Size>{100 + i}</Size><Owner><ID>0</ID></Owner>"
        f"<StorageClass>STANDARD</StorageClass></Contents>"
        for i, name in enumerate(names)
    )
    common = "".join(f"<CommonPrefixes><Prefix>{p}</Prefix></CommonPrefixes>" for p in prefixes)
    token = "<NextContinuationToken>next+token/=</NextContinuationToken>" if truncated else ""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{_NS}">'
        f"<Name>bucket</Name><Prefix>p/</Prefix><KeyCount>{len(names)}</KeyCount>"
        f"<MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><EncodingType>url</EncodingType>"
        f"<IsTruncated>{str(truncated).lower()}</IsTruncated>{token}{items}{common}"
        f"</ListBucketResult>"
    ).encode()


def botocore_page(body: bytes) -> dict[str, Any]:
    """What botocore's own parser makes of ``body`` (with kvtier's timestamp parser)."""
    factory = ResponseParserFactory()
    factory.set_parser_defaults(timestamp_parser=parse_timestamp)
    model = botocore.session.get_session().get_service_model("s3")
    shape = model.operation_model("ListObjectsV2").output_shape
    parsed: dict[str, Any] = factory.create_parser("rest-xml").parse(
        {"status_code": 200, "headers": {}, "body": body}, shape
    )
    parsed.pop("ResponseMetadata", None)
    return parsed


def test_a_page_parses_to_what_botocore_gives_for_the_fields_kvtier_reads() -> None:
    names = [f"p/{k.hex()[:2]}/{k.hex()}" for k in fresh_keys(40)] + ["p/a&b<c>%2F"]
    body = page_body(names, prefixes=["p/_kvtier_journal/", "p/x%20y/"])
    ours, theirs = parse_page(body), botocore_page(body)
    assert ours is not None
    read = ("Key", "LastModified", "ETag", "Size", "StorageClass")
    assert ours["Contents"] == [{f: item[f] for f in read} for item in theirs["Contents"]]
    assert ours["CommonPrefixes"] == theirs["CommonPrefixes"]
    for name in ("Name", "Prefix", "KeyCount", "MaxKeys", "Delimiter", "EncodingType"):
        assert ours[name] == theirs[name]
    assert ours["IsTruncated"] is True and ours["NextContinuationToken"] == "next+token/="
    last = parse_page(page_body([], truncated=False))
    assert last == botocore_page(page_body([], truncated=False))


@pytest.mark.parametrize(
    "body",
    [
        b"<Error><Code>InternalError</Code><Message>later</Message></Error>",
        page_body(["p/00/" + "0" * 32])[:-40],  # cut short on the wire
        page_body(["p/00/" + "0" * 32]).replace(b"<Size>100</Size>", b"<Size>big</Size>"),
        page_body([]).replace(b"<IsTruncated>true", b"<IsTruncated>maybe"),
        b"",
    ],
    ids=["error-in-200", "truncated", "bad-size", "bad-flag", "empty"],
)
def test_a_body_that_is_not_a_whole_page_is_left_to_botocore(body: bytes) -> None:
    assert parse_page(body) is None


def hook_response(body: bytes, status: int = 200) -> tuple[dict[str, Any], dict[str, Any]]:
    model = botocore.session.get_session().get_service_model("s3")
    return {"status_code": status, "headers": {}, "body": body}, {
        "operation_model": model.operation_model("ListObjectsV2"),
    }


async def test_the_hook_parses_a_large_page_and_keeps_botocores_check_for_the_rest() -> None:
    check = botocore.handlers._handle_200_error
    large = page_body([f"p/00/{i:032x}" for i in range(THREAD_BODY_BYTES // 200)])
    assert len(large) > THREAD_BODY_BYTES
    response, kwargs = hook_response(large)
    customized: dict[str, Any] = {}
    await _listing_xml._before_parse(
        check, response_dict=response, customized_response_dict=customized, **kwargs
    )
    assert customized == parse_page(large) and response["body"] == _listing_xml._EMPTY_PAGE
    # A small page and a large error body: untouched, and botocore's check still turns an
    # error sent with 200 into a 500 that its retry logic sees.
    small = page_body(["p/00/" + "0" * 32])
    response, kwargs = hook_response(small)
    await _listing_xml._before_parse(
        check, response_dict=response, customized_response_dict={}, **kwargs
    )
    assert response == {"status_code": 200, "headers": {}, "body": small}
    error = (
        b"<Error><Code>InternalError</Code><Message>"
        + b"x" * THREAD_BODY_BYTES
        + b"</Message></Error>"
    )
    response, kwargs = hook_response(error)
    customized = {}
    await _listing_xml._before_parse(
        check, response_dict=response, customized_response_dict=customized, **kwargs
    )
    assert response["status_code"] == 500 and response["body"] == error and not customized


async def test_an_audit_learns_every_block_of_large_pages_parsed_in_a_thread(
    weed_server: WeedServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []

    def counting(body: bytes) -> dict[str, Any] | None:
        page = parse_page(body)
        parsed.append(len(page["Contents"]) if page else 0)
        return page

    monkeypatch.setattr(_listing_xml, "parse_page", counting)
    keys = fresh_keys(400)
    async with (
        s3_tier(weed_server, prefix, name="a", pack_blocks=1, **INDEX_BY_HAND) as a,
        s3_tier(weed_server, prefix, name="b", **INDEX_BY_HAND) as b,
    ):
        await a.store_many(keys, [memoryview(os.urandom(64)) for _ in keys])
        assert not any(b.lookup(k) is LookupResult.HIT for k in keys)  # b never refreshed
        await b.audit_index()
        assert all(b.lookup(k) is LookupResult.HIT for k in keys)
    assert sum(parsed) >= len(keys)  # every block came through the thread's parse
