"""Every pointer from the code into the docs has a target a reader of a clone can open.

Docstrings and comments point at the docs as ``docs/<page>.md, "<heading>"``; the docs point
back at modules in their tables. Either side can drift when a section is renamed or a module
moves, so both directions are checked against the files as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("kvtier", "tests", "benchmarks", "examples", "devtools")
POINTER = re.compile(r'docs/([\w-]+\.md), "([^"]+)"')
# A section number of the design contract outside the repository: a clone cannot follow it.
NUMBERED = re.compile(r"design §|§\d")


def _python_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (REPO / top).rglob("*.py"))


def _headings(page: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


def test_no_pointer_to_a_numbered_section() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in _python_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if NUMBERED.search(line) and path != Path(__file__).resolve()
    ]
    assert not found, f"name a heading of docs/design.md instead: {found}"


def test_every_pointer_names_a_heading_of_its_page() -> None:
    checked = 0
    broken = []
    for path in _python_files():
        # Pointers may wrap across a docstring's lines: join each file's lines first.
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        for page, heading in POINTER.findall(text):
            checked += 1
            target = REPO / "docs" / page
            if not target.is_file() or heading not in _headings(target):
                broken.append(f"{path.relative_to(REPO)}: docs/{page}, {heading!r}")
    assert not broken, f"no such heading: {broken}"
    assert checked >= 20  # the walk found the pointers (a changed format would find none)


def test_every_module_the_design_tables_name_exists() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    missing = []
    for row in re.findall(r"^\| (`[^|]+`) \|", design, re.M):
        first, *rest = re.findall(r"`([^`]+)`", row)
        if "/" not in first and not first.endswith(".py"):
            continue  # the lookup contract's table: answers, not places
        base = first if first.startswith(("kvtier/", "devtools/")) else f"kvtier/{first}"
        if not (REPO / base).exists():
            missing.append(base)
        # `kvtier/manager/_stack_config.py`, `_settings.py`: a sibling in the same folder
        folder = (REPO / base).parent
        missing += [s for s in rest if s.endswith(".py") and not (folder / s).exists()]
    assert not missing, f"docs/design.md names modules that do not exist: {missing}"
