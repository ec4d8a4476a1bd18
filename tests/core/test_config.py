"""KVTierConfig: from a dict, a TOML file and the environment; validation; build()."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import (
    AdmissionPolicy,
    CostModel,
    FSConfig,
    HostPool,
    InvalidArgumentError,
    KVTierConfig,
    LookupResult,
    ManagerConfig,
    PoolConfig,
    S3Config,
)
from kvtier.manager import TieringManager
from kvtier.manager._stack_config import parse_size
from kvtier.testing import resolve_lookup
from kvtier.tiers.fs import FSTier

POOL = {"num_blocks": 8, "block_bytes": 4096}


def test_from_dict_defaults_and_normalised_values(tmp_path: Path) -> None:
    config = KVTierConfig.from_dict(
        {
            "pool": {"num_blocks": 8, "block_bytes": "4KiB", "policy": "ARC"},
            "fs": {"root": tmp_path, "capacity_bytes": "1.5MB"},
            "manager": {"promotion_timeout": 2},
        }
    )
    assert config.pool == PoolConfig(num_blocks=8, block_bytes=4096, policy="arc")
    assert config.fs == FSConfig(root=str(tmp_path), capacity_bytes=1_500_000)
    assert config.s3 is None
    assert config.manager.promotion_timeout == 2.0
    assert isinstance(config.manager.promotion_timeout, float)
    assert config.manager.store_timeout == ManagerConfig().store_timeout


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("64KiB", 65536),
        ("2 GB", 2 * 10**9),
        ("1_024b", 1024),
        ("1.5MiB", 1572864),
        ("3t", 3 * 10**12),
    ],
)
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "12 parsecs", "1.5", "-3", "KiB", True, 1.5, None])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_size(text)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "pool is required"),
        ({"pool": {"num_blocks": 8}}, "pool.block_bytes is required"),
        ({"pool": {**POOL, "num_blocks": 0}}, "pool.num_blocks must be a positive integer; got 0"),
        ({"pool": {**POOL, "num_blocks": True}}, "pool.num_blocks must be a positive integer"),
        ({"pool": {**POOL, "num_blocks": "8"}}, "pool.num_blocks must be a positive integer"),
        (
            {"pool": {**POOL, "block_bytes": "4 furlongs"}},
            "pool.block_bytes must be a positive size",
        ),
        ({"pool": {**POOL, "kind": "tpu"}}, "pool.kind must be one of 'host', 'cuda'; got 'tpu'"),
        ({"pool": {**POOL, "polcy": "lru"}}, "unknown key pool.polcy: did you mean 'policy'?"),
        ({"pool": POOL, "fss": {}}, "unknown config section 'fss': did you mean 'fs'?"),
        ({"pool": POOL, "fs": "/tmp"}, "fs must be a table of settings"),
        ({"pool": POOL, "fs": {"capacity_bytes": 10}}, "fs.root is required"),
        ({"pool": POOL, "fs": {"root": ""}}, "fs.root must be a folder path"),
        ({"pool": POOL, "fs": {"root": "x", "fsync": "yes"}}, "fs.fsync must be one of 'never'"),
        ({"pool": POOL, "fs": {"root": "x", "miss_ttl": -1}}, "fs.miss_ttl must be a positive"),
        ({"pool": POOL, "fs": {"root": "x", "miss_ttl": float("nan")}}, "fs.miss_ttl must be"),
        ({"pool": POOL, "s3": {"prefix": "p"}}, "s3.bucket is required"),
        (
            {"pool": POOL, "s3": {"bucket": "b", "endpoint_url": "localhost:9000"}},
            "s3.endpoint_url must be an http:// or https:// URL",
        ),
        ({"pool": POOL, "manager": {"close_timeout": "soon"}}, "manager.close_timeout must be"),
        ({"pool": POOL, "manager": {"max_in_flight_bytes": 0}}, "manager.max_in_flight_bytes"),
        (
            {"pool": POOL, "manager": {"failure_ttl": 0}},
            "manager.failure_ttl must be a positive number of seconds; got 0",
        ),
        (
            {"pool": POOL, "manager": {"recompute_seconds_per_block": -0.001}},
            "manager.recompute_seconds_per_block must be a number of seconds >= 0, or nothing",
        ),
        (
            {"pool": POOL, "manager": {"max_write_latency": "fast"}},
            "manager.max_write_latency must be a positive number of seconds, or nothing",
        ),
        (
            {"pool": POOL, "manager": {"promotion_probe_interval": float("inf")}},
            "manager.promotion_probe_interval must be a positive number of seconds",
        ),
        (
            {"pool": POOL, "manager": {"write_probe_interval": -1}},
            "manager.write_probe_interval must be a positive number of seconds",
        ),
        (
            {"pool": POOL, "manager": {"tier_max_in_flight_bytes": "lots"}},
            "manager.tier_max_in_flight_bytes must be a positive size in bytes",
        ),
        (
            {"pool": POOL, "manager": {"write_back_limit": 0}},
            "manager.write_back_limit must be a positive integer, or nothing; got 0",
        ),
        (
            {"pool": POOL, "s3": {"bucket": "kv-cache"}, "manager": {"write_back": "s3"}},
            "manager.write_back must be a list of tier names such as ['s3']",
        ),
        (
            {"pool": POOL, "manager": {"write_back": ["s3", 3]}},
            "manager.write_back must be a list of tier names",
        ),
        (
            {"pool": POOL, "manager": {"write_back_limit": 8}},
            "manager.write_back_limit (8) must be below pool.num_blocks (8)",
        ),
        (
            {"pool": POOL, "fs": {"root": "x"}, "manager": {"write_back": ["S3"]}},
            "manager.write_back names 'S3', which is not a configured tier (configured tiers: 'fs'",
        ),
        (
            {"pool": POOL, "fs": {"root": "x"}, "manager": {"deferred": ["s3"]}},
            "manager.deferred names 's3', which is not a configured tier (configured tiers: 'fs'",
        ),
        (
            {"pool": POOL, "s3": {"bucket": "kv-cache"}, "manager": {"deferred": "s3"}},
            "manager.deferred must be a list of tier names such as ['s3']",
        ),
        (
            {
                "pool": POOL,
                "s3": {"bucket": "kv-cache"},
                "manager": {"deferred": ["s3"], "write_back": ["s3"]},
            },
            "manager.deferred and manager.write_back both name 's3'",
        ),
        (
            {"pool": POOL, "manager": {"max_write_rate": 0}},
            "manager.max_write_rate must be a positive rate in bytes per second",
        ),
        (
            {"pool": POOL, "manager": {"max_write_rate": "fast"}},
            "manager.max_write_rate must be a positive rate in bytes per second: a number or a "
            "size such as '64MiB' (/s), or nothing; got 'fast'",
        ),
        (
            {"pool": POOL, "manager": {"max_write_rate": float("inf")}},
            "manager.max_write_rate must be a positive rate",
        ),
        (
            {"pool": POOL, "manager": {"max_write_rate": True}},
            "manager.max_write_rate must be a positive rate",
        ),
        (
            {"pool": POOL, "manager": {"open_timeout": 0}},
            "manager.open_timeout must be a positive number of seconds, or nothing; got 0",
        ),
        (
            {"pool": POOL, "manager": {"promote_write_up": "yes"}},
            "manager.promote_write_up must be true or false; got 'yes'",
        ),
    ],
)
def test_from_dict_rejects_bad_values_naming_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        KVTierConfig.from_dict(data)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_secrets_never_appear_in_repr_or_errors() -> None:
    secret = "wJalrXUtnFEMI/K7MDENG-very-secret"
    config = KVTierConfig.from_dict(
        {
            "pool": POOL,
            "s3": {
                "bucket": "kv-cache",
                "aws_access_key_id": "AKIDEXAMPLE",
                "aws_secret_access_key": secret,
                "aws_session_token": "token-secret",
            },
        }
    )
    assert config.s3 is not None and config.s3.aws_secret_access_key == secret
    for text in (repr(config), str(config), repr(config.s3), str(config.to_dict())):
        assert secret not in text and "token-secret" not in text and "AKIDEXAMPLE" not in text
    assert "credentials=set" in repr(config.s3)
    with pytest.raises(InvalidArgumentError) as info:
        S3Config(bucket="b", aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key=12345)  # type: ignore[arg-type]
    assert "12345" not in str(info.value) and "hidden" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="go together"):
        KVTierConfig.from_dict(
            {"pool": POOL, "s3": {"bucket": "b", "aws_secret_access_key": secret}}
        )


def test_sections_validate_when_built_directly() -> None:
    with pytest.raises(InvalidArgumentError, match=r"pool\.policy must be one of 'lru', 'arc'"):
        PoolConfig(num_blocks=1, block_bytes=1, policy="fifo")
    with pytest.raises(InvalidArgumentError, match="pool must be a PoolConfig"):
        KVTierConfig(pool={"num_blocks": 1})  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        PoolConfig(num_blocks=1, block_bytes=1).num_blocks = 2  # type: ignore[misc]


# -- TOML --------------------------------------------------------------------------------------


def test_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        f"""
[pool]
kind = "host"
num_blocks = 4096
block_bytes = "256KiB"

