"""One typed configuration for a whole kvtier stack: pool, tiers and manager.

Operators configure kvtier the way they configure the engine around it: a TOML file, ``KVTIER_*``
environment variables (containers, systemd units) or a dict an application already has. All
three land in the same frozen ``KVTierConfig``, validated once, with messages that name the key
the way the operator wrote it (``pool.num_blocks`` in a dict or file, ``KVTIER_POOL_NUM_BLOCKS``
in the environment) and say what is expected. ``build()`` then makes the pool, the tiers and the
``TieringManager`` in one call.

Each section is its component's own settings object, defined beside it with its names,
defaults and checks (``kvtier.common._settings.Section``): ``PoolConfig`` in
``kvtier.pools._config``, ``FSConfig`` in ``kvtier.tiers.fs``, ``S3Config`` with the S3 tier,
``ManagerConfig`` in ``kvtier.manager._config`` and ``IntegrityConfig`` in
``kvtier.common._format``. A key of a file is the name of its field and of the component's keyword
argument. This module only reads the sources into those objects, applies the rules that span
sections and builds.

A file looks like this (every section but ``pool`` is optional)::

    [pool]
    kind = "host"            # or "cuda"
    num_blocks = 4096
    block_bytes = "256KiB"   # sizes take an int or a string with a unit
    policy = "lru"           # or "arc"

    [fs]
    root = "/var/cache/kvtier"
    capacity_bytes = "200GiB"
    fsync = "data"           # never | data | always
    shared = "auto"          # owner (lookups without a stat) while alone; true: always check

    [s3]
    bucket = "kv-cache"
    prefix = "llama-8b"
    endpoint_url = "http://127.0.0.1:9000"

    [manager]
    promotion_timeout = 10.0
    failure_ttl = 2.0        # a failed promotion counts as a miss for this long
    recompute_seconds_per_block = 0.004  # the engine's prefill cost: never wait longer
    max_write_latency = 0.25 # a tier whose writes average longer gets no new blocks
    tier_max_in_flight_bytes = "64MiB"
    write_back = ["s3"]      # written only when a block leaves the pool (env: "s3,fs")
    deferred = []            # dropped writes queued and copied later (not with write_back)
    max_write_rate = "512MiB" # bytes/s given to each tier at most (unset: no limit)
    open_timeout = 120.0     # each tier must open within this (unset: no bound)
    promote_write_up = true  # a block promoted from s3 is written to fs too

    [integrity]
    key = "..."              # better: KVTIER_INTEGRITY_KEY in the environment, not in a file

Choices where the issue was silent:

- The tiers are asked in a fixed order, ``fs`` then ``s3``: a local disk answers faster than
  the network, so a block present in both is promoted from the disk.
- S3 credentials are optional (without them botocore reads the usual AWS environment and
  files). When given, they are kept out of ``repr`` and out of every error message.
- The integrity key (``[integrity] key``, or ``KVTIER_INTEGRITY_KEY``) is one setting for the
  whole stack, not per tier (a per-tier key would only add ways to get it wrong), and a
  secret: hidden from ``repr``, ``to_dict`` and every error message. ``build_tiers`` hands it
  to the FS tier and the S3 tier as ``integrity_key``; both sign with it.
- The manager section also configures the ``CostModel`` and ``AdmissionPolicy`` the manager
  makes; an application that wants more (a per-tier mapping of in-flight limits, its own
  clock) builds the manager itself. ``write_back`` and ``deferred`` must name configured
  tiers (``fs.name``, ``s3.name``): a typo would otherwise write that tier through, or forget
  its dropped writes; a tier named in both is refused (a write-back tier is never written on
  store, so it has no dropped writes to defer).
- ``manager.max_write_rate`` is one rate for every tier, in bytes per second: a number or a
  size string read per second (``"64MiB"``, also ``"64MiB/s"``). A per-tier mapping, as
  ``AdmissionPolicy`` takes, is left to applications that build the policy themselves: the
  fast local tier rarely wants a limit, and a per-tier table in the environment would be
  clumsy.
- ``build()`` refuses a ``manager.open_timeout`` not above ``s3.index_list_timeout`` when
  the S3 tier loads its index inside ``open()`` (``index_background_load = false``): the
  tier lists the bucket while it opens and, past its own bound, opens with what it has; an
  open_timeout below that would never let it open on a large bucket. With the background
  load the listing runs after the open and the rule does not apply.
  (``build_tiers()`` alone, as the vLLM adapter uses it, does not check it.)
- ``from_env`` reads ``KVTIER_CONFIG`` (a TOML file) first, then lets each ``KVTIER_<SECTION>_
  <KEY>`` variable override one value, so a container can ship a file and tweak it. Any other
  ``KVTIER_*`` variable is an error: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, TypeVar

from kvtier.common._errors import InvalidArgumentError
from kvtier.common._format import IntegrityConfig
from kvtier.common._settings import did_you_mean, parse_fields, parse_size
from kvtier.manager._config import ManagerConfig
from kvtier.pools._config import PoolConfig, build_pool
from kvtier.tiers.fs._config import FSConfig
from kvtier.tiers.s3._config import S3Config

if TYPE_CHECKING:
    from kvtier.manager import TieringManager
    from kvtier.pools._base import PrimaryPool
    from kvtier.tiers._base import SecondaryTier

__all__ = [
    "ENV_PREFIX",
    "FSConfig",
    "IntegrityConfig",
    "KVTierConfig",
    "ManagerConfig",
    "PoolConfig",
    "S3Config",
    "parse_size",
]

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG"
_T = TypeVar("_T")


# -- sections: each a component's settings object, defined beside the component --------------

_SECTIONS: dict[str, type[Any]] = {
    "pool": PoolConfig,
    "fs": FSConfig,
    "s3": S3Config,
    "manager": ManagerConfig,
    "integrity": IntegrityConfig,
}
_OPTIONAL = ("fs", "s3", "integrity")


# -- the whole configuration ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """A validated kvtier stack: ``pool`` plus optional ``fs`` and ``s3`` tiers and the
    ``manager`` settings. Build one from ``from_dict``, ``from_toml`` or ``from_env``, or
    directly from the section classes; ``build()`` makes the ``TieringManager``."""

    pool: PoolConfig
    fs: FSConfig | None = None
    s3: S3Config | None = None
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    integrity: IntegrityConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not (isinstance(value, cls) or (value is None and name in _OPTIONAL)):
                raise InvalidArgumentError(
                    f"{name} must be a {cls.__name__}, got {type(value).__name__}"
                )
        if self.fs is not None and self.s3 is not None and self.fs.name == self.s3.name:
            raise InvalidArgumentError(
                f"fs.name and s3.name must differ (metrics and logs tell tiers apart by name), "
                f"both are {self.fs.name!r}"
            )
        limit = self.manager.write_back_limit
        if limit is not None and limit >= self.pool.num_blocks:
            raise InvalidArgumentError(
                f"manager.write_back_limit ({limit}) must be below pool.num_blocks "
                f"({self.pool.num_blocks}): blocks waiting for write-back stay pinned in the pool"
            )
        names = [tier.name for tier in (self.fs, self.s3) if tier is not None]
        for key in ("write_back", "deferred"):
            for name in getattr(self.manager, key):
                if name not in names:
                    configured = ", ".join(repr(n) for n in names) or "none"
                    raise InvalidArgumentError(
                        f"manager.{key} names {name!r}, which is not a configured tier "
                        f"(configured tiers: {configured}; a tier's name is fs.name or s3.name)"
                    )
        both = [name for name in self.manager.deferred if name in self.manager.write_back]
        if both:
            raise InvalidArgumentError(
                f"manager.deferred and manager.write_back both name {both[0]!r}: a write-back "
                "tier is never written on store, so it has no dropped writes to defer; name it "
                "in one of them"
            )

    # -- constructors ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> Self:
        """Build from ``{"pool": {...}, "fs": {...}, "s3": {...}, "manager": {...}}``.

        ``source`` (a file name, say) prefixes every error message.
        """
        prefix = f"{source}: " if source else ""
        return cls._parse(data, lambda s, k: prefix + (f"{s}.{k}" if k else s), text=False)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Self:
        """Build from a TOML file with ``[pool]``, ``[fs]``, ``[s3]`` and ``[manager]`` tables."""
        where = os.fspath(path)
        return cls.from_dict(_load_toml(where), source=where)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Build from ``KVTIER_<SECTION>_<KEY>`` variables (``KVTIER_POOL_NUM_BLOCKS``,
        ``KVTIER_FS_ROOT``, ``KVTIER_S3_BUCKET``, ...), on top of the TOML file named by
        ``KVTIER_CONFIG`` when it is set."""
        env = os.environ if environ is None else environ
        base: dict[str, dict[str, Any]] = {}
        file_name = env.get(ENV_CONFIG_FILE)
        if file_name:
            raw = _load_toml(file_name)
            for name, value in raw.items():
                if name in _SECTIONS and not isinstance(value, Mapping):
                    raise InvalidArgumentError(f"{file_name}: {name} must be a table of settings")
                base[name] = dict(value) if isinstance(value, Mapping) else value
        overrides: dict[str, dict[str, Any]] = {}
        for var, value in env.items():
            if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_FILE:
                continue
            section, key = cls._env_target(var)
            overrides.setdefault(section, {})[key] = value
        if not base and not overrides:
            raise InvalidArgumentError(
                "no kvtier configuration in the environment: set KVTIER_POOL_NUM_BLOCKS and "
                "KVTIER_POOL_BLOCK_BYTES (plus KVTIER_FS_* / KVTIER_S3_* for tiers), or "
                "KVTIER_CONFIG to a TOML file"
            )

        def label(section: str, key: str | None) -> str:
            if key is None:
                return f"{ENV_PREFIX}{section.upper()}_*"
            if key in overrides.get(section, {}):
                return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"
            if file_name and key in base.get(section, {}):
                return f"{file_name}: {section}.{key}"
            return f"{section}.{key} ({ENV_PREFIX}{section.upper()}_{key.upper()})"

        # Values from the file keep their TOML types; values from variables are text.
        file_keys = {s: set(v) - set(overrides.get(s, {})) for s, v in base.items()}
        merged = {s: dict(base.get(s, {})) for s in set(base) | set(overrides)}
        for s, values in overrides.items():
            merged[s].update(values)
        return cls._parse(merged, label, text=True, typed=file_keys)

    @staticmethod
    def _env_target(var: str) -> tuple[str, str]:
        rest = var[len(ENV_PREFIX) :]
        section, _, key = rest.partition("_")
        cls = _SECTIONS.get(section.lower())
        if cls is None or not key:
            options = [f"{ENV_PREFIX}{s.upper()}_*" for s in _SECTIONS] + [ENV_CONFIG_FILE]
            raise InvalidArgumentError(
                f"unknown environment variable {var}: {did_you_mean(var, options)}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        if key.lower() not in names:
            options = [f"{ENV_PREFIX}{section.upper()}_{n.upper()}" for n in names]
            raise InvalidArgumentError(
                f"unknown environment variable {var}: {did_you_mean(var, options)}"
            )
        return section.lower(), key.lower()

    @classmethod
    def _parse(
        cls,
        data: Mapping[str, Any],
        label: Callable[[str, str | None], str],
        *,
        text: bool,
        typed: Mapping[str, set[str]] | None = None,
    ) -> Self:
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(
                f"a kvtier config must be a mapping of sections, got {type(data).__name__}"
            )
        for name in data:
            if name not in _SECTIONS:
                raise InvalidArgumentError(
                    f"unknown config section {name!r}: {did_you_mean(str(name), list(_SECTIONS))}"
                )
        if "pool" not in data:
            raise InvalidArgumentError(
                f"{label('pool', None)} is required: it sets num_blocks and block_bytes"
            )
        sections: dict[str, Any] = {}
        for name, raw in data.items():
            if not isinstance(raw, Mapping):
                raise InvalidArgumentError(
                    f"{label(name, None)} must be a table of settings, got {type(raw).__name__}"
                )
            as_text = {k for k in raw if text and k not in (typed or {}).get(name, set())}
            sections[name] = _parse_section(_SECTIONS[name], name, raw, label, as_text)
        return cls(**sections)

    # -- building --------------------------------------------------------------------------

    def build_pool(self) -> PrimaryPool:
        """The primary pool this config describes (a CudaPool needs the ``cuda`` extra)."""
        return _built("pool", build_pool, self.pool)

    def build_tiers(self) -> list[SecondaryTier]:
        """The secondary tiers, in the order the manager asks them: ``fs``, then ``s3``."""
        key = None if self.integrity is None else self.integrity.key
        tiers: list[SecondaryTier] = []
        if (fs := self.fs) is not None:
            from kvtier.tiers.fs import FSTier

            tiers.append(_built("fs", FSTier, fs.root, config=fs, integrity_key=key))
        if (s3 := self.s3) is not None:
            from kvtier.tiers.s3 import S3Tier

            tiers.append(_built("s3", S3Tier, s3.bucket, config=s3, integrity_key=key))
        return tiers

    def build(self) -> TieringManager:
        """A ``TieringManager`` over the configured pool and tiers, not yet entered: use it
        as ``async with config.build() as manager``."""
        from kvtier.manager import TieringManager

        # Checked here, not with the other rules: a config used only for build_tiers (the
        # vLLM adapter) opens its tier without the manager and this bound.
        opening, s3 = self.manager.open_timeout, self.s3
        lists_at_open = (
            s3 is not None and s3.lookup_mode == "index" and not s3.index_background_load
        )
        listing = s3.index_list_timeout if s3 is not None and lists_at_open else None
        if opening is not None and listing is not None and opening <= listing:
            raise InvalidArgumentError(
                f"manager.open_timeout ({opening:g} s) must be above s3.index_list_timeout "
                f"({listing:g} s): with s3.index_background_load = false the S3 tier lists "
                "the bucket while it opens, and a listing cut short by its own bound still "
                "opens the tier"
            )
        tiers = self.build_tiers()  # tiers first: they hold nothing until opened
        pool = self.build_pool()
        # The manager makes its cost model and admission from its section's settings.
        return TieringManager(pool, tiers, config=self.manager)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The configuration as plain data, for printing; secrets are replaced by ``"***"``."""
        out: dict[str, dict[str, Any]] = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            if section is None:
                continue
            out[name] = section.as_dict()
        return out


def _built(section: str, make: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``make(*args, **kwargs)``, its argument errors prefixed with the section's name."""
    try:
        return make(*args, **kwargs)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{section}: {exc}") from exc


def _load_toml(where: str) -> dict[str, Any]:
    try:
        with open(where, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgumentError(f"config file {where} does not exist") from None
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read config file {where}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgumentError(f"{where} is not valid TOML: {exc}") from None


def _parse_section(
    cls: type[Any],
    section: str,
    raw: Mapping[str, Any],
    label: Callable[[str, str | None], str],
    as_text: set[str],
) -> Any:
    def unknown(key: str, names: list[str]) -> Exception:
        return InvalidArgumentError(
            f"unknown key {label(section, key)}: {did_you_mean(key, names)}"
        )

    values = parse_fields(
        cls, raw, lambda key: label(section, key), as_text=as_text, unknown=unknown
    )
    for f in dataclasses.fields(cls):
        if f.name not in values and f.default is dataclasses.MISSING:
            raise InvalidArgumentError(f"{label(section, f.name)} is required")
    try:
        return cls(**values)
    except InvalidArgumentError as exc:  # a rule across keys, such as paired credentials
        where = label(section, None)
        raise InvalidArgumentError(f"{where}: {exc}") from None
