"""Reading typed values out of parsed TOML/YAML/JSON with one-line, located errors.

Every config reader in the cost package (rate cards, workloads, bench results) goes
through these helpers so a bad file always fails the same way: one `ValueError`
subclass whose message names where (`card 'x'`, `workload`, `run 2`) and which field.
Numbers become `Decimal` without passing through binary floating point where the
parser allows it (TOML is parsed with `parse_float=Decimal`); a float that does
arrive (YAML, JSON) is converted through its shortest repr, so `0.3` stays `0.3`.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A cost config file or value is wrong; the message is one line for the user."""


def to_decimal(value: Any) -> Decimal:
    """Exact Decimal of an int, Decimal, numeric string or float (via its shortest repr)."""
    if isinstance(value, bool):  # bool is an int subclass; `true` is never a price
        raise TypeError("a boolean is not a number")
    if isinstance(value, Decimal):
        return value
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, str):
        try:
            return Decimal(value.strip())
        except InvalidOperation:
            raise TypeError(f"{value!r} is not a number") from None
    raise TypeError(f"{type(value).__name__} is not a number")


def read_mapping_file(path: Path, what: str, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """Parse a TOML (.toml), YAML (.yaml/.yml) or JSON (.json) file into a dict."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            with path.open("rb") as f:
                data = tomllib.load(f, parse_float=Decimal)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        elif suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"), parse_float=Decimal)
        else:
            raise error(f"{what} {path}: unsupported file type {suffix!r} (use .toml, .yaml or .json)")
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{what} {path}: cannot parse: {first}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {path}: top level must be a table/mapping")
    return data


class Fields:
    """A view of one mapping that reports errors as `<where>: <field> ...`.

    `prefix` names nested tables (`prices.`), so a message points at the exact key.
    """

    def __init__(self, data: Any, where: str, error: type[ConfigError] = ConfigError, prefix: str = ""):
        if not isinstance(data, Mapping):
            raise error(f"{where}: {prefix.rstrip('.') or 'value'} must be a table/mapping")
        self.data = data
        self.where = where
        self.error = error
        self.prefix = prefix

    def fail(self, message: str) -> ConfigError:
        return self.error(f"{self.where}: {message}")

    def only(self, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        for key in self.data:
            if key not in allowed:
                raise self.fail(f"unknown key '{self.prefix}{key}' (allowed: {', '.join(allowed)})")

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def sub(self, key: str) -> Fields | None:
        """The nested table under `key`, or None when absent."""
        if not self.has(key):
            return None
        return Fields(self.data[key], self.where, self.error, f"{self.prefix}{key}.")

    def raw(self, key: str) -> Any:
        if not self.has(key):
            raise self.fail(f"missing required field '{self.prefix}{key}'")
        return self.data[key]

    def text(self, key: str, default: str | None = None) -> str:
        if default is not None and not self.has(key):
            return default
        value = self.raw(key)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"'{self.prefix}{key}' must be a non-empty string, got {value!r}")
        return value

    def number(self, key: str, default: Decimal | None = None, *, min_value: Decimal | None = Decimal(0),
               max_value: Decimal | None = None, positive: bool = False) -> Decimal:
        """A Decimal field; bounds are inclusive, `positive` excludes zero."""
        if default is not None and not self.has(key):
            return default
        value = self.raw(key)
        try:
            number = to_decimal(value)
        except TypeError as exc:
            raise self.fail(f"'{self.prefix}{key}' must be a number: {exc}") from None
        if not number.is_finite():
            raise self.fail(f"'{self.prefix}{key}' must be finite, got {value!r}")
        if positive and number <= 0:
            raise self.fail(f"'{self.prefix}{key}' must be > 0, got {value}")
        if min_value is not None and number < min_value:
            raise self.fail(f"'{self.prefix}{key}' must be >= {min_value}, got {value}")
        if max_value is not None and number > max_value:
            raise self.fail(f"'{self.prefix}{key}' must be <= {max_value}, got {value}")
        return number

    def optional_number(self, key: str, **bounds: Any) -> Decimal | None:
        return self.number(key, **bounds) if self.has(key) else None

    def integer(self, key: str, *, min_value: int = 0) -> int:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, Decimal)) or value != int(value):
            raise self.fail(f"'{self.prefix}{key}' must be an integer, got {value!r}")
        if int(value) < min_value:
            raise self.fail(f"'{self.prefix}{key}' must be >= {min_value}, got {value}")
        return int(value)
