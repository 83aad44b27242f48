"""A hardware file fitted to the runs `tune` measured, for the next `plan` on this cluster.

One factor, k = median over the measured candidates of predicted / measured step time, scales
the GPU's achieved fractions of its datasheet peaks (matmul at every size, HBM, attention):
k < 1 when the runs were slower than predicted. It attributes every difference to the device,
not to the network, so it is a correction for this cluster and these plans, not a microbenchmark
calibration (`autoplan calibrate` measures matmuls and collectives one by one). Time that
does not scale with the device (per-op dispatch, launch latency: most of a tiny model's step on
CPU ranks) is not in it, so such runs stay under-predicted after the fit. A fraction is capped
at 1: the datasheet peak stays the ceiling, and the cap is reported.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Sequence

from autoplan.hardware import Cluster, write_hardware_file
from autoplan.tune.launch import Trial

SCALED = ("matmul_fraction_16bit", "matmul_fraction_fp32", "matmul_fraction_fp8", "hbm_fraction",
          "attention_fraction")


def fit_factor(trials: Sequence[Trial]) -> float | None:
    """Median predicted / measured step time over the runs that finished; None without any."""
    ratios = [t.predicted_step_s / t.measured_step_s for t in trials if t.ok and t.measured_step_s]
    return statistics.median(ratios) if ratios else None


def _scaled(value, factor: float) -> tuple[object, bool]:
    """(value x factor capped at 1, whether the cap bit) for a fraction or a curve of them."""
    if isinstance(value, list):
        pairs = [_scaled(v, factor) for v in value]
        return [v for v, _ in pairs], any(c for _, c in pairs)
    scaled = float(value) * factor
    return round(min(1.0, scaled), 4), scaled > 1.0


def refit_cluster(cluster: Cluster, factor: float, runs: int) -> tuple[Cluster, list[str]]:
    """The cluster with its GPU's fractions scaled by `factor`; notes on what was capped."""
    efficiency = cluster.gpu.to_table().get("efficiency", {})
    updates, capped = {}, []
    for key in SCALED:
        if key in efficiency:
            updates[f"efficiency.{key}"], hit = _scaled(efficiency[key], factor)
            if hit:
                capped.append(key)
    source = (f"fitted by autoplan tune {date.today().isoformat()}: {cluster.gpu.key}'s value x {factor:.3f}, "
              f"the median predicted / measured step time of {runs} measured run(s)")
    gpu = cluster.gpu.with_values(updates, source)
    notes = [f"capped at 1.0 (the datasheet peak): {', '.join(capped)}; the runs were faster than the "
             "peaks allow for, so the difference lies outside the device fractions"] if capped else []
    return replace(cluster, gpu=gpu), notes


def write_refit(cluster: Cluster, trials: Sequence[Trial], path: Path) -> tuple[float | None, list[str]]:
    """Write the fitted hardware file; (factor, notes), or (None, why not) when no run finished."""
    factor = fit_factor(trials)
    if factor is None:
        return None, ["no candidate finished, so nothing was fitted"]
    fitted, notes = refit_cluster(cluster, factor, sum(t.ok for t in trials))
    write_hardware_file(fitted, path, date.today().isoformat(), "autoplan tune")
    return factor, notes