[fs]
root = "{tmp_path / "cache"}"
capacity_bytes = "200GiB"
fsync = "always"

[s3]
bucket = "kv-cache"
prefix = "llama-8b"
endpoint_url = "http://127.0.0.1:9000"
max_attempts = 5

[manager]
promotion_timeout = 2.5
"""
    )
    config = KVTierConfig.from_toml(path)
    assert config.pool.block_bytes == 256 << 10
    assert config.fs is not None and config.fs.capacity_bytes == 200 << 30
    assert config.fs.fsync == "always"
    assert config.s3 is not None and config.s3.max_attempts == 5
    assert config.s3.endpoint_url == "http://127.0.0.1:9000"
    assert config.manager.promotion_timeout == 2.5


def test_from_toml_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[pool]\nnum_blocks = 8\nblock_bytes = "4KiB"\n[fs]\nroot = 3\n')
    with pytest.raises(InvalidArgumentError, match=f"{path}: fs.root must be a folder path"):
        KVTierConfig.from_toml(path)
    path.write_text("[pool\n")
    with pytest.raises(InvalidArgumentError, match="is not valid TOML"):
        KVTierConfig.from_toml(path)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        KVTierConfig.from_toml(tmp_path / "missing.toml")


# -- environment -------------------------------------------------------------------------------

ENV = {"KVTIER_POOL_NUM_BLOCKS": "16", "KVTIER_POOL_BLOCK_BYTES": "1MiB", "PATH": "/usr/bin"}


def test_from_env() -> None:
    env = {
        **ENV,
        "KVTIER_POOL_POLICY": "arc",
        "KVTIER_FS_ROOT": "/var/cache/kvtier",
        "KVTIER_FS_CAPACITY_BYTES": "10GiB",
        "KVTIER_S3_BUCKET": "kv-cache",
        "KVTIER_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
        "KVTIER_S3_AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "KVTIER_S3_AWS_SECRET_ACCESS_KEY": "secret",
        "KVTIER_MANAGER_STORE_TIMEOUT": "7.5",
    }
    config = KVTierConfig.from_env(env)
    assert config.pool == PoolConfig(num_blocks=16, block_bytes=1 << 20, policy="arc")
    assert config.fs == FSConfig(root="/var/cache/kvtier", capacity_bytes=10 << 30)
    assert config.s3 is not None and config.s3.bucket == "kv-cache"
    assert config.s3.aws_secret_access_key == "secret"
    assert config.manager.store_timeout == 7.5


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_POOL_NUM_BLOCKS", "3")
    monkeypatch.setenv("KVTIER_POOL_BLOCK_BYTES", "512")
    assert KVTierConfig.from_env().pool.num_blocks == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"KVTIER_POOL_NUM_BLOCKS": "lots"},
            "KVTIER_POOL_NUM_BLOCKS must be a positive integer; got 'lots'",
        ),
        (
            {"KVTIER_POOL_NUM_BLOCK": "1"},
            "unknown environment variable KVTIER_POOL_NUM_BLOCK: "
            "did you mean 'KVTIER_POOL_NUM_BLOCKS'?",
        ),
        ({"KVTIER_FS_CAPACITY_BYTES": "1GiB"}, "fs.root (KVTIER_FS_ROOT) is required"),
        ({"KVTIER_DISK_ROOT": "/x"}, "unknown environment variable KVTIER_DISK_ROOT"),
        (
            {"KVTIER_S3_BUCKET": "b", "KVTIER_S3_AWS_SECRET_ACCESS_KEY": "hush"},
            "KVTIER_S3_*: aws_access_key_id and aws_secret_access_key go together",
        ),
        (
            {"KVTIER_MANAGER_PROMOTION_TIMEOUT": "-1"},
            "KVTIER_MANAGER_PROMOTION_TIMEOUT must be a positive number of seconds",
        ),
        (
            {"KVTIER_MANAGER_RECOMPUTE_SECONDS_PER_BLOCK": "4ms"},
            "KVTIER_MANAGER_RECOMPUTE_SECONDS_PER_BLOCK must be a number of seconds >= 0",
        ),
        (
            {"KVTIER_MANAGER_FAILURE_TTL": "nan"},
            "KVTIER_MANAGER_FAILURE_TTL must be a positive number of seconds",
        ),
        (
            {"KVTIER_MANAGER_WRITE_BACK": "s3"},
            "manager.write_back names 's3', which is not a configured tier (configured tiers: none",
        ),
        (
            {"KVTIER_MANAGER_WRITE_BACK_LIMT": "4"},
            "did you mean 'KVTIER_MANAGER_WRITE_BACK_LIMIT'?",
        ),
        (
            {"KVTIER_MANAGER_DEFERRED": "fs"},
            "manager.deferred names 'fs', which is not a configured tier (configured tiers: none",
        ),
        (
            {"KVTIER_MANAGER_MAX_WRITE_RATE": "2 MiB per second"},
            "KVTIER_MANAGER_MAX_WRITE_RATE must be a positive rate in bytes per second",
        ),
        (
            {"KVTIER_MANAGER_MAX_WRITE_RATE": "-5"},
            "KVTIER_MANAGER_MAX_WRITE_RATE must be a positive rate in bytes per second",
        ),
        (
            {"KVTIER_MANAGER_OPEN_TIMEOUT": "2m"},
            "KVTIER_MANAGER_OPEN_TIMEOUT must be a positive number of seconds, or nothing",
        ),
        (
            {"KVTIER_MANAGER_PROMOTE_WRITE_UP": "off"},
            "KVTIER_MANAGER_PROMOTE_WRITE_UP must be true or false; got 'off'",
        ),
        (
            {"KVTIER_MANAGER_DEFERED": "s3"},
            "did you mean 'KVTIER_MANAGER_DEFERRED'?",
        ),
    ],
)
def test_from_env_rejects_bad_variables(extra: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        KVTierConfig.from_env({**ENV, **extra})
    assert message in str(info.value)
    assert "hush" not in str(info.value)


def test_from_env_needs_some_configuration() -> None:
    with pytest.raises(InvalidArgumentError, match="KVTIER_POOL_NUM_BLOCKS"):
        KVTierConfig.from_env({"PATH": "/usr/bin"})


def test_from_env_overrides_the_file_in_kvtier_config(tmp_path: Path) -> None:
    path = tmp_path / "base.toml"
    path.write_text('[pool]\nnum_blocks = 8\nblock_bytes = "4KiB"\n[fs]\nroot = "/data/kv"\n')
    config = KVTierConfig.from_env(
        {"KVTIER_CONFIG": str(path), "KVTIER_POOL_NUM_BLOCKS": "32", "KVTIER_FS_FSYNC": "never"}
    )
    assert config.pool.num_blocks == 32 and config.pool.block_bytes == 4096
    assert config.fs == FSConfig(root="/data/kv", fsync="never")
    path.write_text('[pool]\nnum_blocks = "8"\nblock_bytes = 1\n')  # a string in TOML stays wrong
    with pytest.raises(InvalidArgumentError, match=f"{path}: pool.num_blocks must be"):
        KVTierConfig.from_env({"KVTIER_CONFIG": str(path)})


# -- build -------------------------------------------------------------------------------------


async def test_build_makes_a_working_manager(tmp_path: Path) -> None:
    config = KVTierConfig.from_dict(
        {
            "pool": {"num_blocks": 4, "block_bytes": 4096},
            "fs": {"root": str(tmp_path / "cache"), "fsync": "never", "capacity_bytes": "1MiB"},
            "manager": {"promotion_timeout": 3},
        }
    )
    manager = config.build()
    assert isinstance(manager, TieringManager) and isinstance(manager.pool, HostPool)
    assert manager.pool.num_blocks == 4 and manager.pool.block_bytes == 4096
    (tier,) = manager.tiers
    assert isinstance(tier, FSTier)
    assert tier.capacity_bytes == 1 << 20 and tier.fsync == "never"
    assert tier.root == tmp_path / "cache"
    key = b"\x01" + os.urandom(15)
    block = np.frombuffer(os.urandom(4096), np.uint8)
    async with manager:
        assert await manager.store([key], block[None, :]) == 1
        await manager.wait_idle()
        assert await resolve_lookup(tier, key) is LookupResult.HIT
    assert (tmp_path / "cache").is_dir()


def test_two_tiers_with_one_name_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"fs.name and s3.name must differ"):
        KVTierConfig.from_dict(
            {
                "pool": POOL,
                "fs": {"root": str(tmp_path), "name": "t"},
                "s3": {"bucket": "kv-cache", "name": "t"},
            }
        )


def test_build_prefixes_tier_errors_with_the_section() -> None:
    config = KVTierConfig.from_dict({"pool": POOL, "s3": {"bucket": "Not A Bucket!"}})
    with pytest.raises(InvalidArgumentError, match=r"^s3: bucket 'Not A Bucket!' is not a valid"):
        config.build_tiers()


def test_cuda_pool_without_cupy_names_the_extra() -> None:
    pytest.importorskip("kvtier.pools._cuda")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("cupy is installed here")
    config = KVTierConfig.from_dict({"pool": {**POOL, "kind": "cuda"}})
    with pytest.raises(ImportError, match=r"kvtier\[cuda\]"):
        config.build()


# -- manager: cost model and admission -----------------------------------------------------

MANAGER = {
    "failure_ttl": 0.5,
    "recompute_seconds_per_block": 0.004,
    "promotion_probe_interval": 2.0,
    "max_write_latency": 0.1,
    "write_probe_interval": 0.5,
    "tier_max_in_flight_bytes": "8KiB",
    "write_back": ["s3"],
    "write_back_limit": 3,
    "deferred": ["fs"],
    "max_write_rate": "2MiB",
    "open_timeout": 90,
    "promote_write_up": False,
}
MANAGER_PARSED = ManagerConfig(
    failure_ttl=0.5,
    recompute_seconds_per_block=0.004,
    promotion_probe_interval=2.0,
    max_write_latency=0.1,
    write_probe_interval=0.5,
    tier_max_in_flight_bytes=8192,
    write_back=("s3",),
    write_back_limit=3,
    deferred=("fs",),
    max_write_rate=float(2 << 20),
    open_timeout=90.0,
    promote_write_up=False,
)


def test_manager_policy_settings_from_dict_toml_and_env(tmp_path: Path) -> None:
    tiers = {"fs": {"root": str(tmp_path)}, "s3": {"bucket": "kv-cache"}}
    assert KVTierConfig.from_dict({"pool": POOL, **tiers, "manager": MANAGER}).manager == (
        MANAGER_PARSED
    )
    path = tmp_path / "kvtier.toml"
    path.write_text(
        f"""
