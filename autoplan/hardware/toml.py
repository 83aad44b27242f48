"""Reading and writing the hardware TOML files: typed, positive, every number with its source."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Mapping

from autoplan.errors import UserError
from autoplan.textfile import read_text


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_text(path, "hardware file"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path} is not valid TOML: {exc}. See cost_models/README.md for the format.") from None


def _require(table: Mapping[str, Any], key: str, kind: Any, where: str | Path) -> Any:
    if key not in table:
        raise UserError(f"{where}: required key '{key}' is missing (format: cost_models/README.md).")
    value = table[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise UserError(f"{where}: key '{key}' has the wrong type ({type(value).__name__}: {value!r}).")
    return value


def _positive(value: float, where: str, allow_zero: bool = False) -> float:
    if not (value >= 0 if allow_zero else value > 0) or math.isinf(value):
        raise UserError(f"{where} must be a {'non-negative' if allow_zero else 'positive'} number, got {value}.")
    return value


def _number(table: Mapping[str, Any], key: str, where: str, allow_zero: bool = False) -> float:
    return _positive(_require(table, key, (int, float), where), f"{where}: '{key}'", allow_zero)


def _integer(table: Mapping[str, Any], key: str, where: str) -> int:
    return int(_positive(_require(table, key, int, where), f"{where}: '{key}'"))


def _curve(table: Mapping[str, Any], key: str, where: str, length: int | None = None) -> tuple[float, ...]:
    values = _require(table, key, list, where)
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
        raise UserError(f"{where}: '{key}' must be a non-empty list of positive numbers, got {values!r}.")
    if length is not None and len(values) != length:
        raise UserError(f"{where}: '{key}' has {len(values)} points but its x axis has {length}.")
    return tuple(float(v) for v in values)


def _check_sources(table: Mapping[str, Any], where: str) -> dict[str, str]:
    """Every number (or list of numbers) needs a non-empty [sources] entry under its dotted key."""
    sources = table.get("sources", {})
    if not isinstance(sources, dict):
        raise UserError(f"{where}: 'sources' must be a table of dotted key = \"source\".")
    for dotted in _numeric_keys(table):
        text = sources.get(dotted)
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: the number '{dotted}' has no source. Add [sources] \"{dotted}\" = "
                            f"\"where it comes from\" (a datasheet, a paper, or 'measured <date> with <tool>').")
    return dict(sources)


def _numeric_keys(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        if key in ("sources", "gpu"):
            continue
        if isinstance(value, dict):
            keys += _numeric_keys(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float, list)) and not isinstance(value, bool) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            keys.append(prefix + key)
    return keys


def _clean_number(value: float) -> float | int:
    """Round-off noise from unit conversion removed (12 significant digits), ints kept as ints."""
    if isinstance(value, int):
        return value
    rounded = float(f"{value:.12g}")
    return int(rounded) if rounded.is_integer() and abs(rounded) < 2**53 else rounded


def _dump_toml(table: Mapping[str, Any], prefix: str = "") -> str:
    """Minimal TOML writer for str/int/float/bool/list scalars and nested tables (no new dependency)."""
    scalars = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    parts = ["\n".join(scalars)] if scalars else []
    for key, value in table.items():
        if isinstance(value, dict):
            name = f"{prefix}{_toml_key(key)}"
            parts.append(f"[{name}]\n" + _dump_toml(value, name + ".").rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def _toml_key(key: str) -> str:
    return key if key and all(ch.isalnum() or ch in "_-" for ch in key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value} to a hardware file")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
