"""The cost model's measured error on calibrated hardware: the half-width of the report's range."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from autoplan.calibrate.fit import measurements_path
from autoplan.cost import comm, hw
from autoplan.hardware import GB, load_hardware_file
from autoplan.validate.measured import compare_run_dir


def measured_error(path: str | Path) -> float | None:
    """The cost model's measured relative error on this hardware, or None if nothing was measured.

    `path` is a calibrated hardware file (its `.measurements.json` beside it: the median
    |predicted - measured| / measured over every GEMM, copy and collective timed, predictions
    from the file's own numbers through the cost model's functions) or a run directory with
    metrics.jsonl next to its job's plan.json (the relative error of the step time, see
    `autoplan.validate.measured.compare_run_dir`). The report uses it as the half-width of its range.
    """
    details = measured_error_details(path)
    return None if details is None else details["median_abs_rel_error"]


def measured_error_details(path: str | Path) -> dict[str, Any] | None:
    """`measured_error` with its parts: median, 90th percentile, count, source."""
    path = Path(path)
    if path.is_dir():
        if not (path / "metrics.jsonl").is_file():
            return None

        report = compare_run_dir(path)
        err = report["error"].get("step_time_s")
        if err is None:
            return None
        return {"median_abs_rel_error": abs(err), "p90_abs_rel_error": abs(err), "count": report["steps_used"],
                "source": f"validated run {path}: step time predicted vs measured"}
    side = measurements_path(path)
    if not side.is_file():
        return None
    # GEMM and copy numbers are read off the same measurements (in-sample error ~0), so only
    # the collectives, whose alpha-beta form has to fit several sizes and ops at once, count.
    errors = [e for e in primitive_errors(path) if e["kind"] == "collective"]
    if not errors:
        return None
    values = sorted(abs(e["rel_error"]) for e in errors)
    return {"median_abs_rel_error": statistics.median(values),
            "p90_abs_rel_error": values[min(len(values) - 1, int(0.9 * len(values)))],
            "count": len(values),
            "source": f"calibration {side}: cost-model collective times vs measured (a lower bound of the step error)"}


def primitive_errors(hardware_file: str | Path) -> list[dict[str, Any]]:
    """Each measured GEMM, copy and collective next to what the cost model predicts from the file."""

    cluster = load_hardware_file(hardware_file)
    gpu = cluster.gpu
    fabric = hw.fabric(cluster)
    data = json.loads(measurements_path(hardware_file).read_text())
    out = []
    for p in data.get("matmul", []):
        precision = "fp32" if p["dtype"] == "tf32" and not gpu.supports("tf32") else p["dtype"]
        flops = 2.0 * p["m"] * p["n"] * p["k"]
        rate = gpu.peak_flops(precision) * gpu.matmul_efficiency(flops, min(p["m"], p["n"], p["k"]), precision)
        out.append({"kind": "matmul", "what": f"matmul {p['dtype']} {p['m']}x{p['n']}x{p['k']}",
                    "measured_s": p["seconds"], "predicted_s": flops / rate})
    if data.get("copy_gb_per_s"):
        nbytes = data["copy_bytes"]
        measured = 2.0 * nbytes / (data["copy_gb_per_s"] * GB)
        out.append({"kind": "copy", "what": f"copy {nbytes} B", "measured_s": measured,
                    "predicted_s": 2.0 * nbytes / hw.hbm_bytes_per_s(gpu)})
    for p in data.get("comm", []):
        n = p["group_size"]
        span = comm.GroupSpan(n, n, 1) if p["scope"] == "intra" else comm.GroupSpan(n, 1, n)
        size = p["bytes"]
        predict = {"all_reduce": lambda: comm.allreduce_time_s(size, span, fabric),
                   "all_gather": lambda: comm.allgather_time_s(size, span, fabric),
                   "reduce_scatter": lambda: comm.reduce_scatter_time_s(size, span, fabric),
                   "all_to_all": lambda: comm.alltoall_time_s(size, span, fabric),
                   "send_recv": lambda: comm.p2p_time_s(size, p["scope"] == "inter", fabric)}[p["op"]]
        out.append({"kind": "collective", "what": f"{p['op']} {p['scope']} x{n} {size} B", "measured_s": p["seconds"],
                    "predicted_s": predict()})
    for e in out:
        e["rel_error"] = (e["predicted_s"] - e["measured_s"]) / e["measured_s"]
    return out
