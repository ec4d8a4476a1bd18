"""mkdocs hook: pages that name a settings class or the public API get them generated at build.

- ``<!-- settings: kvtier.tiers.fs._config:FSConfig -->`` becomes a table of every field of that
  settings dataclass: the key, its environment variable, its type, its default, and the comment
  written above the field in the source. The table is read from the class at every build, so
  it cannot drift from the code; the page that has them must have one for every section the
  loader (``kvtier.manager._stack_config``) reads.
- ``<!-- api: kvtier -->`` becomes one ``::: kvtier.NAME`` block per name in ``kvtier.__all__``
  (read from the source with ``ast``, so the build does not depend on the import order).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = re.compile(r"<!-- settings: ([\w.]+):(\w+) -->")
API = re.compile(r"<!-- api: kvtier -->")


def on_page_markdown(markdown: str, **_: Any) -> str:
    tables = SETTINGS.findall(markdown)
    if tables:
        every_section_has_a_table(tables)
    markdown = SETTINGS.sub(lambda m: settings_table(m[1], m[2]), markdown)
    return API.sub(lambda _: public_api(), markdown)


def every_section_has_a_table(tables: list[tuple[str, str]]) -> None:
    """The page with settings tables shows one for each section ``KVTierConfig`` reads, so a
    section added to the loader fails the build until it is documented."""
    from kvtier.manager import _stack_config

    shown = {getattr(importlib.import_module(module), name) for module, name in tables}
    missing = [name for name, cls in _stack_config._SECTIONS.items() if cls not in shown]
    if missing:
        raise RuntimeError(f"docs: no settings table for the config sections {missing}")


def public_api() -> str:
    tree = ast.parse((ROOT / "kvtier" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names = ast.literal_eval(node.value)
            return "\n\n".join(f"::: kvtier.{name}" for name in names)
    raise RuntimeError("kvtier/__init__.py has no __all__")


def settings_table(module_name: str, class_name: str) -> str:
    cls = getattr(importlib.import_module(module_name), class_name)
    notes = field_comments(cls)
    section = cls.SECTION
    rows = [
        "| key | environment | type | default | notes |",
        "|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(cls):
        env = f"KVTIER_{section.upper()}_{f.name.upper()}"
        kind = str(f.type).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{env}` | `{kind}` | {default(f)} | {notes.get(f.name, '')} |")
    return "\n".join(rows)


def default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "**required**"
    if f.metadata.get("secret"):
        return "unset" if value is None else "(secret)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for unit, shift in (("GiB", 30), ("MiB", 20)):
            if value % (1 << shift) == 0:
                return f"`{value >> shift}{unit}` ({value:,})"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"`{value:,}`".replace(",", "_")
    return f"`{value!r}`"


def field_comments(cls: type) -> dict[str, str]:
    """The ``#`` comment block right above each field. A later field with no comment of its
    own whose name that block mentions points back to it."""
    lines, _ = inspect.getsourcelines(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    notes: dict[str, str] = {}
    comment: list[str] = []
    block: tuple[str, str] | None = None  # (the field a comment block is above, its text)
    for raw in lines:
        line = raw.strip()
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
            continue
        match = re.match(r"(\w+)\s*:", line)
        if match and match[1] in names:
            name = match[1]
            if comment:
                text = " ".join(comment)
                block = (name, text)
                notes[name] = markdown_cell(text)
            elif block and re.search(rf"\b{name}\b", block[1]):
                notes[name] = f"see `{block[0]}`"
            comment = []
        elif not line:
            comment, block = [], None
    return notes


def markdown_cell(text: str) -> str:
    text = text.replace("``", "`").replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")
