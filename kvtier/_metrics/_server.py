"""``/metrics`` over HTTP, served from the event loop itself.

An anyio TCP listener in an ``async with`` block: no thread reads kvtier's counters while the
loop updates them, and no daemon thread outlives the block. The server speaks just enough
HTTP/1.1 for a scraper (GET or HEAD, one request per connection, a bounded request head read
within a time bound). Bind it to 127.0.0.1 (the default) unless the scraper is on another
machine.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Self

import anyio
import anyio.abc

from kvtier._errors import InvalidArgumentError
from kvtier._metrics._collector import KVTierCollector
from kvtier._metrics._families import prometheus
from kvtier._resource import AsyncResource

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from kvtier._metrics._histograms import LatencyHistograms
    from kvtier._scheduler import OffloadScheduler
    from kvtier.manager import TieringManager

__all__ = ["MetricsServer", "serve_metrics"]

logger = logging.getLogger(__name__)

_MAX_REQUEST_HEAD = 16 << 10
_REQUEST_TIMEOUT = 5.0


class MetricsServer(AsyncResource):
    """An HTTP endpoint for Prometheus on the current event loop; see ``serve_metrics``.

    ``async with`` opens the listener; leaving the block, or ``aclose()`` (idempotent), stops
    serving and closes it.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str) -> None:
        self.registry = registry
        self.host = host
        self.port = port  # the bound port once entered (useful with port=0)
        self._prometheus = prometheus()
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self.scrapes = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def __aenter__(self) -> Self:
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._listener, self._task_group = listener, task_group
        task_group.start_soon(listener.serve, self._handle)
        logger.info("serving kvtier metrics on %s", self.url)
        return self

    async def aclose(self) -> None:
        """Stop serving and close the listener; a second call does nothing."""
        task_group, self._task_group = self._task_group, None
        listener, self._listener = self._listener, None
        if task_group is None or listener is None:
            return
        task_group.cancel_scope.cancel()
        try:
            await task_group.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(_REQUEST_TIMEOUT):
                    head = await _read_head(stream)
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, ValueError):
                return
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:])
            }
            status, content_type, body = self._respond(parts, headers.get("accept", ""))
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1")
                    + (b"" if parts[0] == "HEAD" else body)
                )

    def _respond(self, parts: list[str], accept: str) -> tuple[str, str, bytes]:
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if target not in ("/metrics", "/"):
            return "404 Not Found", "text/plain", b"kvtier metrics are at /metrics\n"
        encoder, content_type = self._prometheus.exposition.choose_encoder(accept)
        self.scrapes += 1
        return "200 OK", content_type, encoder(self.registry)

    def __repr__(self) -> str:
        state = "serving" if self._task_group is not None else "closed"
        return f"<MetricsServer {state} {self.url} scrapes={self.scrapes}>"


async def _read_head(stream: anyio.abc.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > _MAX_REQUEST_HEAD:
            raise ValueError("request head too large")
        data += await stream.receive()
    return data.split(b"\r\n\r\n", 1)[0]


def serve_metrics(
    manager: TieringManager,
    port: int,
    host: str = "127.0.0.1",
    *,
    scheduler: OffloadScheduler | None = None,
    latency: LatencyHistograms | None = None,
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve Prometheus metrics for ``manager`` at ``http://host:port/metrics``::

        async with serve_metrics(manager, 9464) as server:
            ...  # the serving loop

    A fresh ``CollectorRegistry`` with one ``KVTierCollector`` is used unless ``registry`` is
    given (then the collector is added to it). ``port=0`` picks a free port (``server.port``).
    """
    client = prometheus()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int from 0 to 65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"host must be an address such as '127.0.0.1', got {host!r}")
    if registry is None:
        registry = client.CollectorRegistry()
    registry.register(KVTierCollector(manager, scheduler=scheduler, latency=latency))
    return MetricsServer(registry, port, host)
