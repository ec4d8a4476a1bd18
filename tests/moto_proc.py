"""A real ``moto_server`` process on 127.0.0.1 for the S3 tests and the S3 benchmark.

The server is a separate process speaking real S3 over HTTP, so the tier under test goes
through aiobotocore, aiohttp and the network stack exactly as it would against MinIO or AWS.
``MotoServer`` starts it on a free port, waits until it answers HTTP (bounded by a deadline),
and can kill it and start it again on the same port, which is how the tests take the endpoint
down in the middle of a run. Moto keeps its state in memory, so a restarted server is empty.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio.to_thread

__all__ = ["MotoServer", "create_bucket", "free_port", "raw_client"]

HOST = "127.0.0.1"
# moto accepts any credentials unless its IAM auth mode is switched on; these are obviously fake.
ACCESS_KEY = "AKIDKVTIERTEST000000"
SECRET_KEY = "kvtier-test-secret-never-log-me"
REGION = "us-east-1"


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


class MotoServer:
    """One ``moto_server`` process; ``start``/``stop``/``kill`` can be repeated on one port."""

    def __init__(
        self,
        port: int | None = None,
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        self.port = port if port is not None else free_port()
        self._env = env or {}
        self._ready_timeout = ready_timeout
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process and return once it answers HTTP; raise if it does not in time."""
        if self.running:
            return
        env = {**os.environ, **self._env}
        # Make sure the server never picks up the caller's real AWS setup.
        env.pop("AWS_PROFILE", None)
        self._process = subprocess.Popen(
            [*_moto_server_command(), "-H", HOST, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with status {self._process.returncode} before it "
                    f"answered on port {self.port}"
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/data.json", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # it answered HTTP: it is up
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"moto_server did not answer on {self.endpoint_url} within "
                    f"{self._ready_timeout} s"
                )
            time.sleep(0.05)  # poll interval between readiness probes, bounded by the deadline

    def stop(self) -> None:
        """Terminate gracefully (SIGTERM), escalating to SIGKILL after a few seconds."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL, like a crashed server or a lost machine; waits for the process to be gone."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=5)

    async def astart(self) -> None:
        await anyio.to_thread.run_sync(self.start)

    async def astop(self) -> None:
        await anyio.to_thread.run_sync(self.stop)

    async def akill(self) -> None:
        await anyio.to_thread.run_sync(self.kill)

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

    def __enter__(self) -> MotoServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_sessions: list[Any] = []


def _session() -> Any:
    # One session for all raw clients: a fresh one parses the service models again (~0.5 s).
    if not _sessions:
        from aiobotocore.session import get_session

        _sessions.append(get_session())
    return _sessions[0]


def raw_client(endpoint_url: str, service: str = "s3", **overrides: Any) -> Any:
    """An aiobotocore client context manager for ``endpoint_url`` (test setup, benchmarks)."""
    from aiobotocore.config import AioConfig

    kwargs: dict[str, Any] = {
        "endpoint_url": endpoint_url,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        "config": AioConfig(retries={"total_max_attempts": 1}),
    }
    kwargs.update(overrides)
    return _session().create_client(service, **kwargs)


async def create_bucket(endpoint_url: str, bucket: str, **overrides: Any) -> None:
    async with raw_client(endpoint_url, **overrides) as client:
        await client.create_bucket(Bucket=bucket)
