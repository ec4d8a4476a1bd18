"""``/metrics`` over HTTP through prometheus_client: a thread server, or an ASGI app.

``serve_metrics`` runs prometheus_client's WSGI app (``make_wsgi_app``: the text format, the
OpenMetrics negotiation, gzip) on a ``wsgiref`` server in a thread that the ``MetricsServer``
owns: started when the block is entered, stopped and joined when it ends, never a daemon. Each
connection gets a thread of its own (so a client that connects and says nothing holds up
nobody), bounded by a read timeout and joined when the server closes. Bind it to 127.0.0.1
(the default) unless the scraper is on another machine.

No thread reads kvtier's counters while the loop updates them: the server thread hands each
scrape's collection to the event loop (``anyio.from_thread``) and only encodes the result.

``metrics_asgi_app`` is prometheus_client's ASGI app (``make_asgi_app``) over the same
collector, for an engine that already runs an ASGI server: it collects on the event loop that
serves the request.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import wsgiref.simple_server
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import AsyncResource

from kvtier._metrics._collector import KVTierCollector
from kvtier._metrics._families import prometheus
from kvtier.common._errors import InvalidArgumentError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from kvtier._metrics._histograms import LatencyHistograms
    from kvtier.manager import TieringManager
    from kvtier.scheduler._scheduler import OffloadScheduler

__all__ = ["MetricsServer", "metrics_asgi_app", "serve_metrics"]

logger = logging.getLogger(__name__)

_REQUEST_TIMEOUT = 5.0  # seconds a connection may take to send its request
_PATHS = ("/metrics", "/")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Handler(wsgiref.simple_server.WSGIRequestHandler):
    """prometheus_client's request handler, with a read timeout and no access log."""

    timeout = _REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one line every few seconds is noise)."""


class _Server(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    """A thread per connection; ``server_close`` joins them (no daemon threads)."""

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True


class _OnLoop:
    """A collector that runs ``registry``'s collection on the event loop thread."""

    def __init__(self, registry: CollectorRegistry, token: anyio.lowlevel.EventLoopToken) -> None:
        self._registry = registry
        self._token = token

    def collect(self) -> Iterable[Metric]:
        return anyio.from_thread.run_sync(self._collect, token=self._token)

    def _collect(self) -> list[Metric]:
        return list(self._registry.collect())


class MetricsServer(AsyncResource):
    """An HTTP endpoint for Prometheus in a thread this object owns; see ``serve_metrics``.

    ``async with`` binds the socket and starts the serving thread; leaving the block, or
    ``aclose()`` (idempotent), stops serving and joins the thread and every connection's.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str) -> None:
        self.registry = registry
        self.host = host
        self.port = port  # the bound port once entered (useful with port=0)
        self._prometheus = prometheus()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.scrapes = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def __aenter__(self) -> Self:
        client = self._prometheus
        served = client.CollectorRegistry(auto_describe=False)
        served.register(_OnLoop(self.registry, anyio.lowlevel.current_token()))
        app = self._route(client.make_wsgi_app(served))
        server = await anyio.to_thread.run_sync(_bind, self.host, self.port, app)
        self.port = server.server_address[1]
        thread = threading.Thread(
            target=server.serve_forever,
            args=(0.05,),
            name=f"kvtier-metrics:{self.port}",
            daemon=False,
        )
        try:
            thread.start()
        except BaseException:
            server.server_close()
            raise
        self._server, self._thread = server, thread
        logger.info("serving kvtier metrics on %s", self.url)
        return self

    def _route(self, metrics: WSGIApp) -> WSGIApp:
        """``/metrics`` (and ``/``) for GET and HEAD; 404 elsewhere, 405 for other methods."""

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            method = environ.get("REQUEST_METHOD", "")
            if environ.get("PATH_INFO", "") not in _PATHS:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"kvtier metrics are at /metrics\n"]
            if method not in ("GET", "HEAD"):
                start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
                return [b"only GET\n"]
            with self._lock:  # connection threads may answer at the same time
                self.scrapes += 1
            body = metrics({**environ, "REQUEST_METHOD": "GET"}, start_response)
            return [] if method == "HEAD" else body

        return app

    async def aclose(self) -> None:
        """Stop serving and join the threads; a second call does nothing."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None or thread is None:
            return

        def stop() -> None:
            server.shutdown()  # returns once serve_forever has
            thread.join()
            server.server_close()  # joins the connection threads (bounded by their timeout)

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop)

    def __repr__(self) -> str:
        state = "serving" if self._server is not None else "closed"
        return f"<MetricsServer {state} {self.url} scrapes={self.scrapes}>"


class _Server6(_Server):
    address_family = socket.AF_INET6


def _bind(host: str, port: int, app: WSGIApp) -> _Server:
    """A server bound to ``host:port`` (an IPv6 host needs an AF_INET6 socket)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server = (_Server6 if family == socket.AF_INET6 else _Server)((str(address[0]), port), _Handler)
    server.set_app(app)
    return server


def _check(port: int, host: str) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int from 0 to 65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"host must be an address such as '127.0.0.1', got {host!r}")


def _registry_with_collector(
    manager: TieringManager,
    scheduler: OffloadScheduler | None,
    latency: LatencyHistograms | None,
    registry: CollectorRegistry | None,
) -> CollectorRegistry:
    if registry is None:
        registry = prometheus().CollectorRegistry()
    registry.register(KVTierCollector(manager, scheduler=scheduler, latency=latency))
    return registry


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
    prometheus()
    _check(port, host)
    return MetricsServer(
        _registry_with_collector(manager, scheduler, latency, registry), port, host
    )


def metrics_asgi_app(
    manager: TieringManager,
    *,
    scheduler: OffloadScheduler | None = None,
    latency: LatencyHistograms | None = None,
    registry: CollectorRegistry | None = None,
) -> Callable[..., Any]:
    """prometheus_client's ASGI app over ``manager``'s metrics, to mount in an ASGI server
    that already runs (Starlette: ``Mount("/metrics", kvtier.metrics_asgi_app(manager))``).

    The registry is as in ``serve_metrics``. The app collects on the event loop that serves
    the request, the loop the manager runs on, so nothing is read from another thread.
    """
    client = prometheus()
    app: Callable[..., Any] = client.make_asgi_app(
        _registry_with_collector(manager, scheduler, latency, registry)
    )
    return app
