"""Every config-file key reaches its component under the same name, with the same default.

Walks the loader's sections (``kvtier.manager._stack_config._SECTIONS``), so a section or a key
added there is covered without touching this file. For each key it builds the stack from a config
that leaves the key out and checks the component's effective setting is the section's
default, then builds it with a valid non-default value and checks the component got that.

Where a setting is used is read in this order: a probe below that reads it where the
component uses it (``EFFECTIVE``), else the component's own settings object
(``component.config``, an instance of the section's class), else a public attribute of the
component under the same name. A key none of these reach is an error, unless it is listed
in ``UNCHECKED`` with the reason, or its section in ``PENDING``.

Also: the parsers and the ``Section`` base (``kvtier.common._settings``), and ``FSTier``'s keyword
arguments (the same names, defaults and checks as ``[fs]``).
"""

from __future__ import annotations

import ast
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

import pytest

from kvtier import (
    IntegrityConfig,
    IntegrityKey,
    InvalidArgumentError,
    KVTierConfig,
    PoolConfig,
    PrimaryPool,
)
from kvtier.common._arguments import positive_int
from kvtier.common._format import MIN_SECRET_BYTES
from kvtier.common._settings import (
    BadValue,
    Section,
    choice,
    optional,
    parse_bool,
    parse_positive_int,
    parse_positive_size,
    parse_rate,
    parse_seconds,
    spec,
)
from kvtier.manager._stack_config import _SECTIONS
from kvtier.tiers.fs import FSConfig, FSTier
from kvtier.tiers.fs._config import FSOverrides

SECRET = "0123456789abcdef-an-integrity-secret"

# The keys each section cannot do without, so that a stack builds at all.
REQUIRED: dict[str, dict[str, Any]] = {
    "pool": {"num_blocks": 8, "block_bytes": 4096},
    "fs": {"root": "<tmp>/fs"},
    "s3": {"bucket": "kv-cache"},
    "integrity": {"key": SECRET},
}


def _tier(config: KVTierConfig, name: str) -> Any:
    (tier,) = (t for t in config.build_tiers() if t.name == name)
    return tier


# How to build the component a section configures, from a whole config.
COMPONENT: dict[str, Callable[[KVTierConfig], Any]] = {
    "pool": lambda config: config.build_pool(),
    "fs": lambda config: _tier(config, config.fs.name if config.fs else "fs"),
    "s3": lambda config: _tier(config, config.s3.name if config.s3 else "s3"),
    "manager": lambda config: config.build(),
    "integrity": lambda config: config.build_tiers(),  # every tier signs with the key
}


def _pool_kind(pool: PrimaryPool) -> str:
    return type(pool).__name__.removesuffix("Pool").lower()


def _key_ids(tiers: list[Any]) -> set[str | None]:
    return {None if t.integrity_key is None else t.integrity_key.key_id for t in tiers}


def _credential(key: str) -> Callable[[Any], Any]:
    return lambda tier: tier._credentials().get(key)


# Probes that read a setting where the component uses it: (section, key) -> (probe, expect),
# where ``expect`` turns the section's value into what the probe returns.
_same: Callable[[Any], Any] = lambda value: value  # noqa: E731
EFFECTIVE: dict[tuple[str, str], tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    ("pool", "num_blocks"): (lambda pool: pool.num_blocks, _same),
    ("pool", "block_bytes"): (lambda pool: pool.block_bytes, _same),
    ("pool", "policy"): (lambda pool: pool.statistics().policy, _same),
    ("pool", "kind"): (_pool_kind, _same),
    ("fs", "root"): (lambda t: t._files.root, lambda v: Path(os.path.abspath(v))),
    ("fs", "name"): (lambda t: t.name, _same),
    ("fs", "capacity_bytes"): (lambda t: t._catalog.capacity_bytes, _same),
    ("fs", "fsync"): (lambda t: t._files.fsync, _same),
    ("fs", "miss_ttl"): (lambda t: t._lookups._miss_ttl, _same),
    ("fs", "lookup_batch_size"): (lambda t: t._lookups._batch_size, _same),
    ("fs", "lookup_timeout"): (lambda t: t._lookups._timeout, _same),
    ("fs", "max_concurrency"): (lambda t: t._files.max_concurrency, _same),
    ("fs", "max_write_concurrency"): (lambda t: t._files.max_write_concurrency, _same),
    ("fs", "max_stuck_threads"): (lambda t: t._files.calls.max_abandoned, _same),
    ("fs", "direct_io"): (lambda t: t.direct_io, _same),
    ("integrity", "key"): (_key_ids, lambda v: {IntegrityKey(v).key_id}),
    # S3Tier keeps its credentials out of its config (and of every repr) in a closure.
    **{
        ("s3", key): (_credential(key), _same)
        for key in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    },
}

