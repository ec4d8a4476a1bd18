"""The S3 tier's events: blocks learnt from another node's journal are REMOTE stored events."""

from __future__ import annotations

import os

from devtools.weed_server import WeedServer
from kvtier._events import EventKind, TierEvent
from tests.support import INDEX_BY_HAND, fresh_keys, s3_tier


async def test_another_nodes_blocks_are_remote_stored_events(
    weed_server: WeedServer, prefix: str
) -> None:
    keys = fresh_keys(3)
    async with (
        s3_tier(weed_server, prefix, name="here", **INDEX_BY_HAND) as here,
        s3_tier(weed_server, prefix, **INDEX_BY_HAND) as there,
    ):
        for key in keys:
            await there.store(key, memoryview(os.urandom(512)))
        await there.refresh_index()  # publishes its journal segment
        await here.refresh_index()
        events = here.events.drain()
        assert {k for e in events for k in e.keys} == set(keys)
        assert all(
            e == TierEvent(EventKind.STORED, e.keys, "here", locality="REMOTE") for e in events
        )
        assert there.events.drain() == []  # a node does not learn its own blocks
