"""Reading a pack's table from the bucket: which keys a pack holds, and where.

The listing at open reads the tables of the packs it finds to index their keys; a delete
reads the table of the pack it is about to remove, so the pack's other keys, which go with
it, are announced and journalled as removed too. The table is untrusted input
(``decode_table`` bounds and checks it); a pack gone meanwhile has no keys.
"""

from __future__ import annotations

from typing import Any

from kvtier.tiers.s3._errors import Fault
from kvtier.tiers.s3._pack_format import TABLE_PROBE_BYTES, Location, decode_table, table_size
from kvtier.tiers.s3._requests import Call, get_bytes

__all__ = ["read_table"]

_GONE = frozenset({Fault.NOT_FOUND})


async def read_table(
    call: Call, client: Any, bucket: str, name: str, operation: str, key: bytes | None = None
) -> list[tuple[bytes, Location]]:
    """The entries of pack ``name``'s table, through ``call`` as ``operation`` (one ranged
    GET, a second for a table longer than the first read); empty if the pack is gone.
    Raises ``PackTableError`` for a table that fails its checks and ``TierError`` for a
    request that failed."""
    data = await call(
        operation,
        key,
        lambda: get_bytes(client, bucket, name, 0, TABLE_PROBE_BYTES),
        expected=_GONE,
    )
    if isinstance(data, Fault):
        return []
    size = table_size(data)
    if size > len(data):
        more = await call(
            operation, key, lambda: get_bytes(client, bucket, name, len(data), size), expected=_GONE
        )
        if isinstance(more, Fault):
            return []
        data += more
    return list(decode_table(data, name))
