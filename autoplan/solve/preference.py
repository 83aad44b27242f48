"""Among plans the cost model cannot tell apart, the one with the fewest unvalidated mechanisms.

Two predicted step times that differ by less than the model's error do not say which plan is
faster. The band is the median |predicted / measured - 1| of tokens/s per GPU over the
published runs of the runtime family the plan's job runs on, autoplan's own FSDP2/DTensor
runtime: the torchtitan family (cost_models/validation/accuracy_summary.json, `by_family`,
written by `python -m autoplan.report.accuracy`): half of its validated predictions are off by
more.
Within the band of the fastest plan the search prefers a plan without CPU offload, then the
one with the fewest of `MECHANISMS`, then the faster one; the fastest plan's time stays proven
and is reported.
"""

from __future__ import annotations

import json

from autoplan.config import ParallelConfig
from autoplan.paths import cost_models_dir

# What a plan may use that no run of cost_models/validation/published_runs.json uses (CPU
# offload, the zero-bubble and GPipe schedules: the runs are 1F1B or interleaved 1F1B), or an
# axis a plan can do without (context and expert parallelism: 5 and 20 of the 110 runs).
MECHANISMS = {
    "CPU offload": lambda c: c.offload != "none",
    "zero-bubble schedule": lambda c: c.schedule == "zero-bubble",
    "GPipe schedule": lambda c: c.schedule == "gpipe",
    "context parallelism": lambda c: c.cp > 1,
    "expert parallelism": lambda c: c.ep > 1,
}


def mechanisms(config: ParallelConfig) -> tuple[str, ...]:
    """The `MECHANISMS` a configuration uses."""
    return tuple(name for name, uses in MECHANISMS.items() if uses(config))


def _summary() -> dict | None:
    path = cost_models_dir() / "validation" / "accuracy_summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def equivalence_band_family() -> str:
    """The runtime family whose measured error is the band ("" when no summary exists)."""
    data = _summary()
    return str(data["autoplan_runtime_family"]) if data else ""


def equivalence_band() -> float:
    """Relative step-time difference the cost model does not resolve: its median |error| over
    the published runs of autoplan's runtime family; 0 (no preference) when no summary exists."""
    data = _summary()
    if data is None:
        return 0.0
    return float(data["by_family"][data["autoplan_runtime_family"]]["median_abs_rel_error"])


def within_band(step_s: float, fastest_s: float, band: float) -> bool:
    return step_s <= fastest_s * (1.0 + band)


def preference_key(step_s: float, config: ParallelConfig) -> tuple:
    """Order inside the band: no CPU offload first, then fewer mechanisms, then the faster plan.
    Offload goes first because it also holds a node's host memory and CPUs and its cost rests on
    the least measured numbers (cost/offload.py: an assumed host DRAM share, CPU AdamW measured
    on another machine), so a plan without it is taken whenever one is within the band."""
    return (config.offload != "none", len(mechanisms(config)), step_s)
