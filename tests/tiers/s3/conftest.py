"""Fixtures of the S3 tier tests: a prefix of the test's own in the run's bucket, a factory of
tiers under it, and an AWS environment with no credentials in it."""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import pytest

from devtools.weed_server import WeedServer
from tests.support import MakeS3Tier, s3_tier


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses: tests share the run's bucket, never its objects."""
    return f"t/{uuid.uuid4().hex}"


@pytest.fixture
def make_tier(weed_server: WeedServer, prefix: str) -> MakeS3Tier:
    """S3Tiers on the run's SeaweedFS under ``prefix``; keywords are S3Tier settings."""
    return functools.partial(s3_tier, weed_server, prefix)


@pytest.fixture
def aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An AWS environment with nothing in it (its config and credentials files are
    ``tmp_path / "config"`` and ``tmp_path / "credentials"``, absent until a test writes them),
    and a fresh shared session (it caches the credentials it resolved from the chain)."""
    from kvtier.tiers.s3 import _client as _s3_client

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(_s3_client, "_session", None)
    return monkeypatch
