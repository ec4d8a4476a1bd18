"""A real ``moto_server`` process on 127.0.0.1 for the S3 tests that inject faults
(credentials switched off mid-run, a server killed and restarted on its port).

The server is a separate process speaking real S3 over HTTP, so the tier under test goes
through aiobotocore, aiohttp and the network stack exactly as it would against MinIO or AWS.
``MotoServer`` starts it on a free port, waits until it answers HTTP (bounded by a deadline),
and can kill it and start it again on the same port, which is how the tests take the endpoint
down in the middle of a run. Moto keeps its state in memory, so a restarted server is empty.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from devtools.server_process import HOST, ServerProcess, raw_client

__all__ = ["MotoServer", "create_bucket", "free_port", "raw_client"]


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _moto_server_command() -> list[str]:
    # Prefer the script next to this interpreter (the venv's), then PATH.
    local = Path(sys.executable).with_name("moto_server")
    found = str(local) if local.exists() else shutil.which("moto_server")
    if found is None:
        raise RuntimeError("moto_server not found: install the test extras (`moto[server]`)")
    return [found]


class MotoServer(ServerProcess):
    """One ``moto_server`` process; ``start``/``stop``/``kill`` can be repeated on one port."""

    name = "moto_server"
    poll_interval = 0.05

    def __init__(
        self,
        port: int | None = None,
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        super().__init__(ready_timeout=ready_timeout)
        self.port = port if port is not None else free_port()
        self._env = env or {}

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [*_moto_server_command(), "-H", HOST, "-p", str(self.port)]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self._env}
        # Make sure the server never picks up the caller's real AWS setup.
        env.pop("AWS_PROFILE", None)
        return env

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/data.json", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it answered HTTP: it is up
        except OSError:
            return False

    def set_auth(self, unauthenticated_requests: float) -> None:
        """Switch moto's IAM auth on after ``unauthenticated_requests`` more requests (0: now).

        With auth on, only access keys created through moto's IAM API are accepted.
        """
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/reset-auth",
            data=str(unauthenticated_requests).encode(),
            method="POST",
            # Not form-encoded, or the server parses it as a form and sees no raw body.
            headers={"Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(request, timeout=5):
            pass


async def create_bucket(endpoint_url: str, bucket: str, **overrides: Any) -> None:
    async with raw_client(endpoint_url, **overrides) as client:
        await client.create_bucket(Bucket=bucket)
