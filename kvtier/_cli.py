"""The ``kvtier`` command line: offline tools for the people who run a kvtier cache.

::

    kvtier inspect ROOT            what an FS tier folder holds (blocks, bytes, format, ages)
    kvtier verify ROOT [--remove]  check every block's header and checksum
    kvtier bench [--config FILE]   a short self-benchmark of the configured tiers
    kvtier config [--config FILE]  print the validated configuration (secrets hidden)

Exit codes: 0 all good, 1 something is wrong with the data (corrupt or unreadable blocks, a
failing tier), 2 a usage error (bad arguments, bad configuration, not a kvtier folder).

``inspect`` and ``verify`` read the folder themselves with plain blocking I/O (they are not on
anybody's event loop) and never write to it, except ``verify --remove`` which unlinks corrupt
block files, and only if the file is still the one it read (a running ``FSTier`` may have
republished a good block there meanwhile). Temporary files are reported, never removed: a live
writer may own them, and the next ``FSTier.open()`` clears the dead ones.

No command follows a link out of the root: the folder is walked by the FS tier's own layout
module (``kvtier.tiers.fs._layout``, the walk the tier opens a root with), through directory
file descriptors opened with ``O_NOFOLLOW`` at every level, so a shard folder or block file that is
a symbolic link (planted by anyone who can write to a shared folder) is reported as foreign,
never read, and never deleted, even if it is swapped in while the command runs. Only ROOT
itself may be a link: naming it is the operator's choice.

A folder whose blocks are signed (an FS tier with an integrity key) is verified with the key
in ``KVTIER_INTEGRITY_KEY``; it is never taken from the command line, where other users of the
machine could read it in the process list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvtier._errors import ExtraNotInstalledError, InvalidArgumentError, KVTierError
from kvtier._format import (
    FORMAT_VERSION,
    HeaderError,
    IntegrityKey,
    decode_header,
    verify_block,
)
from kvtier._logging import BurstLogger
from kvtier.tiers.fs._layout import (
    LAYOUT_VERSION,
    MARKER_NAME,
    READ_FLAGS,
    Kind,
    ShardFolders,
    name_of,
    read_marker,
    remove_if_same,
    walk,
)

__all__ = ["main"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BAD_DATA = 1
EXIT_USAGE = 2

_INTEGRITY_ENV = "KVTIER_INTEGRITY_KEY"


class _UsageError(Exception):
    """Wrong arguments or a folder that is not a kvtier FS tier: exit code 2."""


# -- walking an FS tier folder ---------------------------------------------------------------


@dataclass(slots=True)
class _BlockFile:
    path: Path  # for reports; files are opened through ``shard`` and ``name``, never by path
    size: int
    mtime: float
    shard: tuple[str, str]
    name: str


@dataclass(slots=True)
class _Scan:
    marker: dict[str, Any]
    blocks: list[_BlockFile] = field(default_factory=list)
    temporary: int = 0
    foreign: list[Path] = field(default_factory=list)
    shards: int = 0


def _read_marker(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise _UsageError(f"{root} is not a folder")
    marker = root / MARKER_NAME
    try:
        found = json.loads(read_marker(root))
    except FileNotFoundError:
        raise _UsageError(
            f"{root} is not a kvtier FS tier folder: it has no {MARKER_NAME} marker"
        ) from None
    except (OSError, ValueError) as exc:
        raise _UsageError(f"cannot read {marker}: {exc}") from None
    if not isinstance(found, dict) or found.get("format") != "kvtier-fs":
        raise _UsageError(f"{marker} is not a kvtier FS marker: {found!r}")
    return found


def _scan(root: Path) -> _Scan:
    """Every block file under ``root``, by the FS layout's own walk."""
    scan = _Scan(marker=_read_marker(root))
    for item in walk(root):
        path = root.joinpath(*item.parts)
        if item.kind is Kind.BLOCK:
            first, second, name = item.parts
            scan.blocks.append(_BlockFile(path, item.size, item.mtime, (first, second), name))
        elif item.kind is Kind.SHARD:
            scan.shards += 1
        elif item.kind is Kind.TEMPORARY:
            scan.temporary += 1
        else:
            scan.foreign.append(path)
    return scan


