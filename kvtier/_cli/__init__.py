"""The ``kvtier`` command line: offline tools for the people who run a kvtier cache.

::

    kvtier inspect ROOT            what an FS tier folder holds (identity, blocks, bytes, ages)
    kvtier verify ROOT [--remove]  check every block's header and checksum
    kvtier bench [--config FILE]   a short self-benchmark of the configured tiers
    kvtier config [--config FILE]  print the validated configuration (secrets hidden)
    kvtier --version               the installed kvtier's version

Exit codes: 0 all good, 1 something is wrong with the data (corrupt or unreadable blocks, a
failing tier), 2 a usage error (bad arguments, bad configuration, not a kvtier folder).

``inspect`` and ``verify`` read the folder themselves with plain blocking I/O (they are not on
anybody's event loop) and never write to it, except ``verify --remove`` which unlinks corrupt
block files, and only if the file is still the one it read (a running ``FSTier`` may have
republished a good block there meanwhile). Temporary files are reported, never removed: a live
writer may own them, and the next ``FSTier.open()`` clears the dead ones.

No command follows a link out of the root: the folder is walked by the FS tier's own layout
module (``kvtier.tiers.fs._layout``, the walk the tier opens a root with), through directory
file descriptors opened with ``O_NOFOLLOW`` at every level, so a shard folder or block file
that is a symbolic link (planted by anyone who can write to a shared folder) is reported as
foreign, never read, and never deleted, even if it is swapped in while the command runs.
Only ROOT itself may be a link: naming it is the operator's choice.

A folder whose blocks are signed (an FS tier with an integrity key) is verified with the key
in ``KVTIER_INTEGRITY_KEY``; it is never taken from the command line, where other users of the
machine could read it in the process list.

The commands live beside this entry point: ``_folder`` (``inspect``, ``verify``) and
``_bench`` (``bench``, ``config``); ``_common`` holds the exit codes and the usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import IO

from kvtier._cli._bench import run_bench, show_config
from kvtier._cli._common import EXIT_BAD_DATA, EXIT_USAGE, UsageError
from kvtier._cli._folder import inspect, verify
from kvtier.common import _version
from kvtier.common._errors import ExtraNotInstalledError, InvalidArgumentError, KVTierError

__all__ = ["main"]


# -- entry point -----------------------------------------------------------------------------


def _positive(kind: Callable[[str], int]) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = kind(text)
        except (ValueError, InvalidArgumentError):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def _version_action(out: IO[str]) -> type[argparse.Action]:
    """``--version``, written to ``out`` (the caller's stdout, so tests can read it)."""

    class Version(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: object,
            option_string: str | None = None,
        ) -> None:
            out.write(f"kvtier {_version.version()}\n")
            parser.exit()

    return Version


def _parser(out: IO[str]) -> argparse.ArgumentParser:
    from kvtier.manager._stack_config import parse_size

    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tools for operating a kvtier KV-cache."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--version", nargs=0, action=_version_action(out), help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="summarise an FS tier folder (read-only)")
    p.add_argument("root", metavar="ROOT", help="the FS tier's root folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = sub.add_parser("verify", help="check the header and checksum of every block")
    p.add_argument("root", metavar="ROOT", help="the FS tier's root folder")
    p.add_argument("--remove", action="store_true", help="delete the corrupt block files")
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )

    p = sub.add_parser("bench", help="a short self-benchmark of the configured pool and tiers")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config (default: KVTIER_* variables, "
        "or a host pool plus an FS tier in a temporary folder)",
    )
    p.add_argument("--blocks", type=_positive(int), default=64, help="blocks per operation")
    p.add_argument(
        "--block-bytes",
        type=_positive(parse_size),
        default=None,
        help="block size for the tier rows (default: pool.block_bytes)",
    )
    p.add_argument("--concurrency", type=_positive(int), default=8, help="operations at once")
    p.add_argument("--rounds", type=_positive(int), default=100, help="lookup rounds")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("config", help="validate a configuration and print it, secrets hidden")
    p.add_argument("--config", metavar="FILE", help="TOML config (default: KVTIER_* variables)")
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run the command line; returns the exit code (0 ok, 1 bad data, 2 usage error)."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    parser = _parser(out)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=err,
    )
    try:
        if args.command == "inspect":
            return inspect(args, out)
        if args.command == "verify":
            return verify(args, out, err)
        if args.command == "bench":
            return run_bench(args, out)
        return show_config(args, out)
    except (UsageError, InvalidArgumentError, ExtraNotInstalledError) as exc:
        err.write(f"kvtier {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except KVTierError as exc:
        err.write(f"kvtier {args.command}: failed: {exc}\n")
        return EXIT_BAD_DATA
