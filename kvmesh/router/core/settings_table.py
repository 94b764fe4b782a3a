"""One row per setting: the flag, the environment variable and the config-file key come from it.

A settings dataclass (``RouterConfig``, ``MeshSettings``) keeps its typed fields and defaults; next
to it a tuple of :class:`Setting` rows says, for each field, how a user spells it on the command
line, in the environment and in a TOML file, what type and range it takes and what ``--help``
says. Every loader walks the rows, so a new field cannot be settable in one place and not in
another, and a range is checked the same way whichever source the value came from.

Pure: parsing and checking only, no I/O. Each error is a :class:`ConfigError` that names the
spelling the user wrote (the flag, the variable or ``file: key``) and the allowed range.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import ConfigError

Convert = Callable[[Any, str], Any]
"""Called with a parsed value and the name the user wrote; returns the stored value or raises
ConfigError (URL normalisation, endpoint checks, worker lists)."""

_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off"))
_NONE = frozenset(("none", "off", "null", ""))


@dataclass(frozen=True)
class Setting:
    """How one dataclass field is spelled and bounded in every source.

    ``kind`` is bool, int, float, str or list. A list is given as a repeatable flag, a
    comma-separated variable or a TOML array. ``optional`` allows None (a number given as
    ``none``/``off`` turns the feature off). ``default`` is filled from the dataclass by
    :func:`bind_defaults`; ``shown`` replaces it in ``--help`` when the value alone would mislead.
    """

    field: str
    flag: str | None  # None: not on the command line (an embedded engine's own identity)
    env: str | None
    key: str | None  # the TOML key
    kind: type
    help: str
    low: float | None = None  # inclusive unless low_open
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    aliases: tuple[str, ...] = ()  # more flag spellings
    key_aliases: tuple[str, ...] = ()  # more TOML spellings
    metavar: str | None = None
    convert: Convert | None = None
    shown: str | None = None
    default: Any = None

    @property
    def name(self) -> str:
        """The spelling named when a value fails the check, whatever its source."""
        return self.flag or self.env or self.key or self.field

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.key_aliases) if self.key else self.key_aliases

    def parse(self, value: Any, name: str) -> Any:
        """Text (flag, variable) or a TOML value -> the typed value; ConfigError naming ``name``."""
        if value is None or (self.optional and self.kind in (int, float) and _is_none_text(value)):
            if self.optional:
                return None
            raise ConfigError(f"{name} needs a value")
        if self.kind is bool:
            parsed: Any = _parse_bool(name, value)
        elif self.kind is int:
            parsed = _parse_int(name, value)
        elif self.kind is float:
            parsed = _parse_float(name, value)
        elif self.kind is list:
            parsed = _parse_list(name, value)
        elif self.choices:
            parsed = str(value).strip().lower()
        elif isinstance(value, str):
            parsed = value
        else:
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return self.convert(parsed, name) if self.convert is not None else parsed

    def problem(self, value: Any) -> str | None:
        """Why a typed value is out of range (None when it is fine)."""
        if value is None and self.optional:
            return None
        if self.choices:
            return None if value in self.choices else f"must be one of {', '.join(self.choices)}"
        if self.kind is bool:
            return None if isinstance(value, bool) else "must be true or false"
        if self.kind is str:
            return None if isinstance(value, str) else "must be a string"
        if self.kind is list:
            return None  # ``convert`` checks the items
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        if self.kind is int and not isinstance(value, int):
            return "must be an integer"
        if not math.isfinite(value):
            return "must be finite"
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or value <= self.high
        return None if low_ok and high_ok else f"must be {self._range()}"

    def coerce(self, value: Any, name: str) -> Any:
        """``parse`` then ``problem``: a value ready for the dataclass, or ConfigError naming ``name``."""
        parsed = self.parse(value, name)
        problem = self.problem(parsed)
        if problem:
            raise ConfigError(f"{name} {problem}, got {value!r}")
        return parsed

    def _range(self) -> str:
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            return f"in {left}{_fmt(self.low)}, {_fmt(self.high)}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_fmt(self.low)}"
        return f"<= {_fmt(self.high or 0)}"


def bind_defaults(cls: type, rows: Iterable[Setting], *, exclude: Iterable[str] = ()) -> tuple[Setting, ...]:
    """The rows with ``default`` read from the dataclass, after checking that every field (but
    ``exclude``) has exactly one row: a field without a row could not be set from outside."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = tuple(rows)
    named = [r.field for r in rows]
    missing = set(fields) - set(exclude) - set(named)
    extra = set(named) - set(fields)
    if missing or extra or len(named) != len(set(named)):
        raise TypeError(f"{cls.__name__} settings table: missing {sorted(missing)}, unknown {sorted(extra)}")
    return tuple(dataclasses.replace(r, default=_default_of(fields[r.field])) for r in rows)


def check_all(obj: Any, rows: Iterable[Setting]) -> None:
    """Raise ConfigError naming the first field of ``obj`` whose value is out of its row's range."""
    for row in rows:
        value = getattr(obj, row.field)
        problem = row.problem(value)
        if problem:
            raise ConfigError(f"{row.name} {problem}, got {value!r}")


def key_index(rows: Iterable[Setting]) -> dict[str, Setting]:
    """TOML key (dashes and case folded) -> row."""
    index: dict[str, Setting] = {}
    for row in rows:
        for key in row.keys:
            index[normal_key(key)] = row
    return index


def normal_key(key: str) -> str:
    return key.replace("-", "_").lower()


def add_arguments(target: Any, rows: Iterable[Setting]) -> None:
    """One argparse option per row with a flag; its help ends with the default in brackets.

    Values stay text (``default=None`` means "not given") so that the rows parse them and the
    message names the flag, as for every other source."""
    for row in rows:
        if row.flag is None:
            continue
        help_text = f"{row.help} [{_shown(row)}]"
        names = [row.flag, *row.aliases]
        if row.kind is bool:
            target.add_argument(
                *names, dest=row.field, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            target.add_argument(
                *names,
                dest=row.field,
                default=None,
                metavar=row.metavar,
                action="append" if row.kind is list else "store",
                help=help_text,
            )


def _shown(row: Setting) -> str:
    if row.shown is not None:
        return row.shown
    if row.default is None:
        return "off"
    if isinstance(row.default, (tuple, list)):
        return ",".join(map(str, row.default)) or "none"
    return str(row.default)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _is_none_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in _NONE


def _parse_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None


def _parse_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _parse_list(name: str, value: Any) -> list[Any]:
    """``"a,b"`` (a variable), ``["a", "b,c"]`` (a repeated flag) or a TOML array -> items;
    text items are split at commas, other items (TOML tables) are kept for ``convert``."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    items: list[Any] = []
    for item in value:
        if isinstance(item, str):
            items.extend(x.strip() for x in item.split(",") if x.strip())
        else:
            items.append(item)
    return items


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
