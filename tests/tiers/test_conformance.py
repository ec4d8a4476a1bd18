"""The conformance kit (``kvtier.testing.CHECKS``) on every tier kvtier ships, through one
parametrized ``make_tier`` fixture: the memory tier and the testing tiers, the FS tier shared
(each fsync mode, with the guard against file-system calls on the event loop), as the folder's
owner, with O_DIRECT and signed, and the S3 tier on the run's SeaweedFS, plain and signed."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

import kvtier
from devtools.weed_server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, WeedServer
from kvtier import MemoryTier
from kvtier.testing import CHECKS, FailingTier, StallingTier
from kvtier.tiers.fs import FSTier

BLOCK = 4096
SECRET = "correct horse battery staple 0123456789"

MakeTier = Callable[[], kvtier.SecondaryTier]


def _fs(root: Path, **settings: object) -> MakeTier:
    return lambda: FSTier(root, **settings)  # type: ignore[arg-type]


def _s3(server: WeedServer, **settings: object) -> MakeTier:
    from kvtier.tiers.s3 import S3Tier

    prefix = f"conformance/{uuid.uuid4().hex}"
    return lambda: S3Tier(
        BUCKET,
        prefix=prefix,
        endpoint_url=server.endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        **settings,  # type: ignore[arg-type]
    )


TIERS = [
    "memory",
    "stalling",
    "failing",
    "fs-fsync-never",
    "fs-fsync-data",
    "fs-fsync-always",
    "fs-owner",
    "fs-direct-io",
    "fs-signed",
    "s3",
    "s3-signed",
]


@pytest.fixture(params=TIERS)
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> MakeTier:
    """A factory of one tier kvtier ships, set up as its name says."""
    name: str = request.param
    if name in ("memory", "stalling", "failing"):
        return {"memory": MemoryTier, "stalling": StallingTier, "failing": FailingTier}[name]
    if name.startswith("fs-fsync-"):
        request.getfixturevalue("no_blocking")
        return _fs(tmp_path / "cache", fsync=name.removeprefix("fs-fsync-"))
    if name == "fs-owner":
        return _fs(tmp_path / "cache", shared=False)
    if name == "fs-direct-io":
        return _fs(tmp_path / "c", direct_io=True)
    if name == "fs-signed":
        return _fs(tmp_path / "cache", integrity_key=SECRET)
    pytest.importorskip("aiobotocore", reason="the S3 tier needs the kvtier[s3] extra")
    server: WeedServer = request.getfixturevalue("weed_server")
    if name == "s3":
        return _s3(server)
    return _s3(server, integrity_key=SECRET)


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_conformance(check: str, make_tier: MakeTier) -> None:
    await CHECKS[check](make_tier, BLOCK)