[pool]
num_blocks = 8
block_bytes = 4096
[fs]
root = "{tmp_path}"
[s3]
bucket = "kv-cache"
[manager]
failure_ttl = 0.5
recompute_seconds_per_block = 0.004
promotion_probe_interval = 2
max_write_latency = 0.1
write_probe_interval = 0.5
tier_max_in_flight_bytes = "8KiB"
write_back = ["s3"]
write_back_limit = 3
deferred = ["fs"]
max_write_rate = "2MiB/s"
open_timeout = 90
promote_write_up = false
"""
    )
    assert KVTierConfig.from_toml(path).manager == MANAGER_PARSED
    env = {
        **ENV,
        "KVTIER_FS_ROOT": str(tmp_path),
        "KVTIER_S3_BUCKET": "kv-cache",
        **{
            f"KVTIER_MANAGER_{name.upper()}": ",".join(value)
            if isinstance(value, list)
            else str(value).lower()  # "False" -> "false", as a shell script would write it
            for name, value in MANAGER.items()
        },
    }
    assert KVTierConfig.from_env(env).manager == MANAGER_PARSED
    # Text forms: several names, separated by commas; "none" for an optional setting.
    env |= {
        "KVTIER_MANAGER_WRITE_BACK": " s3, fs ,",
        "KVTIER_MANAGER_DEFERRED": "",
        "KVTIER_MANAGER_MAX_WRITE_LATENCY": "none",
        "KVTIER_MANAGER_MAX_WRITE_RATE": "none",
    }
    manager = KVTierConfig.from_env(env).manager
    assert manager.write_back == ("s3", "fs") and manager.max_write_latency is None
    assert manager.deferred == () and manager.max_write_rate is None
    assert KVTierConfig.from_env({**ENV, "KVTIER_MANAGER_WRITE_BACK": ""}).manager.write_back == ()
    env = {
        **ENV,
        "KVTIER_FS_ROOT": str(tmp_path),
        "KVTIER_S3_BUCKET": "kv-cache",
        "KVTIER_MANAGER_DEFERRED": "s3, fs",
        "KVTIER_MANAGER_MAX_WRITE_RATE": "1500000.5",
        "KVTIER_MANAGER_OPEN_TIMEOUT": "none",
        "KVTIER_MANAGER_PROMOTE_WRITE_UP": "1",
    }
    manager = KVTierConfig.from_env(env).manager
    assert manager.deferred == ("s3", "fs") and manager.max_write_rate == 1500000.5
    assert manager.open_timeout is None and manager.promote_write_up is True


@pytest.mark.parametrize(
    ("rate", "parsed"),
    [(1000, 1000.0), (2.5e6, 2.5e6), ("4096", 4096.0), ("64MiB", 64 << 20), ("1 GB/s", 1e9)],
)
def test_max_write_rate_takes_numbers_and_sizes_per_second(rate: object, parsed: float) -> None:
    config = KVTierConfig.from_dict({"pool": POOL, "manager": {"max_write_rate": rate}})
    assert config.manager.max_write_rate == parsed
    assert isinstance(config.manager.max_write_rate, float)


def test_manager_defaults_are_the_classes_defaults() -> None:
    """A config that leaves a setting out gets what the class itself would do."""
    config = ManagerConfig()

    def defaults(function: Any) -> dict[str, Any]:
        return {
            name: p.default
            for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    # the manager's own defaults are its ManagerConfig's: what one made without settings holds
    made = TieringManager(HostPool(4, 4096)).config
    manager = {f.name: getattr(made, f.name) for f in dataclasses.fields(made)}
    cost = defaults(CostModel.__init__)
    admission = defaults(AdmissionPolicy.__init__)
    for name in ("promotion_timeout", "store_timeout", "max_in_flight_bytes", "close_timeout"):
        assert getattr(config, name) == manager[name], name
    assert config.failure_ttl == manager["failure_ttl"]
    assert config.write_back_limit == manager["write_back_limit"]
    assert config.recompute_seconds_per_block == cost["recompute_seconds_per_block"]
    assert config.promotion_probe_interval == cost["probe_interval"]
    assert config.max_write_latency == admission["max_write_latency"]
    assert config.write_probe_interval == admission["probe_interval"]
    assert config.write_back == tuple(admission["write_back"])
    assert config.deferred == tuple(admission["deferred"])
    assert config.max_write_rate == admission["max_write_rate"]
    assert config.open_timeout == manager["open_timeout"]
    assert config.promote_write_up == manager["promote_write_up"]
    assert config.require_all_tiers == manager["require_all_tiers"]
    assert config.tier_answer_wait == manager["tier_answer_wait"]
    assert config.tier_open_wait == manager["tier_open_wait"]
    # Every ManagerConfig key is checked above or is one of these (a new key must be added).
    checked = {
        "promotion_timeout", "store_timeout", "max_in_flight_bytes", "close_timeout",
        "failure_ttl", "write_back_limit", "recompute_seconds_per_block",
        "promotion_probe_interval", "max_write_latency", "write_probe_interval", "write_back",
        "deferred", "max_write_rate", "open_timeout", "promote_write_up", "require_all_tiers",
        "tier_answer_wait", "tier_open_wait",
        "tier_max_in_flight_bytes",  # None: the manager's default_tier_in_flight_bytes()
    }  # fmt: skip
    assert {f.name for f in dataclasses.fields(ManagerConfig)} == checked


def test_build_hands_the_manager_its_cost_model_and_admission(tmp_path: Path) -> None:
    config = KVTierConfig.from_dict(
        {
            "pool": POOL,
            "fs": {"root": str(tmp_path)},
            "s3": {"bucket": "kv-cache"},
            "manager": MANAGER,
        }
    )
    manager = config.build()
    assert manager.cost.recompute_seconds_per_block == 0.004
    assert manager.cost._probe_interval == 2.0
    assert manager._failed._ttl == 0.5
    policy = manager.admission
    assert policy.max_write_latency == 0.1 and policy._probe_interval == 0.5
    assert policy.write_back_tiers == {"s3"}
    assert [t.name for t in manager._writer.write_back_tiers] == ["s3"]
    assert [t.name for t in manager._writer.through_tiers] == ["fs"]
    assert manager._writer.write_back.limit == 3
    assert policy.admit("fs", 8192) and not policy.admit("fs", 1)  # the per-tier limit
    assert policy.statistics(["fs"])[0].dropped_by_cause == {"in_flight": 1}
    assert manager.config.open_timeout == 90.0 and manager.config.promote_write_up is False
    assert policy.deferred_tiers == {"fs"} and policy._rate == 2 << 20
    # The rate applies to every tier: with the clock stopped, s3 takes one second's worth.
    policy.clock = lambda: 0.0
    for _ in range((2 << 20) // 4096):
        assert policy.admit("s3", 4096)
        policy.finished("s3", 4096, 0.0)
    assert not policy.admit("s3", 4096)
    assert policy.statistics(["s3"])[0].dropped_by_cause == {"rate": 1}


def test_build_needs_open_timeout_above_the_s3_listing_bound() -> None:
    lists_at_open = {"bucket": "kv-cache", "index_background_load": False}
    config = KVTierConfig.from_dict(
        {"pool": POOL, "s3": lists_at_open, "manager": {"open_timeout": 30}}
    )
    assert len(config.build_tiers()) == 1  # a tier alone (the vLLM adapter) opens unbounded
    with pytest.raises(
        InvalidArgumentError,
        match=r"manager.open_timeout \(30 s\) must be above s3.index_list_timeout \(60 s\)",
    ):
        config.build()
    shorter = {"index_background_load": False, "index_list_timeout": 20}
    # No listing, one after the open, or a shorter one: built.
    for s3 in ({"lookup_mode": "ask"}, {"index_background_load": True}, shorter):
        settings = {"bucket": "kv-cache", **s3}
        KVTierConfig.from_dict(
            {"pool": POOL, "s3": settings, "manager": {"open_timeout": 30}}
        ).build()
    KVTierConfig.from_dict(
        {"pool": POOL, "s3": {"bucket": "kv-cache"}, "manager": {"open_timeout": None}}
    ).build()
    with pytest.raises(InvalidArgumentError, match=r"must be above s3\.index_list_timeout"):
        KVTierConfig.from_dict(  # the default lists inside the open
            {"pool": POOL, "s3": {"bucket": "kv-cache"}, "manager": {"open_timeout": 30}}
        ).build()


def test_build_without_policy_settings_matches_a_default_manager(tmp_path: Path) -> None:
    config = KVTierConfig.from_dict(
        {"pool": POOL, "fs": {"root": str(tmp_path)}, "s3": {"bucket": "kv-cache"}}
    )
    built = config.build()
    default = TieringManager(config.build_pool(), config.build_tiers())
    limit = default.default_tier_in_flight_bytes()
    for manager in (built, default):
        policy = manager.admission
        assert policy.admit("s3", limit) and not policy.admit("s3", 1)
        assert policy.max_write_latency == 0.25 and policy.write_back_tiers == frozenset()
        assert policy.deferred_tiers == frozenset() and policy._rate is None
        assert manager.config.open_timeout == 120.0 and manager.config.promote_write_up is True
        assert manager.cost.recompute_seconds_per_block is None
        assert manager._writer.write_back.limit == POOL["num_blocks"] // 4


async def test_write_back_from_config_writes_the_tier_on_close(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    config = KVTierConfig.from_dict(
        {
            "pool": {"num_blocks": 4, "block_bytes": 4096},
            "fs": {"root": str(root), "fsync": "never", "shared": False},
            "manager": {"write_back": ["fs"], "write_back_limit": 2},
        }
    )
    key = b"\x01" + os.urandom(15)
    block = np.frombuffer(os.urandom(4096), np.uint8)
    manager = config.build()
    (tier,) = manager.tiers
    async with manager:
        assert await manager.store([key], block[None, :]) == 1
        await manager.wait_idle()
        assert tier.lookup(key) is LookupResult.MISS  # not written through
    async with FSTier(root, fsync="never") as reopened:
        assert await resolve_lookup(reopened, key) is LookupResult.HIT  # written at close


def test_the_readme_manager_example_is_valid() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Operating it", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block, "no TOML example in the README's Operating it section"
    example = tomllib.loads("\n".join(line.strip() for line in block[1].splitlines()))
    pool = {"num_blocks": 4096, "block_bytes": "256KiB"}
    tiers = {"fs": {"root": "/var/cache/kvtier"}, "s3": {"bucket": "kv-cache"}}
    config = KVTierConfig.from_dict({"pool": pool, **tiers, **example})
    assert config.manager.deferred == ("s3",) and config.manager.max_write_rate == 512 << 20
    assert config.manager.open_timeout == 120.0 and config.manager.promote_write_up is True


def test_fs_direct_io_from_dict_and_env(tmp_path: Path) -> None:
    base: dict[str, Any] = {"pool": POOL, "fs": {"root": str(tmp_path)}}
    (tier,) = KVTierConfig.from_dict(base).build_tiers()
    assert isinstance(tier, FSTier) and tier.direct_io is True
    base["fs"]["direct_io"] = False
    (tier,) = KVTierConfig.from_dict(base).build_tiers()
    assert isinstance(tier, FSTier) and tier.direct_io is False
    env = {
        "KVTIER_POOL_NUM_BLOCKS": "8",
        "KVTIER_POOL_BLOCK_BYTES": "4096",
        "KVTIER_FS_ROOT": str(tmp_path),
        "KVTIER_FS_DIRECT_IO": "false",
    }
    fs = KVTierConfig.from_env(env).fs
    assert fs is not None and fs.direct_io is False
    with pytest.raises(ValueError, match="direct_io"):
        KVTierConfig.from_dict({"pool": POOL, "fs": {"root": str(tmp_path), "direct_io": "x"}})
