"""The files at the top of an FS tier's folder that say what it holds: the format marker
(layout, block format, which MAC signs the blocks) and the cache identity manifest.

Both are read before any block is, and both refuse rather than guess: a folder kvtier did not
write, one in another format, one signed with another key or holding another cache identity
is an error at open that names what differs; neither file is ever overwritten by a tier that
disagrees with it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from pathlib import Path

from kvtier._format import (
    ALIGNED_FORMAT_VERSION,
    FORMAT_VERSION,
    LEGACY_MAC_NAME,
    MAC_NAME,
    IntegrityKey,
)
from kvtier._identity import MAX_MANIFEST_BYTES, CacheIdentity, ManifestError, check_manifest
from kvtier.tiers.fs._layout import (
    FILE_MODE,
    IDENTITY_NAME,
    MARKER,
    MARKER_NAME,
    O_CLOEXEC,
    OWN_PREFIX,
    READ_FLAGS,
    IncompatibleRoot,
    fsync_folder,
)

__all__ = [
    "check_marker",
    "claim_identity",
    "marker_for",
    "read_identity",
    "read_marker",
]


def marker_for(integrity_key: IntegrityKey | None) -> dict[str, object]:
    """The format marker a tier with (or without) an integrity key writes and expects. A
    signed folder names its MAC and the key's public fingerprint, so a node with no key or
    another key refuses the folder at open, instead of calling every block corrupt and
    removing the blocks its peers wrote."""
    if integrity_key is None:
        return dict(MARKER)
    return {**MARKER, "integrity": {"mac": MAC_NAME, "key_id": integrity_key.key_id}}


def _moved_up(found: dict[str, object]) -> dict[str, object]:
    """What an older marker reads as now: a folder of the older block format, or one signed
    with BLAKE2b (still verified), is read as it is and its marker moved up at open, so an
    older kvtier, which can read neither the new blocks nor their MAC, refuses the folder
    instead of removing them as corrupt."""
    moved = {**found}
    if moved.get("block_format") == FORMAT_VERSION:
        moved["block_format"] = ALIGNED_FORMAT_VERSION
    signed = moved.get("integrity")
    if isinstance(signed, dict) and signed.get("mac") == LEGACY_MAC_NAME:
        moved["integrity"] = {**signed, "mac": MAC_NAME}
    return moved


def read_marker(root: Path) -> bytes:
    """The marker file's bytes (``FileNotFoundError`` when there is none; a link is not a
    marker: ``OSError``)."""
    fd = os.open(root / MARKER_NAME, READ_FLAGS)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def check_marker(root: Path, expected: dict[str, object]) -> None:
    """Check the format marker of ``root``, or write it to an empty folder; raises
    ``IncompatibleRoot`` for a folder kvtier did not create or wrote in another format."""
    try:
        raw = read_marker(root)
    except FileNotFoundError:
        foreign = [n for n in os.listdir(root) if not n.startswith(OWN_PREFIX)]
        if foreign == [MARKER_NAME]:  # another opener wrote it since: check that one
            check_marker(root, expected)
            return
        if foreign:
            raise IncompatibleRoot(
                f"{root} is not empty and has no {MARKER_NAME} marker, so it is not a kvtier "
                "folder; point FSTier at an empty folder or at one kvtier created"
            ) from None
        _write_marker(root, expected)
        return
    try:
        found = json.loads(raw)
    except ValueError:
        found = None
    if isinstance(found, dict) and found != expected and _moved_up(found) == expected:
        _write_marker(root, expected)  # an older block format or MAC, moved up
        return
    if found != expected:
        if isinstance(found, dict) and {**found, "integrity": None} == {
            **expected,
            "integrity": None,
        }:
            raise IncompatibleRoot(_integrity_mismatch(root, found, expected))
        raise IncompatibleRoot(
            f"{root} holds kvtier-fs data in another format ({MARKER_NAME} says {found!r}; this "
            f"kvtier writes {expected!r}); point FSTier at another folder, or empty this one to "
            "start a fresh cache"
        )


def _integrity_mismatch(root: Path, found: dict[str, object], expected: dict[str, object]) -> str:
    have, want = found.get("integrity"), expected.get("integrity")
    if want is None:
        return (
            f"{root} holds blocks signed with an integrity key; set integrity_key "
            "(KVTIER_INTEGRITY_KEY) to the key every node sharing this folder uses"
        )
    if have is None:
        return (
            f"{root} holds unsigned blocks, and this tier has an integrity key: point it at an "
            "empty folder, or empty this one, to start a signed cache"
        )
    return (
        f"{root} is signed with another integrity key (key id {have!r}, this tier's "
        f"{want!r}); every node sharing a folder must set the same key"
    )


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, which must not exist (``FileExistsError``), and sync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, FILE_MODE)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(root: Path, marker: dict[str, object]) -> None:
    tmp = root / f"{OWN_PREFIX}.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    _write_new(tmp, json.dumps(marker).encode())
    try:
        os.rename(tmp, root / MARKER_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_folder(root)


# -- the identity manifest ---------------------------------------------------------------------


def read_identity(root: Path) -> bytes | None:
    """The identity manifest's bytes (at most one byte past ``MAX_MANIFEST_BYTES``, so an
    oversized one is seen as such), or None when the folder has none. A link is never
    followed (``OSError``)."""
    try:
        fd = os.open(root / IDENTITY_NAME, READ_FLAGS)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_MANIFEST_BYTES + 1)


def _link_or_create(tmp: Path, path: Path, data: bytes) -> None:
    """Give the whole file ``tmp`` the name ``path`` unless ``path`` exists
    (``FileExistsError``). Where the file system has no hard links, ``path`` is created
    exclusively and written in place: a racing reader may then see it half written and
    refuse to open (``ManifestError``), never a wrong identity."""
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        _write_new(path, data)


def claim_identity(root: Path, identity: CacheIdentity) -> None:
    """Check that ``root`` holds ``identity``'s blocks, recording it first in a folder that
    records none. The manifest is created whole or not at all (written aside, then linked to
    its name, which fails if another opener's is there: that one is then checked), and never
    replaced. Raises ``IdentityMismatchError`` or ``ManifestError`` (``kvtier._identity``)."""
    where = str(root / IDENTITY_NAME)
    found = read_identity(root)
    if found is None:
        tmp = root / f"{OWN_PREFIX}-identity.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        _write_new(tmp, identity.manifest())
        try:
            _link_or_create(tmp, root / IDENTITY_NAME, identity.manifest())
        except FileExistsError:
            pass  # another opener's manifest: checked below
        else:
            fsync_folder(root)
            return
        finally:
            os.unlink(tmp)
        found = read_identity(root)
        if found is None:
            raise ManifestError(f"{where} vanished right after another opener created it")
    check_manifest(found, identity, where)