# Keys that cannot be checked here, and why.
UNCHECKED: dict[tuple[str, str], str] = {
    ("pool", "device"): "only a cuda pool has a device, and a cuda pool needs a GPU and cupy",
}
# A non-default value that cannot be built here (the default is still checked).
UNCHECKED_VALUE: dict[tuple[str, str], str] = {
    ("pool", "kind"): "a cuda pool needs a GPU and the cuda extra (cupy)",
}

# Sections whose component does not hold its settings object yet, and why (none now: every
# component takes its section's object as ``config``).
PENDING: dict[str, str] = {}

# Values to try first for a key where the generic candidates do not fit.
VALUES: dict[tuple[str, str], list[Any]] = {
    ("manager", "write_back"): [["s3"]],
    ("manager", "deferred"): [["s3"]],
    ("s3", "lookup_mode"): ["ask"],
}
# Keys that only validate together with others (a rule across keys).
COMPANIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("s3", "aws_access_key_id"): {"aws_secret_access_key": "a-secret-access-key"},
    ("s3", "aws_secret_access_key"): {"aws_access_key_id": "AKIDEXAMPLE"},
    ("s3", "aws_session_token"): {
        "aws_access_key_id": "AKIDEXAMPLE",
        "aws_secret_access_key": "a-secret-access-key",
    },
}


def _keys(*, with_default: bool) -> list[Any]:
    params = []
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            has_default = f.default is not dataclasses.MISSING
            if with_default and not has_default:
                continue
            params.append(pytest.param(section, f.name, id=f"{section}.{f.name}"))
    return params


def _base(tmp_path: Path) -> dict[str, dict[str, Any]]:
    data = {s: dict(v) for s, v in REQUIRED.items() if s in _SECTIONS}
    data["fs"]["root"] = str(tmp_path / "fs")
    return data


def _reach(section: str, key: str, component: Any) -> tuple[Any, Callable[[Any], Any]]:
    """What ``component`` uses for ``section.key``, and how to express the expected value."""
    if (section, key) in UNCHECKED:
        pytest.skip(UNCHECKED[(section, key)])
    if (section, key) in EFFECTIVE:
        probe, expect = EFFECTIVE[(section, key)]
        return probe(component), expect
    held = getattr(component, "config", None)
    if isinstance(held, _SECTIONS[section]):
        return getattr(held, key), _same
    if key in vars(type(component)) or key in getattr(component, "__dict__", {}):
        return getattr(component, key), _same
    if section in PENDING:
        pytest.skip(PENDING[section])
    pytest.fail(
        f"{section}.{key} reaches no component: give {type(component).__name__} a `config` "
        f"({_SECTIONS[section].__name__}), a probe in EFFECTIVE, or a reason in UNCHECKED"
    )


def test_every_section_is_known_here() -> None:
    assert set(_SECTIONS) <= set(COMPONENT), "add how to build the new section's component"
    for section, cls in _SECTIONS.items():
        assert issubclass(cls, Section) and section == cls.SECTION
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        assert required <= set(REQUIRED.get(section, {})), f"add {section}'s required keys"


@pytest.mark.parametrize(("section", "key"), _keys(with_default=True))
def test_default_reaches_the_component(section: str, key: str, tmp_path: Path) -> None:
    config = KVTierConfig.from_dict(_base(tmp_path))
    default = _SECTIONS[section].__dataclass_fields__[key].default
    assert getattr(getattr(config, section), key) == default
    actual, expect = _reach(section, key, COMPONENT[section](config))
    assert actual == expect(default), f"{section}.{key}: {actual!r} != default {default!r}"


def _candidates(section: str, key: str) -> list[Any]:
    """Values to try, first those in ``VALUES``, then some from the field's type."""
    f = _SECTIONS[section].__dataclass_fields__[key]
    kind = str(get_type_hints(_SECTIONS[section])[key])
    default = f.default if f.default is not dataclasses.MISSING else None
    found: list[Any] = list(VALUES.get((section, key), []))
    try:
        f.metadata["parse"](object(), False)
    except BadValue as exc:  # a choice names its options in Python's words: one of (...)
        if exc.python.startswith("one of ("):
            found += list(ast.literal_eval(exc.python.removeprefix("one of ").split(")")[0] + ")"))
    if "bool" in kind:
        found.append(not default)
    if "int" in kind:
        found += [default * 2 if isinstance(default, int) else 3, 3, 1 << 20]
    if "float" in kind:
        if isinstance(default, float):
            found += [default / 2, default * 2]
        found += [3.0, 7.5]
    if "str" in kind:
        found += ["custom-name", "http://127.0.0.1:9999", SECRET[::-1]]
    return found


