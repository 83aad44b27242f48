"""Number formatting shared by the terminal, Markdown and HTML reports (also jinja2 filters)."""

from __future__ import annotations

from typing import Any

DAY_S = 86400.0
HOUR_S = 3600.0


def duration(seconds: float | None) -> str:
    """'12.3 days', '5.2 h', '42 min', '3.1 s'; 'never' for an unbounded time."""
    if seconds is None:
        return "never"
    if seconds >= 2 * DAY_S:
        return f"{seconds / DAY_S:,.1f} days"
    if seconds >= 2 * HOUR_S:
        return f"{seconds / HOUR_S:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.3g} s"


def usd(value: float | None) -> str:
    """'$1.23M', '$45.6k', '$789'."""
    if value is None:
        return "-"
    if value >= 1e6:
        return f"${value / 1e6:,.2f}M"
    if value >= 1e4:
        return f"${value / 1e3:,.1f}k"
    return f"${value:,.0f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def count(value: float | None) -> str:
    """'1.2M', '45.6k', '789' (GPU-hours, tokens/s)."""
    if value is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= div:
            return f"{value / div:,.1f}{suffix}"
    return f"{value:,.0f}"


def time_range(pair: list[float | None] | None) -> str:
    if not pair or pair[0] is None:
        return "-"
    return f"{duration(pair[0])} – {duration(pair[1])}"


def usd_range(pair: list[float | None] | None) -> str:
    if not pair or pair[0] is None:
        return "-"
    return f"{usd(pair[0])} – {usd(pair[1])}"


def degrees(config: dict[str, Any]) -> str:
    """'dp=8 tp=2 pp=4' with only the degrees above 1 (dp always)."""
    parts = [f"dp={config['dp']}"] + [f"{k}={config[k]}" for k in ("tp", "pp", "cp", "ep") if config[k] > 1]
    return " ".join(parts)


def setup(config: dict[str, Any]) -> str:
    """ZeRO, offload, micro-batch and schedule of a plan in one short phrase."""
    text = f"ZeRO-{config['zero_stage']}, mb {config['micro_batch']}"
    if config["offload"] != "none":
        text += f", offload {config['offload']}"
    if config["pp"] > 1:
        text += f", {config['schedule']}" + (f" v{config['vpp']}" if config["vpp"] > 1 else "")
    return text


FILTERS = {"duration": duration, "usd": usd, "pct": pct, "count": count, "time_range": time_range,
           "usd_range": usd_range, "degrees": degrees, "setup": setup}