def _integrity_key(marker: dict[str, Any]) -> IntegrityKey | None:
    """The key to verify this folder with: from ``KVTIER_INTEGRITY_KEY`` when the folder is
    signed (a usage error when it is unset or another key), None when it is not."""
    signed = marker.get("integrity")
    if signed is None:
        return None
    secret = os.environ.get(_INTEGRITY_ENV)
    if not secret:
        raise _UsageError(
            f"this folder's blocks are signed with an integrity key: set {_INTEGRITY_ENV} to "
            "the key its FS tiers use"
        )
    try:
        ikey = IntegrityKey(secret)
    except InvalidArgumentError as exc:
        raise _UsageError(f"{_INTEGRITY_ENV}: {exc}") from None
    if not isinstance(signed, dict) or signed.get("key_id") != ikey.key_id:
        raise _UsageError(
            f"this folder is signed with another integrity key than {_INTEGRITY_ENV} "
            f"(folder key id {signed.get('key_id') if isinstance(signed, dict) else signed!r}, "
            f"yours {ikey.key_id})"
        )
    return ikey


def _check_compatible(marker: dict[str, Any]) -> None:
    layout, block_format = marker.get("layout"), marker.get("block_format")
    if layout != LAYOUT_VERSION or block_format != FORMAT_VERSION:
        raise _UsageError(
            f"this folder has layout {layout!r} and block format {block_format!r}; this kvtier "
            f"reads layout {LAYOUT_VERSION} and block format {FORMAT_VERSION}: use the kvtier "
            "version that wrote it"
        )