@pytest.mark.parametrize(("section", "key"), _keys(with_default=False))
def test_a_set_value_reaches_the_component(section: str, key: str, tmp_path: Path) -> None:
    if (section, key) in UNCHECKED_VALUE:
        pytest.skip(UNCHECKED_VALUE[(section, key)])
    data = _base(tmp_path)
    default = data.get(section, {}).get(key, _SECTIONS[section].__dataclass_fields__[key].default)
    tried = []
    for value in _candidates(section, key):
        settings = {**data.get(section, {}), **COMPANIONS.get((section, key), {}), key: value}
        try:
            config = KVTierConfig.from_dict({**data, section: settings})
            component = COMPONENT[section](config)
        except InvalidArgumentError as exc:
            tried.append(f"{value!r}: {exc}")
            continue
        parsed = getattr(getattr(config, section), key)
        if parsed == default:
            continue
        actual, expect = _reach(section, key, component)
        assert actual == expect(parsed), f"{section}.{key}: {actual!r} != set {parsed!r}"
        return
    pytest.fail(f"no valid non-default value for {section}.{key}; add one to VALUES: {tried}")


# -- FSTier's keyword arguments are [fs]'s keys ------------------------------------------------

FS_KEYS = [f.name for f in dataclasses.fields(FSConfig) if f.name != "root"]


def test_fstier_keywords_are_the_fs_keys() -> None:
    assert set(FSOverrides.__annotations__) == set(FS_KEYS)
    hints = get_type_hints(FSConfig)
    assert get_type_hints(FSOverrides) == {k: hints[k] for k in FS_KEYS}


def test_fstier_defaults_are_fsconfig_defaults(tmp_path: Path) -> None:
    assert FSTier(tmp_path).config == FSConfig(root=str(tmp_path))


@pytest.mark.parametrize("key", FS_KEYS)
def test_fstier_keyword_and_config_agree(key: str, tmp_path: Path) -> None:
    for value in _candidates("fs", key):
        try:
            expected = FSConfig(root=str(tmp_path), **{key: value})
        except InvalidArgumentError:
            continue
        if getattr(expected, key) == FSConfig.__dataclass_fields__[key].default:
            continue
        assert FSTier(tmp_path, **{key: value}).config == expected
        from_config = FSTier(tmp_path, config=expected)
        assert from_config.config == expected
        assert FSTier(tmp_path, config=expected, name="other").config.name == "other"
        return
    pytest.fail(f"no valid non-default value for fs.{key}")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"miss_ttl": float("inf")}, "miss_ttl must be a positive number of seconds"),
        ({"capacity_bytes": "lots"}, "capacity_bytes must be a positive int (bytes)"),
        ({"fsync": "DATA "}, None),  # the file's forgiving spelling holds for a caller too
        ({"capacity_bytes": "1GiB"}, None),
        ({"direct_io": 1}, "direct_io must be True (O_DIRECT"),
    ],
)
def test_fstier_checks_keywords_in_a_callers_words(
    kwargs: dict[str, Any], words: str | None, tmp_path: Path
) -> None:
    if words is None:
        FSTier(tmp_path, **kwargs)
        return
    with pytest.raises(InvalidArgumentError) as info:
        FSTier(tmp_path, **kwargs)
    assert str(info.value).startswith(words)


def test_fstier_refuses_unknown_keywords_and_configs(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="did you mean 'fsync'"):
        FSTier(tmp_path, fsnyc="never")  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match="config must be an instance of FSConfig"):
        FSTier(tmp_path, config={"fsync": "never"})  # type: ignore[arg-type]


# -- the parsers and the Section base ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class _Example(Section):
    SECTION: ClassVar[str] = "example"

    size: int = dataclasses.field(metadata=spec(parse_positive_size))
    low: float = dataclasses.field(default=1.0, metadata=spec(parse_seconds))
    high: float = dataclasses.field(default=2.0, metadata=spec(parse_seconds))
    mode: str = dataclasses.field(default="a", metadata=spec(choice("a", "b")))
    flag: bool = dataclasses.field(default=False, metadata=spec(parse_bool))
    rate: float | None = dataclasses.field(default=None, metadata=spec(optional(parse_rate)))
    token: int | None = dataclasses.field(
        default=None, repr=False, metadata=spec(optional(parse_positive_int), secret=True)
    )

    def check_rules(self) -> None:
        if self.low > self.high:
            raise InvalidArgumentError("example.low must not be above example.high")


