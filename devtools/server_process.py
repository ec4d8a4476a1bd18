"""The lifecycle of a real server process the tests and benchmarks start
(``weed_server.WeedServer``), and the raw S3 client they set up with (for moto's threaded
server too).

A subclass says how to launch its server (``command``), where it answers (``endpoint_url``) and
when it is ready (``ready``); ``ServerProcess`` starts it, waits for readiness under a deadline,
and stops it (SIGTERM escalating to SIGKILL) or kills it (SIGKILL, like a lost machine), all
repeatable on the same ports so a test can take the endpoint down mid-run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import IO, Any, Self

import anyio.to_thread

__all__ = [
    "ACCESS_KEY",
    "HOST",
    "REGION",
    "SECRET_KEY",
    "ServerProcess",
    "cpu_seconds_of",
    "raw_client",
]

HOST = "127.0.0.1"
# Both servers accept any credentials as configured here; these are obviously fake.
ACCESS_KEY = "AKIDKVTIERTEST000000"
SECRET_KEY = "kvtier-test-secret-never-log-me"
REGION = "us-east-1"


def cpu_seconds_of(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux /proc; OSError elsewhere)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """One server process; ``start``/``stop``/``kill`` can be repeated."""

    name = "server"  # in error messages
    poll_interval = 0.1  # seconds between readiness probes, bounded by the deadline
    stop_grace = 5.0  # seconds between SIGTERM and SIGKILL
    reap_timeout = 5.0  # seconds to wait for a signalled process to be gone

    def __init__(self, *, ready_timeout: float) -> None:
        self._ready_timeout = ready_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- what a subclass provides -------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The child's environment; never the caller's real AWS setup."""
        return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def log_path(self) -> str | None:
        """Where the server's output goes (appended); ``None`` discards it."""
        return None

    def ready(self) -> bool:
        """One readiness probe; ``start`` returns once this is true."""
        raise NotImplementedError

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The running process's id (a benchmark reads its CPU time), or None."""
        return self._process.pid if self.running and self._process is not None else None

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the server so far (Linux /proc): what a benchmark
        reports beside its own, since the server shares the machine's cores."""
        assert self.pid is not None, "the server is not running"
        return cpu_seconds_of(self.pid)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _see_log(self) -> str:
        path = self.log_path()
        return "" if path is None else f"; see {path}"

    def start(self) -> None:
        """Start the process and return once it is ready; raise if it is not in time."""
        if self.running:
            return
        path = self.log_path()
        output: IO[bytes] | int = subprocess.DEVNULL
        if path is not None:
            self._log = output = open(path, "ab")  # noqa: SIM115 (closed when reaped)
        self._process = subprocess.Popen(
            self.command(),
            stdout=output,
            stderr=subprocess.STDOUT if path is not None else subprocess.DEVNULL,
            env=self.environment(),
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self._process.returncode} before it "
                    f"answered on {self.endpoint_url}{self._see_log()}"
                )
            if self.ready():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{self.name} did not answer on {self.endpoint_url} within "
                    f"{self._ready_timeout} s{self._see_log()}"
                )
            time.sleep(self.poll_interval)

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        process.wait(timeout=self.reap_timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """SIGTERM, escalating to SIGKILL after ``stop_grace`` seconds."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                process.kill()
        self._reap(process)

    def kill(self) -> None:
        """SIGKILL, like a crashed server or a lost machine; waits until it is gone."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        self._reap(process)

    def close(self) -> None:
        """Stop; a subclass also removes what it created."""
        self.stop()

    async def astart(self) -> None:
        await anyio.to_thread.run_sync(self.start)

    async def astop(self) -> None:
        await anyio.to_thread.run_sync(self.stop)

    async def akill(self) -> None:
        await anyio.to_thread.run_sync(self.kill)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
