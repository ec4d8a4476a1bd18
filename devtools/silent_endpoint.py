"""An endpoint on 127.0.0.1 that accepts connections and never answers a byte (a wedged load
balancer, a server stuck in a GC pause): what a tier's open meets when its backend is silent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

__all__ = ["silent_endpoint"]


@asynccontextmanager
async def silent_endpoint() -> AsyncIterator[str]:
    """Serve while the block runs: its URL. On leaving, every connection it held is closed
    and its handlers have returned."""
    release = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []
    handlers: list[asyncio.Task[Any]] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        task = asyncio.current_task()
        if task is not None:
            handlers.append(task)
        await release.wait()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        release.set()
        for writer in writers:
            writer.close()
        await asyncio.gather(*handlers)
        server.close()
        await server.wait_closed()
