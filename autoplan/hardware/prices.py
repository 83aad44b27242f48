"""GPU-hour prices from `cost_models/prices/*.toml`, overridable on the command line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from autoplan.errors import UserError
from autoplan.paths import cost_models_dir
from autoplan.hardware.gpu import _canonical_key
from autoplan.hardware.toml import _positive, _read_toml, _require


@dataclass(frozen=True)
class PriceEntry:
    """One price: USD per GPU-hour with the date and source it was read from."""

    usd_per_gpu_hour: float
    """Price in US dollars per GPU per hour."""
    date: str
    """Date of the source."""
    source: str
    """Where the number comes from."""


@dataclass(frozen=True)
class Prices:
    """A price list (cost_models/prices/<name>.toml) plus command-line overrides."""

    name: str
    """Price list name."""
    entries: Mapping[str, PriceEntry]
    """Price per canonical GPU key (or a custom key from a hardware file)."""

    def usd_per_gpu_hour(self, key: str) -> float:
        """USD per GPU-hour for a GPU key or alias; UserError saying how to give a missing one."""
        return self.entry(key).usd_per_gpu_hour

    def entry(self, key: str) -> PriceEntry:
        """The full price entry for a GPU key or alias."""
        canonical = _canonical_key(key)
        if canonical not in self.entries:
            raise UserError(
                f"No price for GPU '{key}' in price list '{self.name}' (it has: "
                f"{', '.join(sorted(self.entries)) or 'none'}). Give one on the command line with "
                f"--price {canonical}=USD_PER_GPU_HOUR, e.g. --price {canonical}=2.50.")
        return self.entries[canonical]

    def has(self, key: str) -> bool:
        """True if a price is known for this key or alias."""
        return _canonical_key(key) in self.entries


def load_prices(overrides: Mapping[str, float] | None = None, price_list: str = "default") -> Prices:
    """Prices from cost_models/prices/<price_list>.toml, with `overrides` {gpu key or alias: USD/GPU-h}."""
    path = cost_models_dir() / "prices" / f"{price_list}.toml"
    if not path.is_file():
        lists = sorted(p.stem for p in (cost_models_dir() / "prices").glob("*.toml"))
        raise UserError(f"Unknown price list '{price_list}'; known: {', '.join(lists)}.")
    table = _read_toml(path)
    entries: dict[str, PriceEntry] = {}
    for key, item in _require(table, "prices", dict, path).items():
        where = f"{path} [prices.{key}]"
        entries[_canonical_key(key)] = PriceEntry(
            usd_per_gpu_hour=_positive(_require(item, "usd_per_gpu_hour", (int, float), where), where),
            date=str(_require(item, "date", str, where)), source=str(_require(item, "source", str, where)))
    for key, usd in (overrides or {}).items():
        if not isinstance(usd, (int, float)) or not usd > 0 or math.isinf(usd):
            raise UserError(f"Price for '{key}' must be a positive number of USD per GPU-hour, got {usd!r}.")
        entries[_canonical_key(key)] = PriceEntry(float(usd), "command line", "--price on the command line")
    return Prices(name=str(table.get("name", price_list)), entries=MappingProxyType(entries))


def parse_price_options(values: Iterable[str]) -> dict[str, float]:
    """Parse repeated `--price key=usd` options into {key: usd}; UserError on a malformed one."""
    prices: dict[str, float] = {}
    for value in values:
        key, sep, usd = value.partition("=")
        try:
            number = float(usd)
        except ValueError:
            number = float("nan")
        if not sep or not key.strip() or not number > 0 or math.isinf(number):
            raise UserError(f"--price expects GPU=USD_PER_GPU_HOUR with a positive number, e.g. "
                            f"--price h100=2.50; got '{value}'.")
        prices[key.strip().lower()] = number
    return prices