def test_section_parses_validates_and_hides_secrets() -> None:
    example = _Example(size="4KiB", mode=" B", rate="1MiB/s", token=7)  # type: ignore[arg-type]
    assert (example.size, example.mode, example.rate) == (4096, "b", float(1 << 20))
    with pytest.raises(InvalidArgumentError, match=r"^example\.size must be a positive size"):
        _Example(size=0)
    with pytest.raises(InvalidArgumentError, match="must not be above"):
        _Example(size=1, low=3.0)
    with pytest.raises(InvalidArgumentError) as info:
        _Example(size=1, token="-5")  # type: ignore[arg-type]
    assert "-5" not in str(info.value) and "hidden" in str(info.value)
    shown = repr(_Example(size=1, token=12345))
    assert "12345" not in shown and "token=<hidden>" in shown and "size=1" in shown
    assert _Example(size=1, token=12345).as_dict()["token"] == "***"
    assert _Example(size=1).as_dict()["token"] is None


def test_from_keywords_names_the_keyword_in_pythons_words() -> None:
    base = _Example(size=1)
    assert _Example.from_keywords(base, flag=True) == dataclasses.replace(base, flag=True)
    assert _Example.from_keywords(size="1KiB").size == 1024
    with pytest.raises(InvalidArgumentError, match=r"^flag must be True or False; got 'yes'"):
        _Example.from_keywords(base, flag="yes")
    with pytest.raises(InvalidArgumentError, match=r"^mode must be one of \('a', 'b'\)"):
        _Example.from_keywords(base, mode="c")
    with pytest.raises(InvalidArgumentError, match=r"^rate must be .* or None; got 0"):
        _Example.from_keywords(base, rate=0)
    with pytest.raises(TypeError, match="did you mean 'mode'"):
        _Example.from_keywords(base, mdoe="a")
    with pytest.raises(TypeError, match="missing keyword argument 'size'"):
        _Example.from_keywords()
    with pytest.raises(InvalidArgumentError, match="must not be above"):
        _Example.from_keywords(base, low=5.0)


@pytest.mark.parametrize(
    ("parse", "raw", "text", "parsed"),
    [
        (parse_positive_int, "8", True, 8),
        (parse_bool, "1", True, True),
        (parse_bool, "False", True, False),
        (optional(parse_seconds), "none", True, None),
        (optional(parse_seconds), "", True, None),
        (parse_rate, "1 GB/s", False, 1e9),
    ],
)
def test_parsers_read_text_from_the_environment(
    parse: Callable[[object, bool], object], raw: object, text: bool, parsed: object
) -> None:
    assert parse(raw, text) == parsed


@pytest.mark.parametrize(
    ("parse", "raw"),
    [(parse_positive_int, "8"), (parse_bool, "true"), (parse_seconds, "1.5")],
)
def test_parsers_take_text_only_from_the_environment(
    parse: Callable[[object, bool], object], raw: object
) -> None:
    with pytest.raises(BadValue):
        parse(raw, False)


def test_one_secret_rule_for_the_integrity_key() -> None:
    short = "x" * (MIN_SECRET_BYTES - 1)
    with pytest.raises(InvalidArgumentError, match="at least 16 bytes"):
        IntegrityConfig(key=short)
    with pytest.raises(InvalidArgumentError, match="at least 16 bytes"):
        IntegrityKey(short)
    assert repr(IntegrityConfig(key=SECRET)) == "IntegrityConfig(key=<hidden>)"


def test_pool_defaults_are_the_pools_defaults() -> None:
    """``PoolConfig``'s defaults are those the pool classes take when left out."""
    import inspect

    from kvtier.pools._host import HostPool

    CudaPool = pytest.importorskip("kvtier.pools._cuda").CudaPool

    config = PoolConfig(num_blocks=1, block_bytes=1)
    assert config.policy == inspect.signature(HostPool).parameters["policy"].default
    assert config.policy == inspect.signature(CudaPool).parameters["policy"].default
    assert config.device == inspect.signature(CudaPool).parameters["device"].default


def test_plain_argument_checks() -> None:
    assert positive_int(3, "n") == 3
    with pytest.raises(InvalidArgumentError, match="n must be a positive int, got 0"):
        positive_int(0, "n")
