"""``kvtier inspect`` and ``kvtier verify``: an FS tier folder, read offline.

Both walk the folder with the FS layout's own walk (``kvtier.tiers.fs._layout``), so they see
what the tier sees and follow no link; see ``kvtier._cli`` for what they promise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvtier._cli._common import EXIT_BAD_DATA, EXIT_OK, UsageError, human_bytes
from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import HeaderError, IntegrityKey, decode_header, verify_block
from kvtier.common._identity import CacheIdentity, ManifestError
from kvtier.tiers.fs._layout import (
    BLOCK_FORMATS,
    LAYOUT_VERSION,
    MARKER_NAME,
    READ_FLAGS,
    Kind,
    ShardFolders,
    name_of,
    remove_if_same,
    walk,
)
from kvtier.tiers.fs._marker import read_identity, read_marker

__all__ = ["inspect", "verify"]

_INTEGRITY_ENV = "KVTIER_INTEGRITY_KEY"


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
        raise UsageError(f"{root} is not a folder")
    marker = root / MARKER_NAME
    try:
        found = json.loads(read_marker(root))
    except FileNotFoundError:
        raise UsageError(
            f"{root} is not a kvtier FS tier folder: it has no {MARKER_NAME} marker"
        ) from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {marker}: {exc}") from None
    if not isinstance(found, dict) or found.get("format") != "kvtier-fs":
        raise UsageError(f"{marker} is not a kvtier FS marker: {found!r}")
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
        raise UsageError(
            f"this folder's blocks are signed with an integrity key: set {_INTEGRITY_ENV} to "
            "the key its FS tiers use"
        )
    try:
        ikey = IntegrityKey(secret)
    except InvalidArgumentError as exc:
        raise UsageError(f"{_INTEGRITY_ENV}: {exc}") from None
    if not isinstance(signed, dict) or signed.get("key_id") != ikey.key_id:
        raise UsageError(
            f"this folder is signed with another integrity key than {_INTEGRITY_ENV} "
            f"(folder key id {signed.get('key_id') if isinstance(signed, dict) else signed!r}, "
            f"yours {ikey.key_id})"
        )
    return ikey


def _check_compatible(marker: dict[str, Any]) -> None:
    layout, block_format = marker.get("layout"), marker.get("block_format")
    if layout != LAYOUT_VERSION or block_format not in BLOCK_FORMATS:
        raise UsageError(
            f"this folder has layout {layout!r} and block format {block_format!r}; this kvtier "
            f"reads layout {LAYOUT_VERSION} and block formats {BLOCK_FORMATS}: use the kvtier "
            "version that wrote it"
        )


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class _Progress:
    """A one-line text progress bar on a terminal; silent when disabled.

    Written here rather than taken from tqdm or rich: it is the package's only bar, and the
    installed ``kvtier`` command should not pull in a dependency for it (the scripts under
    ``examples/`` and ``benchmarks/`` use tqdm)."""

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
            f"blocks, {human_bytes(nbytes)}, {human_bytes(nbytes / elapsed)}/s"
        )
        if final:
            self.stream.write("\n")
        self.stream.flush()


# -- inspect ---------------------------------------------------------------------------------


def inspect(args: argparse.Namespace, out: IO[str]) -> int:
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
        and scan.marker.get("block_format") in BLOCK_FORMATS,
        "signed": scan.marker.get("integrity") is not None,
        "identity": _identity(root),
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
        f"identity:      {_identity_line(report['identity'])}",
        f"blocks:        {len(scan.blocks)} in {scan.shards} shard folders",
        f"bytes:         {human_bytes(report['bytes'])} ({report['bytes']} bytes)",
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


def _identity(root: Path) -> dict[str, Any] | None:
    """The cache identity the folder records (its manifest's fields), None when it records
    none, or ``{"error": ...}`` for a manifest that cannot be read or is not valid."""
    try:
        raw = read_identity(root)
        return None if raw is None else CacheIdentity.from_manifest(raw).fields()
    except (OSError, ManifestError) as exc:
        return {"error": str(exc)}


def _identity_line(identity: dict[str, Any] | None) -> str:
    if identity is None:
        return "none recorded (tiers here vouch for their keys' namespace)"
    if "error" in identity:
        return f"UNREADABLE: {identity['error']}"
    return ", ".join(f"{name}={value!r}" for name, value in identity.items())


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
        header = decode_header(data, integrity_key=ikey, versions=BLOCK_FORMATS)
        if name.startswith("h"):  # a long key named by its hash: the name must be that hash
            expected_key = header.key if name_of(header.key) == name else b""
        else:
            expected_key = bytes.fromhex(name)
        verify_block(
            expected_key, header, memoryview(data)[header.payload_offset :], integrity_key=ikey
        )
    except HeaderError as exc:
        return str(exc)
    except ValueError as exc:  # a block name that is not hex
        return f"bad file name: {exc}"
    return None


def verify(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
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
    summary = (
        f"{checked} blocks checked ({human_bytes(nbytes)}): {intact} ok, {len(corrupt)} corrupt"
    )
    if args.remove:
        summary += f" ({removed_count} removed)"
    if unreadable:
        summary += f", {len(unreadable)} unreadable"
    if scan.temporary:
        summary += f"; {scan.temporary} temporary file(s) not checked"
    out.write(summary + "\n")
    return EXIT_BAD_DATA if corrupt or unreadable else EXIT_OK
