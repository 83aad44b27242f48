"""Predicted vs measured for a generated job's run (`autoplan validate --run DIR`).

A run directory holds `metrics.jsonl` (one JSON object per step, written by the runtime's
rank 0: step, loss, grad_norm, lr, tokens_per_s, mfu, peak_memory_gib, step_time_s, device; a
record may carry `rank`, then peak memory is reported per rank). The job's `plan.json` sits in the run
directory or one of its parents (generated jobs write runs under <job>/runs/<name>/); its
`estimate` holds the prediction. The first steps are warm-up (lazy initialisation, allocator
growth, kernel autotuning) and are left out: `warmup` of them (default 2), fewer when the
run is short, always keeping at least one step.

A run records the device it ran on (`device`: cuda or cpu). A CPU run is compared with the
CPU cost model (cost_models/gpus/cpu.toml): when its plan was made for a GPU, the caller's
`cpu_estimate` re-estimates the plan on CPU ranks. Its memory is not compared: a CPU rank
reports its whole process's peak resident set (Python and the torch libraries included),
where the cost model predicts device memory (with a CUDA context allowance a CPU process
does not have).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

from autoplan.cost.memory import runtime_overhead_bytes
from autoplan.errors import UserError
from autoplan.textfile import read_text
from autoplan.plan import Plan, PlanFormatError

DEFAULT_WARMUP_STEPS = 2
METRICS = ("step_time_s", "tokens_per_s", "mfu", "peak_memory_gib")


def find_plan(run_dir: Path) -> Path:
    """plan.json in the run directory or up to three levels above it."""
    for folder in (run_dir, *list(run_dir.resolve().parents)[:3]):
        if (folder / "plan.json").is_file():
            return folder / "plan.json"
    raise UserError(f"no plan.json in {run_dir} or the three folders above it; give the run directory of a job "
                    "written by `autoplan generate` (its runs go under <job>/runs/), or pass --plan plan.json")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Step records of metrics.jsonl; UserError naming the first bad line."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; run the job first (its rank 0 writes metrics.jsonl into "
                        "--run-dir), then validate that run directory")
    records = []
    for number, line in enumerate(read_text(path, "metrics file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {number} is not JSON ({exc.msg}); metrics.jsonl holds one JSON object "
                            "per step") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f"{path} line {number} is not a step record (an object with a \"step\")")
        bad = [key for key in METRICS if _not_a_measurement(record.get(key))]
        if bad:
            raise UserError(f"{path} line {number}: {bad[0]} is {record[bad[0]]!r}, not a finite number; a step "
                            "whose measurement failed cannot be compared: remove the line (or rerun the job)")
        records.append(record)
    if not records:
        raise UserError(f"{path} has no steps yet; let the run train at least one step")
    return records


def _not_a_measurement(value: Any) -> bool:
    """A metric value that is present but not a finite number (None means not recorded)."""
    if value is None:
        return False
    return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)


def _step_time(record: dict[str, Any], tokens_per_step: int) -> float | None:
    if record.get("step_time_s"):
        return float(record["step_time_s"])
    if record.get("tokens_per_s"):
        return tokens_per_step / float(record["tokens_per_s"])
    return None


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def run_device(records: list[dict[str, Any]], plan: Plan) -> str:
    """"cpu" or "cuda": what the run recorded, else what its plan was made for."""
    recorded = {r["device"] for r in records if r.get("device")}
    if recorded:
        return "cpu" if recorded == {"cpu"} else "cuda"
    return "cpu" if plan.gpu == "cpu" else "cuda"


def compare_run_dir(run_dir: str | Path, plan_path: str | Path | None = None, warmup: int | None = None,
                    cpu_estimate: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Measured step time, tokens/s, MFU and peak memory per rank next to the plan's estimate.

    Medians over the steps after warm-up (robust to a slow checkpoint step); peak memory is
    the largest over those steps. Relative error = (predicted - measured) / measured.
    `cpu_estimate(plan file)` gives the plan's estimate on CPU ranks, for a CPU run of a plan
    made for a GPU (without it such a run is refused, not compared with a GPU's prediction).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    plan_file = Path(plan_path) if plan_path else find_plan(run_dir)
    try:
        plan = Plan.load(plan_file)
    except (PlanFormatError, OSError) as exc:
        raise UserError(f"cannot read plan {plan_file}: {exc}") from None
    est = plan.estimate or {}
    if not est.get("step_time_s"):
        raise UserError(f"{plan_file} has no predicted estimate; write plans with `autoplan plan -o plan.json` "
                        "(generate copies it into the job)")
    records = sorted(read_metrics(run_dir / "metrics.jsonl"), key=lambda r: (r["step"], r.get("rank", 0)))
    device = run_device(records, plan)
    model_gpu = plan.gpu
    if device == "cpu" and plan.gpu != "cpu":
        if cpu_estimate is None:
            raise UserError(f"{run_dir} ran on CPU but {plan_file} was planned for {plan.gpu}; compare it with "
                            "a plan made with --gpu cpu")
        est, model_gpu = cpu_estimate(plan_file), "cpu"
    steps = sorted({r["step"] for r in records})
    wanted = DEFAULT_WARMUP_STEPS if warmup is None else warmup
    if warmup is not None and warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {warmup}")
    skip = min(wanted, len(steps) - 1)
    notes = []
    if skip < wanted:
        notes.append(f"only {len(steps)} step(s): {skip} skipped as warm-up instead of {wanted}")
    used = [r for r in records if r["step"] in set(steps[skip:])]
    tokens = plan.global_batch * plan.seq_len
    times = [t for t in (_step_time(r, tokens) for r in used if r.get("rank", 0) == 0) if t]
    mfus = [float(r["mfu"]) for r in used if r.get("mfu") is not None and r.get("rank", 0) == 0]
    step_time = statistics.median(times) if times else None
    measured = {"step_time_s": step_time, "tokens_per_s": tokens / step_time if step_time else None,
                "mfu": statistics.median(mfus) if mfus else None}
    predicted = {"step_time_s": est.get("step_time_s"), "tokens_per_s": est.get("tokens_per_s"),
                 "mfu": est.get("mfu"), "memory_gib_per_gpu": est.get("memory_gib_per_gpu")}
    per_rank = _memory_per_rank(used, plan, est, compare=device != "cpu")
    if per_rank:
        measured["peak_memory_gib"] = max(r["measured_peak_memory_gib"] for r in per_rank)
    error = {"step_time_s": _rel(predicted["step_time_s"], measured["step_time_s"]),
             "tokens_per_s": _rel(predicted["tokens_per_s"], measured["tokens_per_s"]),
             "mfu": _rel(predicted["mfu"], measured["mfu"]),
             "peak_memory_gib": None if device == "cpu"
             else _rel(predicted["memory_gib_per_gpu"], measured.get("peak_memory_gib"))}
    notes += _notes(device, plan, model_gpu, error, measured)
    return {"run_dir": str(run_dir), "plan": str(plan_file), "gpu": plan.gpu, "device": device,
            "cost_model": model_gpu, "world_size": plan.world_size,
            "steps_total": len(steps), "warmup_steps": skip, "steps_used": len(steps) - skip,
            "predicted": predicted, "measured": measured, "error": error, "per_rank": per_rank, "notes": notes}


def _notes(device: str, plan: Plan, model_gpu: str, error: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """What a reader needs to read the errors: which cost model, and which way each one leans."""
    notes = []
    if model_gpu != plan.gpu:
        notes.append(f"the plan was made for {plan.gpu}; this CPU run is compared with the plan re-estimated on "
                     f"{plan.world_size} CPU ranks (cost_models/gpus/cpu.toml)")
    if device == "cpu" and measured.get("peak_memory_gib") is not None:
        notes.append("memory is not compared: a CPU rank reports its process's peak resident set (Python and the "
                     "torch libraries included), the cost model predicts device memory (with a "
                     f"{runtime_overhead_bytes() / 2**30:g} GiB CUDA context allowance a CPU process does not have)")
    step = error.get("step_time_s")
    if device == "cpu":
        notes.append(CPU_MODEL_PURPOSE)
    if device == "cpu" and step is not None and step < 0:
        notes.append(f"steps took {1 / (1 + step):.1f}x the predicted time: the CPU cost model times matmuls, "
                     "memory traffic and gloo collectives with one core per rank; per-operator Python and "
                     "dispatch time and ranks sharing cores are not in it, and for a model this small they "
                     "dominate")
    elif device == "cpu" and step is not None and step > 0:
        notes.append(f"steps took {1 / (1 + step):.2f}x the predicted time: faster than the CPU cost model, "
                     "whose data was measured with one thread per rank")
    return notes


# What the CPU cost model is for, and how far off it is on the README's walkthrough (tiny-gpt,
# 4 ranks on a 2-core machine: -86% step time, i.e. steps about 7x the prediction)
CPU_MODEL_PURPOSE = (
    "the CPU cost model (cost_models/gpus/cpu.toml) is there so that a job can be planned, generated "
    "and run on CPU processes without a GPU; its times are not a forecast for this machine: on the "
    "README's tiny-gpt walkthrough (4 ranks on 2 cores) steps take about 7x its prediction. How far "
    "the GPU cost model is off is measured against published GPU runs (`autoplan validate`)")


def _memory_per_rank(used: list[dict[str, Any]], plan: Plan, est: dict[str, Any],
                     compare: bool = True) -> list[dict[str, Any]]:
    """Peak memory of every rank that logged it, next to its pipeline stage's predicted memory
    (with an error when `compare`).

    Ranks are laid out pp-outermost (autoplan.runtime.mesh), so rank r is in stage r // (world / pp).
    """
    peaks: dict[int, float] = {}
    for r in used:
        if r.get("peak_memory_gib") is not None:
            rank = int(r.get("rank", 0))
            peaks[rank] = max(peaks.get(rank, 0.0), float(r["peak_memory_gib"]))
    stages = {s["stage"]: s.get("memory_gib") for s in est.get("per_stage", []) if "stage" in s}
    out = []
    for rank, peak in sorted(peaks.items()):
        stage = rank // max(1, plan.world_size // plan.pp)
        predicted = stages.get(stage, est.get("memory_gib_per_gpu"))
        out.append({"rank": rank, "stage": stage, "measured_peak_memory_gib": peak,
                    "predicted_memory_gib": predicted, "error": _rel(predicted, peak) if compare else None})
    return out


def render_run(report: dict[str, Any], console) -> None:
    """Rich tables: the step numbers and memory per rank, predicted vs measured."""
    from rich.table import Table

    def fmt(key: str, value: float | None) -> str:
        if value is None:
            return "-"
        if key == "mfu":
            return f"{value:.1%}"
        if key == "tokens_per_s":
            return f"{value:,.0f}"
        return f"{value:.3f}" if key == "step_time_s" else f"{value:.2f}"

    pct = lambda v: "-" if v is None else f"{v:+.1%}"  # noqa: E731
    table = Table(title=f"{_run_label(report)} {report['run_dir']} vs the {report['cost_model']} cost model "
                        f"({report['steps_used']} steps after {report['warmup_steps']} warm-up)")
    for name in ("", "predicted", "measured", "error"):
        table.add_column(name, justify="left" if not name else "right")
    p, m, e = report["predicted"], report["measured"], report["error"]
    memory = "peak memory (GiB, worst rank" + (": RSS)" if report["device"] == "cpu" else ")")
    rows = [("step time (s)", "step_time_s", "step_time_s"), ("tokens/s", "tokens_per_s", "tokens_per_s"),
            ("MFU", "mfu", "mfu"), (memory, "memory_gib_per_gpu", "peak_memory_gib")]
    for label, pkey, mkey in rows:
        unit = "mfu" if pkey == "mfu" else mkey
        table.add_row(label, fmt(unit, p.get(pkey)), fmt(unit, m.get(mkey)), pct(e.get(mkey)))
    console.print(table)
    if report["per_rank"]:
        ranks = Table(title="peak memory per rank (GiB" + (", measured: process RSS)" if report["device"] == "cpu"
                                                           else ")"))
        for name in ("rank", "stage", "predicted", "measured", "error"):
            ranks.add_column(name, justify="right")
        for r in report["per_rank"]:
            ranks.add_row(str(r["rank"]), str(r["stage"]), fmt("gib", r["predicted_memory_gib"]),
                          fmt("gib", r["measured_peak_memory_gib"]), pct(r["error"]))
        console.print(ranks)
    for note in report["notes"]:
        console.print(f"note: {note}")


def _run_label(report: dict[str, Any]) -> str:
    if report["device"] == "cpu":
        return f"CPU run ({report['world_size']} gloo ranks)"
    return f"GPU run ({report['world_size']} ranks)"
