"""Every public face of kvtier keeps its promises, and the code around the package uses them.

A face is ``kvtier`` itself or a module or package of it whose dotted path has no part that
starts with ``_``. Each states its private modules, has an ``__all__`` of documented
names that import, and the root re-exports what the faces export. Tests, examples and
benchmarks import a name from its face, not from the private module behind it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvtier
from kvtier import ExtraNotInstalledError

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "examples", "benchmarks")


def _is_public(dotted: str) -> bool:
    return not any(part.startswith("_") for part in dotted.split("."))


def _face_names() -> list[tuple[str, bool]]:
    """(dotted name, whether it is a package) for kvtier and each public module under it."""
    walked = pkgutil.walk_packages(kvtier.__path__, "kvtier.")
    return [("kvtier", True)] + [(i.name, i.ispkg) for i in walked if _is_public(i.name)]


FACES = _face_names()


def _import_face(dotted: str) -> ModuleType:
    """The face, or a skip when it needs an extra that is not installed."""
    try:
        return importlib.import_module(dotted)
    except ExtraNotInstalledError as exc:
        pytest.skip(f"{dotted} needs an optional extra: {exc}")


def _has_own_docstring(obj: Any) -> bool:
    doc = obj.__doc__
    if not doc or not doc.strip():
        return False
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        # A dataclass without a docstring gets its signature as one.
        return not doc.startswith(f"{obj.__name__}(")
    return True


@pytest.mark.parametrize(("dotted", "is_package"), FACES, ids=[name for name, _ in FACES])
def test_face_keeps_its_promises(dotted: str, is_package: bool) -> None:
    face = _import_face(dotted)
    doc = face.__doc__ or ""
    assert doc.strip(), f"{dotted} has no module docstring"
    if is_package:
        folder = Path(face.__file__ or "").parent
        private = sorted(  # __main__ is an entry point, not a part
            info.name
            for info in pkgutil.iter_modules([str(folder)])
            if info.name.startswith("_") and not info.name.startswith("__")
        )
        public_packages = sorted(
            info.name
            for info in pkgutil.iter_modules([str(folder)])
            if info.ispkg and not info.name.startswith("_")
        )
        unnamed = [name for name in [*private, *public_packages] if name not in doc]
        assert not unnamed, f"the docstring of {dotted} does not name {unnamed}"
    exported = getattr(face, "__all__", None)
    assert exported is not None, f"{dotted} has no __all__"
    # Its order is ruff's to keep (RUF022); what ruff cannot see is a name listed twice.
    assert len(set(exported)) == len(exported), f"the __all__ of {dotted} names one twice"
    missing = [name for name in exported if not hasattr(face, name)]
    assert not missing, f"{dotted}.__all__ names {missing}, which do not import"
    undocumented = [
        name
        for name in exported
        if (inspect.isclass(obj := getattr(face, name)) or inspect.isfunction(obj))
        and not _has_own_docstring(obj)
    ]
    assert not undocumented, f"in {dotted}, {undocumented} have no docstring"


def _face_of(module: str) -> str:
    """The face a name defined in ``module`` belongs to: its longest public prefix."""
    parts = module.split(".")
    while parts and not _is_public(".".join(parts)):
        parts.pop()
    return ".".join(parts)


def test_root_reexports_what_the_faces_export() -> None:
    wrong: list[str] = []
    for name in kvtier.__all__:
        obj = getattr(kvtier, name)
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or not module.startswith("kvtier."):
            continue  # a constant: where it is defined is not known
        dotted = _face_of(module)
        face = importlib.import_module(dotted)
        if getattr(face, name, None) is not obj:
            wrong.append(f"kvtier.{name} (defined in {module}) is not {dotted}.{name}")
    assert not wrong, "the root exports what no face does:\n" + "\n".join(wrong)


_PLAIN_VALUES = (int, float, str, bytes, bool, tuple, frozenset, type(None))


def _exported_places() -> dict[int, tuple[Any, str]]:
    """id of each object some face exports -> (the object, its public place)."""
    places: dict[int, tuple[Any, str]] = {}
    for dotted, _ in FACES:
        try:
            face = importlib.import_module(dotted)
        except ExtraNotInstalledError:
            continue
        for name in getattr(face, "__all__", ()):
            obj = getattr(face, name, None)
            if obj is None or isinstance(obj, _PLAIN_VALUES):
                continue
            places.setdefault(id(obj), (obj, f"{dotted}.{name}"))
    return places


def _top_level_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    """``from ... import`` statements of the module body, also inside a top-level if or try."""
    found: list[ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            pending.extend([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            pending.extend([*node.body, *node.orelse, *node.finalbody])
            for handler in node.handlers:
                pending.extend(handler.body)
    return found


def test_private_imports_only_where_no_face_exports_the_name() -> None:
    places = _exported_places()
    found: list[str] = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in _top_level_imports(tree):
                if node.level or node.module is None or _is_public(node.module):
                    continue
                try:
                    module = importlib.import_module(node.module)
                except ImportError:
                    continue  # an optional extra that is not installed
                for alias in node.names:
                    obj = getattr(module, alias.name, None)
                    place = places.get(id(obj))
                    if place is not None and place[0] is obj:
                        found.append(
                            f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from "
                            f"{node.module}, exported as {place[1]}"
                        )
    assert not found, "import these from their faces:\n" + "\n".join(found)


@pytest.mark.parametrize("dependency", ["anyio", "blake3", "numpy", "xxhash"])
def test_a_missing_dependency_is_named_at_import(dependency: str) -> None:
    """Without one of its dependencies, ``import kvtier`` says which and how to install it,
    instead of failing deep inside a wing."""
    hide = f"import sys; sys.modules[{dependency!r}] = None; import kvtier"
    proc = subprocess.run(
        [sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    assert f"ImportError: kvtier needs {dependency}, which this Python" in proc.stderr
    assert "pip install" in proc.stderr
