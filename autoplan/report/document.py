"""The report as plain data: what JSON prints and what every renderer reads.

Two kinds: "sweep" (many clusters, `sweep.run_sweep`) and "plan" (one plan file in depth).
Both carry a `detail` block for one plan (the fastest of a sweep): per-stage memory, the
step-time parts and what the pipeline chart needs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from autoplan.codegen.launchers import generate_command
from autoplan.hardware import load_gpu
from autoplan.planfile import load_checked_plan
from autoplan.report.goodput import GoodputAssumptions, SOURCES
from autoplan.report.sweep import GIB, Row, RunCost, Sweep, price_run, recommendations

if TYPE_CHECKING:
    from autoplan.report.accuracy import ErrorBand

CONFIG_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "offload", "micro_batch", "schedule", "vpp",
               "precision")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_dict(run: RunCost) -> dict[str, Any]:
    g = run.goodput
    return {
        "steps": run.steps, "training_s": g.training_s, "time_to_train_s": _finite(run.time_s),
        "time_range_s": [_finite(v) for v in run.time_range_s], "gpu_hours": _finite(run.gpu_hours),
        "cost_usd": _finite(run.cost_usd), "cost_range_usd": [_finite(v) for v in run.cost_range_usd],
        "goodput": {"fraction": g.fraction, "checkpoint_bytes": g.checkpoint_bytes,
                    "checkpoint_write_s": g.checkpoint_write_s, "job_mtbf_s": g.job_mtbf_s,
                    "checkpoint_interval_s": g.interval_s, "checkpoint_interval_steps": g.interval_steps,
                    "checkpoints": g.checkpoints, "expected_interruptions": _finite(g.expected_interruptions),
                    "lost_s_per_interruption": g.lost_s_per_interruption},
    }


def row_dict(row: Row) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": row.gpu, "gpu_name": row.gpu_name, "num_gpus": row.num_gpus,
                           "label": row.label, "fits": row.fits, "reason": row.reason,
                           "usd_per_gpu_hour": row.usd_per_gpu_hour, "capacity_gib": row.capacity_gib,
                           "frontier": row.frontier, "solver_status": row.solver_status,
                           "solver_wall_s": row.solver_wall_s, "search": row.search}
    if row.fits:
        e = row.estimate
        out.update({k: e[k] for k in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu",
                                      "memory_gib_per_gpu")})
        out["headroom_gib"] = row.headroom_gib
        out["config"] = {k: getattr(row.plan, k) for k in CONFIG_KEYS}
        out.update(run_dict(row.run))
        out["runners_up"] = row.runners_up
    return out


def assumptions_dict(assumptions: GoodputAssumptions) -> dict[str, Any]:
    return {**asdict(assumptions), "sources": dict(SOURCES)}


def error_dict(error: ErrorBand | None) -> dict[str, Any] | None:
    return asdict(error) if error else None


@dataclass
class PlanDetail:
    """One plan in depth: its estimate, the GPU's capacity and the priced run."""

    title: str
    plan: Any  # autoplan.plan.Plan
    estimate: dict
    capacity_gib: float
    run: RunCost
    usd_per_gpu_hour: float


MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers", "temporaries", "overhead")


def step_components(estimate: dict) -> list[tuple[str, float]]:
    """(part, seconds) of one step: compute, recompute, exposed comm by kind, bubble, CPU
    offload, other."""
    t = estimate["time_breakdown_s"]
    parts = [("compute", t["compute"]), ("recompute", t["recompute"])]
    parts += [(f"comm {kind}", s) for kind, s in sorted(estimate["comm_breakdown_s"].items())]
    parts.append(("bubble", t["bubble"]))
    if t.get("offload"):
        parts.append(("offload", t["offload"]))
    rest = estimate["step_time_s"] - sum(s for _, s in parts)
    if rest > 1e-6 * estimate["step_time_s"]:  # the optimizer update and what else the step adds
        parts.append(("other", rest))
    return parts



