from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
import kvtier.testing


@pytest.mark.parametrize("module", [kvtier, kvtier.testing])
def test_all_is_sorted_complete_and_importable(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert names == sorted(names)
    for name in names:
        assert getattr(module, name) is not None
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, type(sys))
        and getattr(value, "__module__", "").startswith("kvtier")
    }
    assert public <= set(names), f"public but not in __all__: {public - set(names)}"


def test_pinned_names_exist() -> None:
    for name in (
        "block_keys",
        "LookupResult",
        "OffloadScheduler",
        "HostPool",
        "CudaPool",
        "SecondaryTier",
        "AsyncLookupManager",
        "MemoryTier",
        "FSTier",
        "S3Tier",
        "TieringManager",
    ):
        assert hasattr(kvtier, name), name
    assert [r.name for r in kvtier.LookupResult] == ["MISS", "HIT", "HIT_PENDING", "RETRY"]


def test_import_needs_no_optional_extra() -> None:
    code = (
        "import sys\n"
        "for name in ('aiobotocore', 'cupy', 'torch', 'botocore', 'prometheus_client', 'tqdm',\n"
        "             'rich'):\n"
        "    sys.modules[name] = None  # make the import fail\n"
        "import kvtier\n"
        "kvtier.HostPool(2, 64)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_errors_form_one_tree() -> None:
    for name in kvtier.__all__:
        value = getattr(kvtier, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, kvtier.KVTierError), name
    assert issubclass(kvtier.InvalidArgumentError, ValueError)
    error = kvtier.CorruptBlockError("bad checksum", tier="fs", operation="load", key=b"\x01\x02")
    assert (error.tier, error.operation, error.key, error.reason) == (
        "fs",
        "load",
        b"\x01\x02",
        kvtier.MissReason.CORRUPT,
    )
    assert "fs.load key=0102: bad checksum" in str(error)


def test_types_users_read_or_pass_are_exported(tmp_path: Path) -> None:
    # What a public statistics() returns, and what a public constructor takes.
    assert issubclass(kvtier.S3TierStatistics, kvtier.TierStatistics)
    key = kvtier.IntegrityKey("0123456789abcdef0123")
    assert kvtier.FSTier(tmp_path, integrity_key=key).integrity_key is key
    section = kvtier.IntegrityConfig(key="0123456789abcdef0123")
    config = kvtier.KVTierConfig(
        pool=kvtier.PoolConfig(num_blocks=1, block_bytes=64), integrity=section
    )
    assert "0123456789" not in repr(config)
    assert isinstance(
        kvtier.serve_metrics(kvtier.TieringManager(kvtier.HostPool(1, 64)), 0), kvtier.MetricsServer
    )