# -- formatting ------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class _Progress:
    """A one-line text progress bar on a terminal; silent when disabled."""

    def __init__(self, total: int, stream: IO[str], enabled: bool, label: str) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled and total > 0
        self.label = label
        self._last = -1.0
        self._started = time.monotonic()

    def update(self, done: int, nbytes: int, *, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not final and now - self._last < 0.1:
            return  # at most ten redraws a second
        self._last = now
        width = 30
        filled = width * done // self.total
        elapsed = max(now - self._started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
            f"blocks, {_bytes(nbytes)}, {_bytes(nbytes / elapsed)}/s"
        )
        if final:
            self.stream.write("\n")
        self.stream.flush()


# -- inspect ---------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace, out: IO[str]) -> int:
    root = Path(args.root).expanduser()
    scan = _scan(root)
    now = time.time()
    sizes = [b.size for b in scan.blocks]
    mtimes = [b.mtime for b in scan.blocks]
    report: dict[str, Any] = {
        "root": str(root.resolve()),
        "layout": scan.marker.get("layout"),
        "block_format": scan.marker.get("block_format"),
        "readable": scan.marker.get("layout") == LAYOUT_VERSION
        and scan.marker.get("block_format") == FORMAT_VERSION,
        "signed": scan.marker.get("integrity") is not None,
        "blocks": len(scan.blocks),
        "bytes": sum(sizes),
        "block_bytes_min": min(sizes, default=None),
        "block_bytes_max": max(sizes, default=None),
        "oldest": min(mtimes, default=None),
        "newest": max(mtimes, default=None),
        "shard_folders": scan.shards,
        "temporary_files": scan.temporary,
        "foreign_entries": [str(p) for p in scan.foreign],
    }
    if args.json:
        json.dump(report, out, indent=2)
        out.write("\n")
        return EXIT_OK
    readable = "" if report["readable"] else "  (NOT readable by this kvtier)"
    lines = [
        f"root:          {report['root']}",
        f"format:        kvtier-fs layout {report['layout']}, block format "
        f"{report['block_format']}{readable}"
        + (", signed (integrity key)" if report["signed"] else ""),
        f"blocks:        {len(scan.blocks)} in {scan.shards} shard folders",
        f"bytes:         {_bytes(report['bytes'])} ({report['bytes']} bytes)",
    ]
    if scan.blocks:
        lo, hi = report["block_bytes_min"], report["block_bytes_max"]
        lines.append(f"file size:     {lo}" + (f" to {hi} bytes" if hi != lo else " bytes"))
        lines.append(
            f"age:           {_age(now - max(mtimes))} to {_age(now - min(mtimes))} "
            f"(newest {_when(max(mtimes))}, oldest {_when(min(mtimes))})"
        )
    lines.append(f"temporary:     {scan.temporary} file(s) (stores in flight or left by a crash)")
    if scan.foreign:
        lines.append(f"foreign:       {len(scan.foreign)} entries that are not kvtier blocks:")
        lines.extend(f"  {p}" for p in scan.foreign[:10])
        if len(scan.foreign) > 10:
            lines.append(f"  ... and {len(scan.foreign) - 10} more")
    out.write("\n".join(lines) + "\n")
    return EXIT_OK


# -- verify ----------------------------------------------------------------------------------


def _check_file(
    block: _BlockFile, dirs: ShardFolders, remove: bool, ikey: IntegrityKey | None
) -> tuple[str | None, bool]:
    """``(problem, removed)`` for one block file; ``problem`` is None when it is intact."""
    dir_fd = dirs.fd(block.shard)
    if dir_fd is None:
        return None, False  # the shard folder went away (or became a link): not followed
    try:
        fd = os.open(block.name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, False  # evicted by a running tier while we walked: not a fault
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        problem = _problem(block.name, data, ikey)
        removed = problem is not None and remove and remove_if_same(dir_fd, block.name, fd)
        return problem, removed
    finally:
        os.close(fd)


def _problem(name: str, data: bytes, ikey: IntegrityKey | None = None) -> str | None:
    try:
        header = decode_header(data, integrity_key=ikey)
        if name.startswith("h"):  # a long key named by its hash: the name must be that hash
            expected_key = header.key if name_of(header.key) == name else b""
        else:
            expected_key = bytes.fromhex(name)
        verify_block(expected_key, header, memoryview(data)[header.size :], integrity_key=ikey)
    except HeaderError as exc:
        return str(exc)
    except ValueError as exc:  # a block name that is not hex
        return f"bad file name: {exc}"
    return None


def _verify(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    root = Path(args.root).expanduser()
    scan = _scan(root)
    _check_compatible(scan.marker)
    ikey = _integrity_key(scan.marker)
    enabled = {"always": True, "never": False}.get(args.progress, err.isatty())
    progress = _Progress(len(scan.blocks), err, enabled, "verify")
    corrupt: list[tuple[Path, str, bool]] = []
    unreadable: list[tuple[Path, str]] = []
    checked = nbytes = 0
    dirs = ShardFolders(root)
    try:
        for i, block in enumerate(scan.blocks):
            try:
                problem, removed = _check_file(block, dirs, args.remove, ikey)
            except OSError as exc:
                unreadable.append((block.path, f"{exc.strerror or exc}"))
            else:
                checked += 1
                nbytes += block.size
                if problem is not None:
                    corrupt.append((block.path, problem, removed))
            progress.update(i + 1, nbytes)
    finally:
        dirs.close()
    progress.update(len(scan.blocks), nbytes, final=True)
    for path, problem, removed in corrupt:
        out.write(f"CORRUPT {path}: {problem}{' (removed)' if removed else ''}\n")
    for path, problem in unreadable:
        out.write(f"UNREADABLE {path}: {problem}\n")
    removed_count = sum(r for _, _, r in corrupt)
    intact = checked - len(corrupt)
    summary = f"{checked} blocks checked ({_bytes(nbytes)}): {intact} ok, {len(corrupt)} corrupt"
    if args.remove:
        summary += f" ({removed_count} removed)"
    if unreadable:
        summary += f", {len(unreadable)} unreadable"
    if scan.temporary:
        summary += f"; {scan.temporary} temporary file(s) not checked"
    out.write(summary + "\n")
    return EXIT_BAD_DATA if corrupt or unreadable else EXIT_OK


# -- config and bench ------------------------------------------------------------------------


def _load_config(path: str | None) -> Any:
    from kvtier._config import ENV_PREFIX, KVTierConfig

    if path is not None:
        return KVTierConfig.from_toml(path)
    if any(k.startswith(ENV_PREFIX) for k in os.environ):
        return KVTierConfig.from_env()
    return None


def _config(args: argparse.Namespace, out: IO[str]) -> int:
    config = _load_config(args.config)
    if config is None:
        raise _UsageError("no configuration: pass --config FILE or set KVTIER_* variables")
    json.dump(config.to_dict(), out, indent=2)
    out.write("\n")
    return EXIT_OK


@dataclass(slots=True)
class _Row:
    target: str
    op: str
    count: int
    seconds: float
    nbytes: int
    latencies: list[float]
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "target": self.target,
            "op": self.op,
            "count": self.count,
            "errors": self.errors,
            "seconds": self.seconds,
            "ops_per_s": self.count / self.seconds if self.seconds > 0 else math.inf,
            "mib_per_s": self.nbytes / (1 << 20) / self.seconds if self.nbytes else None,
            "p50_ms": _quantile(lat, 0.50) * 1e3 if lat else None,
            "p99_ms": _quantile(lat, 0.99) * 1e3 if lat else None,
        }


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def _bench_tier(tier: Any, blocks: int, block_bytes: int, concurrency: int) -> list[_Row]:
    import anyio

    keys = [b"\xbe" + os.urandom(15) for _ in range(blocks)]  # random: never a real block
    payload = memoryview(os.urandom(block_bytes))
    limiter = anyio.CapacityLimiter(concurrency)
    rows: list[_Row] = []
    log = BurstLogger(logger)  # a tier that is down fails every key: say so once

    async def timed(
        op: str, fn: Callable[[bytes], Any], keys: Sequence[bytes], nbytes: int
    ) -> None:
        latencies: list[float] = []
        errors = 0

        async def one(key: bytes) -> None:
            nonlocal errors
            async with limiter:
                t0 = time.perf_counter()
                try:
                    await fn(key)
                except KVTierError as exc:
                    errors += 1
                    kind = op + ":" + type(exc).__name__
                    log.warning(kind, "bench %s %s failed: %s", tier.name, op, exc)
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for key in keys:
                tg.start_soon(one, key)
        elapsed = time.perf_counter() - started
        rows.append(
            _Row(
                tier.name, op, len(keys), elapsed, nbytes * (len(keys) - errors), latencies, errors
            )
        )

    buffers = {k: bytearray(block_bytes) for k in keys}
    try:
        await timed("store", lambda k: tier.store(k, payload), keys, block_bytes)
        rows.append(await _bench_contains(tier, keys))
        await timed("load", lambda k: tier.load(k, memoryview(buffers[k])), keys, block_bytes)
        bad = sum(bytes(b) != payload for b in buffers.values())
        if bad:
            rows[-1].errors += bad
    finally:
        await timed("delete", tier.delete, keys, 0)  # leave nothing behind in a real cache
    return rows


async def _bench_contains(tier: Any, keys: list[bytes]) -> _Row:
    """One batched existence check of ``keys``; a key it does not find is an error."""
    started = time.perf_counter()
    present = await tier.contains_many(keys)
    elapsed = time.perf_counter() - started
    return _Row(tier.name, "contains_many", len(keys), elapsed, 0, [], len(keys) - sum(present))


async def _bench_pool(manager: Any, blocks: int, rounds: int) -> list[_Row]:
    import numpy as np

    block_bytes = manager.pool.block_bytes
    n = min(blocks, manager.pool.num_blocks)
    keys = [b"\xbf" + os.urandom(15) for _ in range(n)]
    data = np.frombuffer(os.urandom(block_bytes), np.uint8)
    src = np.broadcast_to(data, (n, block_bytes)).copy()
    started = time.perf_counter()
    stored = await manager.store(keys, src)
    rows = [_Row("manager", "store", n, time.perf_counter() - started, stored * block_bytes, [])]
    lookup = manager.lookup
    started = time.perf_counter()
    for _ in range(rounds):
        for key in keys:
            lookup(key)
    rows.append(_Row("manager", "lookup", n * rounds, time.perf_counter() - started, 0, []))
    out = np.empty((n, block_bytes), np.uint8)
    started = time.perf_counter()
    loaded = await manager.load(keys, out)
    rows.append(_Row("manager", "load", n, time.perf_counter() - started, loaded * block_bytes, []))
    await manager.wait_idle()  # let write-through finish before the tier rows are measured
    for tier in manager.tiers:
        for key in keys:
            await tier.delete(key)
    return rows


def _bench(args: argparse.Namespace, out: IO[str]) -> int:
    import anyio

    from kvtier._config import FSConfig, KVTierConfig, PoolConfig

    with contextlib.ExitStack() as stack:
        config = _load_config(args.config)
        if config is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-"))
            config = KVTierConfig(
                pool=PoolConfig(num_blocks=max(args.blocks, 1), block_bytes=256 << 10),
                fs=FSConfig(root=os.path.join(folder, "fs"), fsync="never"),
            )
            out.write(f"no --config: a host pool and an FS tier in {folder}\n")
        block_bytes = args.block_bytes or config.pool.block_bytes

        async def run() -> list[_Row]:
            rows: list[_Row] = []
            async with config.build() as manager:
                rows += await _bench_pool(manager, args.blocks, args.rounds)
                for tier in manager.tiers:
                    rows += await _bench_tier(tier, args.blocks, block_bytes, args.concurrency)
            return rows

        rows = anyio.run(run)
    results = [r.as_dict() for r in rows]
    if args.json:
        json.dump({"block_bytes": block_bytes, "results": results}, out, indent=2)
        out.write("\n")
    else:
        out.write(f"block size {_bytes(block_bytes)}, {args.blocks} blocks per tier operation\n")
        out.write(
            f"{'target':<10} {'op':<14} {'count':>7} {'errors':>6} {'ops/s':>11} "
            f"{'MiB/s':>9} {'p50 ms':>8} {'p99 ms':>8}\n"
        )
        for r in results:
            mib = "-" if r["mib_per_s"] is None else f"{r['mib_per_s']:.1f}"
            p50 = "-" if r["p50_ms"] is None else f"{r['p50_ms']:.3f}"
            p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.3f}"
            out.write(
                f"{r['target']:<10} {r['op']:<14} {r['count']:>7} {r['errors']:>6} "
                f"{r['ops_per_s']:>11.0f} {mib:>9} {p50:>8} {p99:>8}\n"
            )
    return EXIT_BAD_DATA if any(r["errors"] for r in results) else EXIT_OK


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


def _parser() -> argparse.ArgumentParser:
    from kvtier._config import parse_size

    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tools for operating a kvtier KV-cache."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
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
    parser = _parser()
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
            return _inspect(args, out)
        if args.command == "verify":
            return _verify(args, out, err)
        if args.command == "bench":
            return _bench(args, out)
        return _config(args, out)
    except (_UsageError, InvalidArgumentError, ExtraNotInstalledError) as exc:
        err.write(f"kvtier {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except KVTierError as exc:
        err.write(f"kvtier {args.command}: failed: {exc}\n")
        return EXIT_BAD_DATA
