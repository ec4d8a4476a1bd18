"""The one set of value parsers and the base for every component's settings object.

A component (a pool, a tier, the manager) owns one frozen dataclass of settings, a subclass
of ``Section``: each field names its parser in its metadata (``spec``), so the name, the
default and the validation of a setting are written once, beside the component. The same
parser serves the config file, the environment and a Python caller:

- A parser takes the raw value and whether it came as text (an environment variable: ``"8"``
  may then be the integer 8, ``"none"`` nothing), and returns the normalised value or raises
  ``BadValue`` saying what it expected.
- ``Section.__post_init__`` runs every field's parser, then the cross-field rules
  (``check_rules``); an error names the setting the way a config file writes it
  (``fs.miss_ttl``). ``Section.from_keywords`` validates a Python caller's keyword
  arguments instead, naming them the way the caller wrote them (``miss_ttl``) and in Python's
  words (``True or False``, not ``true or false``), as a constructor's own check would.
- Secrets (``spec(..., secret=True)``) are never shown: not by ``repr``, not by ``as_dict``,
  not in an error message.

The plain checks of constructor arguments that are not settings are ``_arguments``'.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, ClassVar, Self

from kvtier.common._errors import InvalidArgumentError

__all__ = [
    "BadValue",
    "Parser",
    "Section",
    "check_fields",
    "choice",
    "described",
    "did_you_mean",
    "message",
    "optional",
    "parse_any_text",
    "parse_bool",
    "parse_fields",
    "parse_names",
    "parse_non_negative_int",
    "parse_non_negative_seconds",
    "parse_non_negative_size",
    "parse_path",
    "parse_positive_int",
    "parse_positive_size",
    "parse_rate",
    "parse_seconds",
    "parse_secret",
    "parse_size",
    "parse_text",
    "parse_url",
    "spec",
]


# -- value parsers ---------------------------------------------------------------------------


class BadValue(Exception):
    """A parser's refusal: what it expected, in a config file's words and, where those
    differ, in a Python caller's (``python``)."""

    def __init__(self, expected: str, python: str | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.python = expected if python is None else python


Parser = Callable[[object, bool], object]
"""``parse(value, text)``: the normalised value, or ``BadValue``. ``text``: the value came as
text (an environment variable), so ``"8"`` may stand for 8."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"1.5GB"`` or ``"4096"``.

    Raises ``InvalidArgumentError`` (a ``ValueError``) for anything else: a negative, a
    fraction of a byte, an unknown unit.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value.replace("_", "")) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise InvalidArgumentError(f"not a size in bytes: {value!r}")
    amount = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if amount != int(amount):
        raise InvalidArgumentError(f"not a whole number of bytes: {value!r}")
    return int(amount)


def _integer(value: object, text: bool, expected: str, minimum: int) -> int:
    if text and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise BadValue(expected) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadValue(expected)
    return value


def parse_positive_int(value: object, text: bool) -> int:
    return _integer(value, text, "a positive integer", 1)


def parse_non_negative_int(value: object, text: bool) -> int:
    return _integer(value, text, "an integer >= 0", 0)


def parse_positive_size(value: object, text: bool) -> int:
    """A positive number of bytes: an int or a size string (``parse_size``)."""
    return _size(value, 1, "a positive")


def parse_non_negative_size(value: object, text: bool) -> int:
    """A number of bytes, 0 included: an int or a size string (``parse_size``)."""
    return _size(value, 0, "a")


def _size(value: object, minimum: int, which: str) -> int:
    expected = f"{which} size in bytes: an integer or a string such as '64MiB' or '2GB'"
    python = f"{which} int (bytes) or a size string such as '64MiB' or '2GB'"
    try:
        size = parse_size(value)
    except ValueError:
        raise BadValue(expected, python) from None
    if size < minimum:
        raise BadValue(expected, python)
    return size


def _number_of_seconds(value: object, text: bool, *, zero_ok: bool) -> float:
    expected = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
    if text and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise BadValue(expected) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadValue(expected)
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise BadValue(expected)
    return float(value)


def parse_seconds(value: object, text: bool) -> float:
    """A positive, finite number of seconds, as a float."""
    return _number_of_seconds(value, text, zero_ok=False)


def parse_non_negative_seconds(value: object, text: bool) -> float:
    """A finite number of seconds >= 0, as a float."""
    return _number_of_seconds(value, text, zero_ok=True)


def parse_rate(value: object, text: bool) -> float:
    """Bytes per second: a positive number, or a size string (``"64MiB"``, ``"64MiB/s"``)."""
    expected = "a positive rate in bytes per second: a number or a size such as '64MiB' (/s)"
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.lower().endswith("/s"):
            stripped = stripped[:-2]
        try:
            value = float(stripped)  # a plain number may have a fraction of a byte
        except ValueError:
            try:
                value = parse_size(stripped)
            except ValueError:
                raise BadValue(expected) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadValue(expected)
    if not (math.isfinite(value) and value > 0):
        raise BadValue(expected)
    return float(value)


def parse_names(value: object, text: bool) -> tuple[str, ...]:
    """Tier names: a list (dict, TOML) or, as text, comma-separated (``"fs,s3"``)."""
    expected = "a list of tier names such as ['s3'] (in the environment: 's3' or 'fs,s3')"
    if text and isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise BadValue(expected)
    if not all(isinstance(name, str) and name.strip() for name in value):
        raise BadValue(expected)
    return tuple(dict.fromkeys(value))


def parse_text(value: object, text: bool) -> str:
    """A string with something in it."""
    if not isinstance(value, str) or not value.strip():
        raise BadValue("a non-empty string")
    return value


def parse_secret(value: object, text: bool) -> str:
    """A secret string of at least 16 bytes."""
    if not isinstance(value, str) or len(value.encode()) < 16:
        raise BadValue("a secret of at least 16 bytes (for example 64 random hex digits)")
    return value


def parse_any_text(value: object, text: bool) -> str:
    """Any string, the empty one included."""
    if not isinstance(value, str):
        raise BadValue("a string (it may be empty)")
    return value


def parse_path(value: object, text: bool) -> str:
    """A folder path: a non-empty ``str`` or ``os.PathLike`` of one, as a ``str``."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise BadValue("a folder path (a non-empty string)")
    return value


def parse_url(value: object, text: bool) -> str:
    """An ``http://`` or ``https://`` URL with a host."""
    if not isinstance(value, str) or not re.match(r"https?://[^/\s]+", value):
        raise BadValue("an http:// or https:// URL such as 'http://127.0.0.1:9000'")
    return value


def parse_bool(value: object, text: bool) -> bool:
    """A bool; as text also ``true``/``false``/``1``/``0``."""
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise BadValue("true or false", "True or False")


def choice(*options: str) -> Parser:
    """One of ``options``, compared without case or surrounding blanks."""

    def parse(value: object, text: bool) -> str:
        if isinstance(value, str) and value.strip().lower() in options:
            return value.strip().lower()
        raise BadValue("one of " + ", ".join(repr(o) for o in options), f"one of {options!r}")

    return parse


def optional(parse: Parser) -> Parser:
    """``parse``, or ``None``; as text, an empty string or ``none`` means ``None``."""

    def parse_optional(value: object, text: bool) -> object:
        if value is None or (
            text and isinstance(value, str) and value.strip().lower() in ("", "none")
        ):
            return None
        try:
            return parse(value, text)
        except BadValue as exc:
            raise BadValue(exc.expected + ", or nothing", exc.python + " or None") from None

    return parse_optional


def described(parse: Parser, expected: str, python: str | None = None) -> Parser:
    """``parse`` with its own words for what a setting expects (a unit, a purpose)."""

    def parse_described(value: object, text: bool) -> object:
        try:
            return parse(value, text)
        except BadValue:
            raise BadValue(expected, python) from None

    return parse_described


# -- settings sections -----------------------------------------------------------------------


def spec(parse: Parser, *, secret: bool = False) -> dict[str, Any]:
    """A settings field's metadata: ``field(default=..., metadata=spec(parse_seconds))``."""
    return {"parse": parse, "secret": secret}


def message(where: str, expected: str, value: object, secret: bool) -> str:
    """``<where> must be <expected>; got <value>``, hiding the value of a secret."""
    shown = "another value (hidden: it is a secret)" if secret else repr(value)
    return f"{where} must be {expected}; got {shown}"


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """The closest of ``options`` to a misspelled ``name``, then all of them."""
    options = list(options)
    close = difflib.get_close_matches(name, options, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}expected one of: {', '.join(options)}"


def check_fields(section: Section, label: Callable[[str], str], *, python: bool = False) -> None:
    """Parse every field of a section in place; raise naming the first bad one."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        try:
            parsed = f.metadata["parse"](value, False)
        except BadValue as exc:
            expected = exc.python if python else exc.expected
            raise InvalidArgumentError(
                message(label(f.name), expected, value, f.metadata["secret"])
            ) from None
        object.__setattr__(section, f.name, parsed)


def parse_fields(
    cls: type[Section],
    raw: Mapping[str, object],
    label: Callable[[str], str],
    *,
    as_text: Container[str] = (),
    python: bool = False,
    unknown: Callable[[str, list[str]], Exception],
) -> dict[str, Any]:
    """Each of ``raw``'s values through its field's parser (as text for keys in ``as_text``),
    raising for the first bad one with its ``label``; ``unknown(key, names)`` is raised for
    a key that is no field of ``cls``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    parsed: dict[str, Any] = {}
    for key, value in raw.items():
        f = fields.get(key)
        if f is None:
            raise unknown(str(key), list(fields))
        try:
            parsed[key] = f.metadata["parse"](value, key in as_text)
        except BadValue as exc:
            expected = exc.python if python else exc.expected
            raise InvalidArgumentError(
                message(label(key), expected, value, f.metadata["secret"])
            ) from None
    return parsed


def _unexpected_keyword(name: str, names: list[str]) -> TypeError:
    return TypeError(f"unexpected keyword argument {name!r}: {did_you_mean(name, names)}")


class Section:
    """What every settings dataclass shares: its name in files and in the environment
    (``SECTION``), validation when built, cross-field rules, and secrets kept hidden.

    Subclasses are ``@dataclass(frozen=True, slots=True)``; one with a secret field adds
    ``repr=False`` to use the ``__repr__`` here, which hides it.
    """

    __slots__ = ()
    SECTION: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        check_fields(self, lambda name: f"{self.SECTION}.{name}")
        self.check_rules()

    def check_rules(self) -> None:
        """Rules across settings (a pair that goes together, an order between two bounds);
        raise ``InvalidArgumentError``. Runs after every field is parsed."""

    @classmethod
    def from_keywords(cls, base: Self | None = None, /, **values: Any) -> Self:
        """``base`` (or the defaults) with a Python caller's keyword arguments, each checked
        and named the way the caller wrote it: ``miss_ttl must be ...``, not ``fs.miss_ttl``.
        An unknown keyword is a ``TypeError``, as for any function."""
        if base is not None and not isinstance(base, cls):
            raise InvalidArgumentError(
                f"config must be an instance of {cls.__name__}, got {type(base).__name__}"
            )
        parsed = parse_fields(cls, values, str, python=True, unknown=_unexpected_keyword)
        if base is not None:
            return dataclasses.replace(base, **parsed)
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields if f.name not in parsed and _required(f)]
        if missing:
            raise TypeError(f"missing keyword argument {missing[0]!r}")
        return cls(**parsed)

    def as_dict(self, *, hide_secrets: bool = True) -> dict[str, Any]:
        """The settings as plain data; a secret that is set reads ``"***"``."""
        return {
            f.name: (
                "***"
                if hide_secrets and f.metadata["secret"] and getattr(self, f.name)
                else getattr(self, f.name)
            )
            for f in dataclasses.fields(self)
        }

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}=<hidden>"
            if f.metadata["secret"] and getattr(self, f.name) is not None
            else f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.repr or f.metadata["secret"]
        )
        return f"{type(self).__name__}({shown})"


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
