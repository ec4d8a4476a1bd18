"""moto's own ``ThreadedMotoServer`` on 127.0.0.1, for the S3 tests that inject faults through
the server (IAM auth switched on mid-run, a user denied some actions).

The server speaks real S3 over HTTP from a thread of this process, so the tier under test goes
through aiobotocore, aiohttp and the network stack exactly as it would against MinIO or AWS.
moto keeps its accounts, buckets and auth switch in process-wide state: ``MotoServer`` resets
them when it starts and when it stops, so each server starts empty with auth off. A test that
needs a server to die and come back uses SeaweedFS (``weed_server``), which keeps its data.
"""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import anyio.to_thread

from devtools.server_process import HOST, raw_client

__all__ = ["MotoServer", "create_bucket", "free_port", "raw_client"]


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """One ``ThreadedMotoServer`` on a port the kernel picks; ``start``/``stop``."""

    def __init__(self) -> None:
        self._server: Any = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _post(self, path: str, body: bytes = b"") -> None:
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/{path}",
            data=body,
            method="POST",
            # Not form-encoded, or the server parses it as a form and sees no raw body.
            headers={"Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(request, timeout=5):
            pass

    def start(self) -> None:
        """Serve (returns once the server listens), empty and with auth off."""
        from moto.server import ThreadedMotoServer

        if self._server is not None:
            return
        self._server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self._reset()

    def _reset(self) -> None:
        self.set_auth(float("inf"))
        self._post("reset")

    def stop(self) -> None:
        """Reset moto's process-wide state, then stop serving."""
        server, self._server = self._server, None
        if server is None:
            return
        try:
            self._reset()
        finally:
            server.stop()

    async def astart(self) -> None:
        await anyio.to_thread.run_sync(self.start)

    async def astop(self) -> None:
        await anyio.to_thread.run_sync(self.stop)

    def set_auth(self, unauthenticated_requests: float) -> None:
        """Switch moto's IAM auth on after ``unauthenticated_requests`` more requests (0: now;
        ``inf``: never). With auth on, only access keys created through moto's IAM API are
        accepted."""
        self._post("reset-auth", str(unauthenticated_requests).encode())


async def create_bucket(endpoint_url: str, bucket: str, **overrides: Any) -> None:
    async with raw_client(endpoint_url, **overrides) as client:
        await client.create_bucket(Bucket=bucket)
