"""The arguments of `autoplan report`: token counts, GPU counts and names, prices and positive
numbers, each a UserError naming the fix. Imports no torch: the command checks them before
the sweep's planner is imported."""

from __future__ import annotations

import math
import re

from autoplan.errors import UserError
from autoplan.hardware import load_gpu
from autoplan.limits import MAX_GPUS, check_at_most

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_tokens(text: str) -> int:
    """'2T', '300B', '1.5e12', '500M', '2,000,000' -> tokens; UserError if not a positive number."""
    match = re.fullmatch(r"\s*([0-9][0-9_,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(text), re.I)
    value = float(match.group(1).replace(",", "").replace("_", "")) * _SUFFIX[match.group(2).lower()] \
        if match else float("nan")
    if not value >= 1 or math.isinf(value):
        raise UserError(f"--tokens must be a positive number of training tokens, e.g. 2T, 300B, 1.5e12 "
                        f"or 500M; got '{text}'.")
    return int(round(value))


def parse_counts(text: str) -> list[int]:
    """'64,128,256' -> [64, 128, 256]; UserError unless every item is a positive integer."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        raise UserError(f"--gpus expects positive GPU counts separated by commas, e.g. --gpus 64,128,256; "
                        f"got '{text}'.")
    for item in items:
        check_at_most("--gpus", int(item), MAX_GPUS)
    return sorted(set(int(s) for s in items))


def parse_gpus(text: str) -> list:
    """'h100,a100-sxm4-80gb' -> [GPU, ...] in the given order (UserError on an unknown name)."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    if not names:
        raise UserError("--gpu expects GPU names separated by commas, e.g. --gpu h100,a100-sxm4-80gb "
                        "(see `autoplan gpus`).")
    gpus = {}
    for name in names:
        gpu = load_gpu(name)
        gpus.setdefault(gpu.key, gpu)
    return list(gpus.values())


def gpu_prices(gpus: list, prices) -> dict[str, float]:
    """{gpu key: USD per GPU-hour}; one UserError naming every GPU without a price and how to give it."""
    missing = [g.key for g in gpus if not prices.has(g.key)]
    if missing:
        raise UserError(
            f"No price for {', '.join(missing)} in price list '{prices.name}' (it has: "
            f"{', '.join(sorted(prices.entries)) or 'none'}). Give each on the command line, e.g. "
            + " ".join(f"--price {k}=USD_PER_GPU_HOUR" for k in missing) + ".")
    return {g.key: prices.usd_per_gpu_hour(g.key) for g in gpus}


def check_positive(name: str, value) -> None:
    if value is None or not value > 0:
        raise UserError(f"{name} must be positive, got {value}.")
