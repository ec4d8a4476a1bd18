"""Reading an index snapshot's body as it arrives (``_snapshot`` decides which one to read).

A body of millions of keys takes seconds to arrive; decoded whole, none of its keys would
answer before the last byte. Here one GET (bounded by the manifest's length) is read piece by
piece, each piece decoded in a worker thread (``BodyDecoder``: chunk by chunk, each checked
as a journal segment is) and each completed chunk indexed at once, in slices between which
the event loop serves lookups. The body is checked whole against its manifest at the end; a
snapshot rejected then, or at a bad chunk, keeps the entries of the chunks before it (each
valid on its own: a stale one costs one GET that finds nothing) and the caller lists the
prefix for the rest.

A close during the read cancels it: the GET is dropped, and a worker thread still decoding
a piece finishes that piece alone (its decoder is dropped with it), so what is left behind is
bounded by one piece.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._pack_format import Location
from kvtier.tiers.s3._requests import Call
from kvtier.tiers.s3.index._existence import ExistenceIndex
from kvtier.tiers.s3.index._snapshot_format import BODY_MAGIC, BodyDecoder, SnapshotError

__all__ = ["stream_body"]

_GET_ANSWERS = frozenset({Fault.NOT_FOUND, Fault.REJECTED})
# Bytes read before a hop to the decoding thread: large enough that hops cost little, small
# enough that the first chunks are indexed soon after they arrive.
_PIECE = 1 << 20
# Entries indexed between two checkpoints: a few milliseconds of loop.
ADD_SLICE = 2048


async def stream_body(
    call: Call,
    client: Any,
    bucket: str,
    name: str,
    new_decoder: Callable[[], BodyDecoder],
    index: ExistenceIndex,
    streamed: Callable[[int], None] | None = None,
) -> None:
    """GET the body ``name``, index each of its chunks as it completes, and check it whole
    (``new_decoder()`` decodes it: its counts are the caller's). ``SnapshotError`` if it is
    gone, empty, or does not parse, verify or match its manifest. A retried GET reads from
    the start with a fresh decoder (what was indexed stays: indexing a key again changes
    nothing). ``streamed(offset)``: every chunk before body byte ``offset`` is indexed."""

    async def attempt() -> None:
        decoder = new_decoder()
        length = decoder.length
        if length < len(BODY_MAGIC):
            raise SnapshotError(f"snapshot body of {length} bytes")
        get = functools.partial(
            client.get_object, Bucket=bucket, Key=name, Range=f"bytes=0-{length - 1}"
        )
        response = await get()
        async with response["Body"] as body:
            pending = bytearray()
            while piece := await body.read(_PIECE):
                pending += piece
                if len(pending) >= _PIECE:
                    await _take(decoder, bytes(pending), index, streamed)
                    pending.clear()
            await _take(decoder, bytes(pending), index, streamed)
        decoder.finish()

    got = await call("snapshot", None, attempt, expected=_GET_ANSWERS)
    if isinstance(got, Fault):
        raise SnapshotError(f"{name} is gone or empty")


async def _take(
    decoder: BodyDecoder,
    piece: bytes,
    index: ExistenceIndex,
    streamed: Callable[[int], None] | None,
) -> None:
    """Decode ``piece`` in a worker thread and index the entries it completed."""
    if not piece:
        return
    entries: list[tuple[bytes, Location | None]] = await anyio.to_thread.run_sync(
        decoder.feed, piece, abandon_on_cancel=True
    )
    for start in range(0, len(entries), ADD_SLICE):  # the loop serves meanwhile
        index.load_many(entries[start : start + ADD_SLICE])
        await anyio.lowlevel.checkpoint()
    if streamed is not None:
        streamed(decoder.parsed)
