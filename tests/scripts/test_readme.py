"""The README's commands run as written from a clone: the quickstart, the trace replay of the
headline figures, the uvicorn line of the ASGI example; and its test command is the one CI
runs."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs(tmp_path: Path) -> None:
    section = README.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no python block in the quickstart"
    proc = subprocess.run(
        [sys.executable, "-c", code[1]], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert any((tmp_path / "kvtier-blocks").rglob("*")), "the quickstart stored nothing"
    assert re.fullmatch(r"128 blocks: 0 loaded from kvtier, 128 computed and stored\n", proc.stdout)


@pytest.mark.timeout(300)
def test_replay_line_runs_from_a_clone_and_gives_its_figure() -> None:
    row = next(line for line in README.splitlines() if "benchmarks.replay_trace" in line)
    command = re.findall(r"`(python -m benchmarks\.replay_trace[^`]*)`", row)
    assert command, row
    argv = shlex.split(command[0])
    assert not any(a.startswith("..") for a in argv), "the command names a path outside a clone"
    proc = subprocess.run(
        [sys.executable, *argv[1:], "--json", "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert all(check["ok"] for check in out["checks"].values()), out["checks"]
    ratio = sum(out["hits_by_tier"].values()) / out["blocks"]["requested"]
    assert f"| {100 * ratio:.2f}% prefix hits |" in row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.timeout(120)
def test_uvicorn_line_serves_the_asgi_example() -> None:
    pytest.importorskip("uvicorn", reason="`nox -s asgi` installs uvicorn; this env has none")
    found = re.search(r"`(uvicorn [^`]*)`", README)
    assert found, "the README must give the uvicorn line"
    port = free_port()
    argv = [*shlex.split(found[1])[1:], "--port", str(port)]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as r:
                    assert r.status == 200
                    assert isinstance(json.loads(r.read()), dict)
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.2)
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert server.returncode in (0, -15)


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"^python3 .*nox -s tests.*$", README, re.M)
    assert commands, "the README must give the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m nox -s tests" in commands[0]
    assert "python3 -m nox -s tests" in ci
