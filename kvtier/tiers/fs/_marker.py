"""The files at the top of an FS tier's folder that say what it holds: the format marker
(layout, block format, which MAC signs the blocks) and the cache identity manifest.

Both are read before any block is, and both refuse rather than guess: a folder kvtier did not
write, one in another format, one signed with another key or holding another cache identity
is an error at open that names what differs; neither file is ever overwritten by a tier that
disagrees with it. Both are created exclusively (written aside, then linked to their name), so
of two openers racing on an empty folder the first one's stands and the other checks it; and
both are written back by a tier whose folder lost them while it ran, or by an opener that
adopts a folder which lost them (``_keeper``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from kvtier.common._format import (
    ALIGNED_FORMAT_VERSION,
    FORMAT_VERSION,
    LEGACY_MAC_NAME,
    MAC_NAME,
    IntegrityKey,
)
from kvtier.common._identity import MAX_MANIFEST_BYTES, CacheIdentity, ManifestError, check_manifest
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
    is_shard_name,
)

__all__ = [
    "Unmarked",
    "check_marker",
    "claim_identity",
    "foreign_names",
    "marker_for",
    "read_identity",
    "read_marker",
    "restore_marker",
]


class Unmarked(IncompatibleRoot):
    """The folder has no marker, yet holds only what kvtier writes: it lost its marker (a
    user removed it, or emptied the folder while kvtier ran), so it is not foreign."""


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


def check_marker(root: Path, expected: dict[str, object], *, again: bool = False) -> None:
    """Check the format marker of ``root``, or create it in an empty folder; raises
    ``IncompatibleRoot`` for a folder kvtier did not create or wrote in another format, and
    ``Unmarked`` for one that lost its marker but holds nothing kvtier did not write (its
    keeper decides whether to wait for the marker or write it back, ``_keeper``).

    The marker is created exclusively: of two openers that both find the folder empty, the
    first one's marker stands and the other checks it (and refuses it if they disagree),
    so a signed and an unsigned tier never both open one folder."""
    try:
        raw = read_marker(root)
    except FileNotFoundError:
        names = [n for n in os.listdir(root) if not n.startswith(OWN_PREFIX)]
        if MARKER_NAME in names and not again:  # another opener wrote it since
            check_marker(root, expected, again=True)
            return
        if names and not foreign_names(names):
            raise Unmarked(
                f"{root} has no {MARKER_NAME} marker, yet holds only kvtier's shard folders "
                "and files"
            ) from None
        if names:
            raise IncompatibleRoot(
                f"{root} is not empty and has no {MARKER_NAME} marker, so it is not a kvtier "
                "folder; point FSTier at an empty folder or at one kvtier created"
            ) from None
        if not _create_marker(root, expected):
            _check_found(root, read_marker(root), expected, raced=True)
        return
    _check_found(root, raw, expected)


def foreign_names(names: Iterable[str]) -> list[str]:
    """Which of the names at the top of a folder kvtier did not write: anything but the
    marker, kvtier's own dot files and shard folders' names. A folder that holds none of
    them may get its lost marker back (``restore_marker``); one that holds any never does."""
    return [
        n for n in names if not (n.startswith(OWN_PREFIX) or n == MARKER_NAME or is_shard_name(n))
    ]


def restore_marker(root: Path, expected: dict[str, object]) -> bool:
    """Write the marker of a folder this tier uses back when it is gone (someone emptied the
    folder while the tier ran, or removed the marker), so the folder opens again; whether it
    was written. Raises ``IncompatibleRoot`` when the folder holds files kvtier did not
    write, or when another tier wrote a marker that disagrees in the meantime."""
    try:
        os.lstat(root / MARKER_NAME)
        return False
    except FileNotFoundError:
        pass
    foreign = foreign_names(os.listdir(root))
    if foreign:
        raise IncompatibleRoot(
            f"{root} lost its {MARKER_NAME} marker while this tier used it and now holds files "
            f"kvtier did not write ({', '.join(sorted(foreign)[:3])}): not writing it back"
        )
    if _create_marker(root, expected):
        return True
    _check_found(root, read_marker(root), expected, raced=True)
    return False


def _check_found(
    root: Path, raw: bytes, expected: dict[str, object], *, raced: bool = False
) -> None:
    """Check the marker ``raw`` found in ``root`` against ``expected`` (``raced``: another
    opener wrote it while this one was about to, which the error then says)."""
    try:
        found = json.loads(raw)
    except ValueError:
        found = None
    if isinstance(found, dict) and found != expected and _moved_up(found) == expected:
        _replace_marker(root, expected)  # an older block format or MAC, moved up
        return
    if found == expected:
        return
    if isinstance(found, dict) and {**found, "integrity": None} == {
        **expected,
        "integrity": None,
    }:
        message = _integrity_mismatch(root, found, expected)
    else:
        message = (
            f"{root} holds kvtier-fs data in another format ({MARKER_NAME} says {found!r}; "
            f"this kvtier writes {expected!r}); point FSTier at another folder, or empty this "
            "one to start a fresh cache"
        )
    if raced:
        message += (
            f" (another tier opened this empty folder at the same time and wrote its "
            f"{MARKER_NAME} first)"
        )
    raise IncompatibleRoot(message)


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


def _create_marker(root: Path, marker: dict[str, object]) -> bool:
    """Create ``root``'s marker whole unless one is there: written aside, then linked to its
    name, which fails when another opener's is there (False: check that one)."""
    data = json.dumps(marker).encode()
    tmp = root / f"{OWN_PREFIX}.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    _write_new(tmp, data)
    try:
        _link_or_create(tmp, root / MARKER_NAME, data)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_folder(root)
    return True


def _replace_marker(root: Path, marker: dict[str, object]) -> None:
    """Move an agreeing older marker up: replaced whole (renamed over), so a reader sees the
    old one or the new one; another opener moving it up writes the same bytes."""
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
    replaced. Raises ``IdentityMismatchError`` or ``ManifestError``
    (``kvtier.common._identity``)."""
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
