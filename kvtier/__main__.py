"""``python -m kvtier``: the same command line as the ``kvtier`` console script."""

from __future__ import annotations

from kvtier._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
