"""The README's quickstart runs as written, and its test command is the one CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"^python3 .*nox -s tests.*$", README, re.M)
    assert commands, "the README must give the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m nox -s tests" in commands[0]
    assert "python3 -m nox -s tests" in ci
