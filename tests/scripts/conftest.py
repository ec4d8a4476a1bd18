"""How the script tests run the examples and benchmarks: as a user would, in a subprocess of
this interpreter, from the repository root, with ``--json``; a test reads the one JSON object
the script printed on stdout. Scripts that need S3 get the run's one SeaweedFS (the
``weed_server`` fixture of ``tests/conftest.py``), its bucket, and credentials it accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from devtools.weed_server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, WeedServer, find_weed
from tests.scripts.runner import ROOT, Run, Store

RunJson = Callable[..., Run]


@pytest.fixture
def run_json() -> RunJson:
    """``run_json("examples/serve_demo.py", "--quick")`` or ``run_json("-m",
    "benchmarks.bench_lookup")``: the script with ``--json``, warnings as errors; fails on a
    non-zero exit or on anything but exactly one JSON object on stdout."""

    def run(*args: str, timeout: float = 280, env: dict[str, str] | None = None) -> Run:
        proc = subprocess.run(
            [sys.executable, *args, "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={
                **os.environ,
                "PYTHONWARNINGS": "error",
                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION,
                **(env or {}),
            },
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = json.loads(proc.stdout)  # one object and nothing else, or this raises
        assert isinstance(out, dict), proc.stdout
        return Run(out, proc.stderr)

    return run


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Store:
    """The run's SeaweedFS, for a script; skipped when ``weed`` is not installed."""
    pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")
    try:
        find_weed()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server: WeedServer = request.getfixturevalue("weed_server")
    assert server.pid is not None
    return Store(server.endpoint_url, BUCKET, server.pid)
