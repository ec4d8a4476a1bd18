"""kvtier's version, read from the installed package's metadata: pyproject.toml is the one
place it is written.

Read on first use, not at import: ``importlib.metadata`` costs several milliseconds to import,
which ``import kvtier`` should not pay for a string most processes never read. A source
checkout used without being installed (``PYTHONPATH=$PWD``) has no metadata and reports
``0+unknown``.
"""

from __future__ import annotations

import functools

__all__ = ["UNKNOWN_VERSION", "version"]

UNKNOWN_VERSION = "0+unknown"


@functools.cache
def version() -> str:
    """The installed kvtier's version, or ``UNKNOWN_VERSION`` without package metadata."""
    import importlib.metadata

    try:
        return importlib.metadata.version("kvtier")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN_VERSION