def detail_dict(d: PlanDetail) -> dict[str, Any]:
    e = d.estimate
    return {"title": d.title, "gpu": d.plan.gpu, "num_gpus": d.plan.world_size,
            "config": {k: getattr(d.plan, k) for k in CONFIG_KEYS},
            "num_microbatches": d.plan.num_microbatches, "capacity_gib": d.capacity_gib,
            "step_time_s": e["step_time_s"], "tokens_per_s_per_gpu": e["tokens_per_s_per_gpu"],
            "mfu": e["mfu"], "memory_gib_per_gpu": e["memory_gib_per_gpu"],
            "headroom_gib": d.capacity_gib - e["memory_gib_per_gpu"],
            "per_stage": e["per_stage"], "step_parts_s": dict(step_components(e)),
            "usd_per_gpu_hour": d.usd_per_gpu_hour, **run_dict(d.run)}


def fastest_detail(sweep: Sweep) -> PlanDetail | None:
    """The fastest row of a sweep, in depth."""
    best = recommendations(sweep).get("fastest", (None, ""))[0]
    if best is None:
        return None
    return PlanDetail(title=f"fastest: {best.label}", plan=best.plan, estimate=best.estimate,
                      capacity_gib=best.capacity_gib, run=best.run, usd_per_gpu_hour=best.usd_per_gpu_hour)


def sweep_dict(sweep: Sweep) -> dict[str, Any]:
    recs = recommendations(sweep)
    detail = fastest_detail(sweep)
    return {
        "kind": "sweep", "model": sweep.model, "tokens": sweep.tokens, "seq_len": sweep.seq_len,
        "global_batch": sweep.global_batch, "tokens_per_step": sweep.global_batch * sweep.seq_len,
        "precision": sweep.precision, "price_list": sweep.price_list, "budget_usd": sweep.budget_usd,
        "deadline_days": sweep.deadline_days, "assumptions": assumptions_dict(sweep.assumptions),
        "error": error_dict(sweep.error), "rows": [row_dict(r) for r in sweep.rows],
        "frontier": [r.label for r in sorted((r for r in sweep.rows if r.frontier), key=lambda r: r.run.time_s)],
        "recommendations": {k: {"label": row.label if row else None, "why": why,
                                "generate": generate_command(row.plan) if row else None}
                            for k, (row, why) in recs.items()},
        "detail": detail_dict(detail) if detail else None, "wall_s": sweep.wall_s,
    }


CPU_DEVICE = "cpu"


def load_plan_detail(path: str, *, tokens: int | None, prices, assumptions: GoodputAssumptions,
                     error: ErrorBand | None, model: str | None = None,
                     trust_plan_model: bool = False) -> PlanDetail:
    """A plan file priced for `tokens`, or for one optimizer step when None (the model, MODEL
    or the plan's own, is traced again for its parameter count)."""
    # the estimate is recomputed, never read from the file
    checked = load_checked_plan(path, model, trust_plan_model=trust_plan_model)
    plan, graph = checked.plan, checked.graph
    gpu = load_gpu(plan.gpu)
    # the cpu device stands in for GPUs in the CPU walkthrough and has no rental price: 0, which
    # the report says, unless --price gives one
    usd = 0.0 if gpu.key == CPU_DEVICE and not prices.has(gpu.key) else prices.usd_per_gpu_hour(gpu.key)
    tokens_per_step = plan.global_batch * plan.seq_len
    run = price_run(plan.estimate["step_time_s"], plan.world_size, tokens or tokens_per_step, tokens_per_step,
                    graph.parameters, plan.precision, usd, assumptions, error)
    return PlanDetail(title=f"{plan.model.name} on {plan.world_size} x {gpu.key}", plan=plan,
                      estimate=plan.estimate, capacity_gib=gpu.memory_bytes / GIB, run=run, usd_per_gpu_hour=usd)


def plan_dict(d: PlanDetail, *, tokens: int, assumptions: GoodputAssumptions, error: ErrorBand | None,
              price_list: str) -> dict[str, Any]:
    return {"kind": "plan", "model": d.plan.model.name, "tokens": tokens, "seq_len": d.plan.seq_len,
            "global_batch": d.plan.global_batch, "tokens_per_step": d.plan.global_batch * d.plan.seq_len,
            "precision": d.plan.precision, "price_list": price_list,
            "assumptions": assumptions_dict(assumptions), "error": error_dict(error), "detail": detail_dict(d)}
