"""`autoplan check`: dry-run a plan's own runtime at full size on fake tensors, no GPU.

The ranks that differ (rank 0 of the first, a middle and the last pipeline stage) apply the
plan with autoplan.runtime on torch's fake process group and run one training step on fake
CPU tensors (autoplan.dryrun). Their peak memory by category and every collective with its
bytes are set beside the cost model's estimate of the same plan, and the job is said to fit
or not against the plan's own budget: the GPU's memory less the headroom the plan keeps. The collectives are compared per kind and dtype with the
cost model's volume (autoplan.cost.volume) over the window the dry run measures: the step's
last micro-batch (with the once-a-step collectives of its first when it is the only one) and
the end of the step.

How the dry-run total is formed: the step runs one micro-batch per stage, so the activations
of the other micro-batches a pipeline schedule keeps in flight are added: in-flight x what one
micro-batch keeps for its backward on this rank (summed over its stages, each measured when
the stage's last block returns), less the running stage's own, in-flight being the schedule
count the cost model uses (whole-stage micro-batches, as interleaved schedules count them).
What a stage allocates after its blocks (the last stage's logits and loss) is held for the
running micro-batch only and is not multiplied. The gradient reduction and optimizer step,
after the schedule has drained, are a moment of their own. The CUDA context and allocator
overhead, which fake tensors cannot see, is the cost model's. With CPU offload, what the
offload policy keeps in host memory is not in the GPU's categories but on a row of its own,
beside the cost model's host memory per GPU. MoE layers route balanced, as the cost model
assumes (autoplan.dryrun.routing); the report says so when a layer was routed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from autoplan.commands import options as o
from autoplan.errors import DryRunMismatch, NoFeasiblePlan, UserError
from autoplan.planfile import load_checked_plan, read_plan

GIB = 2**30
ROWS = ("parameters", "gradients", "optimizer", "activations", "buffers", "temporaries")
HOST_ROW = "host (CPU offload)"  # not GPU memory: after the total


def plan_path_of(target: str) -> str:
    """A plan.json, or the plan.json of a generated job directory."""
    path = Path(target)
    return str(path / "plan.json") if path.is_dir() else target


def rank_report(run, seconds: float, stage_estimate: dict, budget_bytes: float,
                host_model_gib: float | None = None,
                model_collectives: dict[tuple[str, str], float] | None = None) -> dict:
    """One rank's dry-run beside the cost model's estimate of its pipeline stage (GiB);
    `host_model_gib`: the cost model's host memory of this rank under CPU offload;
    `model_collectives`: the cost model's bytes per (kind, dtype) in the dry run's window."""
    from autoplan.dryrun.collectives import summarise

    model = dict(stage_estimate.get("memory_breakdown_gib", {}))
    in_flight = max(1.0, float(stage_estimate.get("in_flight", 1.0)))
    held = sum(h for h, _ in run.microbatches)
    dry = {name: run.category_max.get(name, 0) / GIB for name in ROWS}
    dry["activations"] = max(window.category_max.get("activations", 0) + in_flight * held - h
                             for h, window in run.microbatches) / GIB
    peak, at_peak = _worst_moment(run, in_flight * held)
    overhead = float(model.get("overhead", 0.0))
    total = peak / GIB + overhead
    rows = [{"category": name, "dry_run_gib": dry[name], "model_gib": model.get(name),
             "ratio": _ratio(dry[name], model.get(name)),
             "at_peak_gib": at_peak.get(name, 0) / GIB} for name in ROWS]
    rows.append({"category": "overhead (model's)", "dry_run_gib": overhead, "model_gib": overhead,
                 "ratio": 1.0 if overhead else None, "at_peak_gib": overhead})
    model_total = stage_estimate.get("memory_gib")
    rows.append({"category": "total at peak", "dry_run_gib": total, "model_gib": model_total,
                 "ratio": _ratio(total, model_total), "at_peak_gib": total})
    if run.host_peak_bytes or host_model_gib:
        host = run.host_peak_bytes / GIB
        rows.append({"category": HOST_ROW, "dry_run_gib": host, "model_gib": host_model_gib,
                     "ratio": _ratio(host, host_model_gib), "at_peak_gib": host})
    return {"rank": run.rank, "pipeline_rank": run.pp_rank, "stages": run.stage_ids,
            "parameters": {"runtime": run.runtime_parameters, "model": run.model_parameters},
            "in_flight_microbatches": in_flight, "held_activations_gib": held / GIB,
            "activations_by_stage": _activations_by_stage(run),
            "seconds": seconds, "memory": rows, "peak_gib": total,
            "spare_gib": budget_bytes / GIB - total,
            "collectives": collective_rows(summarise(run.collectives), model_collectives or {})}


def collective_rows(dry_rows: list[dict], model: dict[tuple[str, str], float]) -> list[dict]:
    """The dry run's collectives per (kind, dtype) beside the cost model's bytes of the same
    window, and rows for what only the cost model counts; largest first."""
    rows = [dict(r, gib=r["bytes"] / GIB, model_bytes=model.get((r["kind"], r["dtype"])))
            for r in dry_rows]
    seen = {(r["kind"], r["dtype"]) for r in dry_rows}
    rows += [{"kind": kind, "dtype": dtype, "count": 0, "bytes": 0, "gib": 0.0, "model_bytes": b}
             for (kind, dtype), b in model.items() if (kind, dtype) not in seen]
    for row in rows:
        row["model_gib"] = None if row["model_bytes"] is None else row["model_bytes"] / GIB
        row["ratio"] = _ratio(row["bytes"], row["model_bytes"])
    return sorted(rows, key=lambda r: -max(r["bytes"], r["model_bytes"] or 0))


def model_collectives(checked, pp_rank: int) -> dict[tuple[str, str], float]:
    """The cost model's collective bytes per (kind, dtype) of a rank of pipeline stage
    `pp_rank` over what the dry run measures: the step's last micro-batch (with the step's
    first-micro-batch collectives when it is the only one) and the end of the step."""
    from autoplan.cost.volume import by_kind, rank_traffic

    plan = checked.plan
    traffic = rank_traffic(checked.graph, plan.parallel, checked.stages_layers, pp_rank)
    return by_kind(traffic, plan.parallel.num_microbatches, window="last micro-batch")


def _activations_by_stage(run) -> dict[str, dict[str, float]]:
    """Per stage (GiB): activations held when it started (left by what ran before), those its
    micro-batch keeps for the backward, and the most it held beyond both after its blocks."""
    report = {}
    for stage, (held, window) in zip(run.stage_ids, run.microbatches):
        before = window.at_start.get("activations", 0)
        after = window.category_max.get("activations", 0) - before - held
        report[str(stage)] = {"before": before / GIB, "kept_for_backward": held / GIB,
                              "after_blocks": after / GIB}
    return report


def _worst_moment(run, in_flight_held: float) -> tuple[float, dict]:
    """(bytes, categories) of the step's worst moment: while a stage's micro-batch runs, the
    other micro-batches in flight add what they keep (in-flight x the rank's per-micro-batch
    activations, less the running stage's own, which its window already counts); by the
    reduction and optimizer step the schedule has drained them."""
    moments = [(window.peak + in_flight_held - h,
                dict(window.at_peak, activations=window.at_peak.get("activations", 0)
                     + in_flight_held - h))
               for h, window in run.microbatches]
    moments.append((run.reduction.peak, run.reduction.at_peak))
    return max(moments, key=lambda m: m[0])


def _ratio(dry: float, model) -> float | None:
    return dry / model if model else None


BALANCED = ("balanced, every expert takes tokens x top_k / experts of each micro-batch, as the "
            "cost model assumes; real routing is uneven, and the fullest expert's rank holds more")


def check_plan(target: str, workers: int, model: str | None = None, trust_plan_model: bool = False) -> dict:
    """The dry run's report of the plan at `target`, made in the dry run's host process, so that
    this process never imports torch (autoplan.dryrun.host)."""
    from autoplan.dryrun.host import run_in_host

    start = time.perf_counter()
    _refuse_before_the_host(plan_path_of(target))
    report = run_in_host(check_in_host, plan_path_of(target), workers, model, trust_plan_model)
    report["wall_s"] = time.perf_counter() - start
    return report


def _refuse_before_the_host(path: str) -> None:
    """What the plan file alone says cannot be checked, before the host (a process that
    imports torch) starts: a file that is no plan, and an image classifier's plan, since the
    dry run's step feeds token ids."""
    kind = read_plan(path).inputs.get("kind")
    if kind in ("images", "batch"):
        trains = "an image classifier" if kind == "images" else "on the model file's example_batch"
        raise UserError(f"{path} trains {trains}, and `autoplan check` dry-runs a step "
                        "on token ids only, so it cannot check this plan yet. `autoplan estimate "
                        "--plan` gives the plan's estimate; the job's launch.sh --steps N measures it.")


def check_in_host(path: str, workers: int, model: str | None, trust_plan_model: bool) -> dict:
    """In the dry run's host: the plan checked and estimated again in a process forked from it
    (tracing runs torch ops, which the host must not run before it forks the ranks), then the
    ranks' dry runs beside the cost model."""
    from autoplan.cost.hw import memory_budget_bytes
    from autoplan.dryrun.host import Forked
    from autoplan.dryrun.job import run_ranks
    from autoplan.hardware import resolve_cluster
    from autoplan.plan import Plan

    loaded = Forked(load_for_check, path, model, trust_plan_model).result()
    plan = Plan.from_dict(loaded["plan"])
    est = plan.estimate
    cluster = resolve_cluster(plan.gpu, None, plan.world_size, plan.gpus_per_node,
                              plan.memory_headroom_gib, plan.inter_node_bandwidth_gb_per_s)
    gpu_bytes = cluster.gpu.memory_bytes
    budget_bytes = memory_budget_bytes(cluster)  # the GPU less the plan's own headroom
    stages = est.get("per_stage") or [{"memory_gib": est.get("memory_gib_per_gpu"),
                                       "memory_breakdown_gib": est.get("memory_breakdown_gib", {})}]
    runs = run_ranks(loaded["plan"], workers)
    # the cost model's host memory is its fullest rank's; with one pipeline stage, every rank's
    host = est.get("host_memory_gib_per_gpu") if plan.pp == 1 else None
    ranks = [rank_report(run, secs, stages[min(run.pp_rank, len(stages) - 1)], budget_bytes, host,
                         loaded["collectives"][run.pp_rank])
             for run, secs in runs]
    worst = max(ranks, key=lambda r: r["peak_gib"])
    mismatched = [r["rank"] for r in ranks if r["parameters"]["runtime"] != r["parameters"]["model"]]
    return {"plan": path, "gpu": plan.gpu, "gpu_memory_gib": gpu_bytes / GIB,
            "memory_headroom_gib": (gpu_bytes - budget_bytes) / GIB, "budget_gib": budget_bytes / GIB,
            "world_size": plan.world_size, "device": "fake cpu tensors (no memory allocated)",
            "fits": worst["spare_gib"] >= 0, "worst_rank": worst["rank"],
            "parameters_match": not mismatched, "parameter_mismatch_ranks": mismatched,
            "spare_gib": worst["spare_gib"], "ranks": ranks,
            "routing": BALANCED if any(run.balanced_routings for run, _ in runs) else None}


def load_for_check(path: str, model: str | None, trust_plan_model: bool) -> dict:
    """The plan read back and estimated again from its model (planfile.load_checked_plan; no
    capability probe: the dry run applies and runs the runtime itself, at the plan's size), and
    the cost model's collectives of each pipeline rank the dry run runs, as plain values."""
    from autoplan.dryrun.rank import representative_ranks

    checked = load_checked_plan(path, model, trust_plan_model=trust_plan_model, probe_runtime=False)
    plan = checked.plan
    pp_ranks = {rank // (plan.world_size // plan.pp) for rank in representative_ranks(plan)}
    return {"plan": plan.to_dict(),
            "collectives": {pp: model_collectives(checked, pp) for pp in pp_ranks}}


def render(report: dict, console) -> None:
    from rich.table import Table

    for rank in report["ranks"]:
        table = Table(title=f"rank {rank['rank']} (pipeline rank {rank['pipeline_rank']}, stages "
                            f"{rank['stages']}, {rank['in_flight_microbatches']:g} micro-batches "
                            f"in flight): memory GiB, dry run vs cost model")
        for column in ("category", "dry run", "cost model", "ratio"):
            table.add_column(column, justify="left" if column == "category" else "right")
        for row in rank["memory"]:
            table.add_row(row["category"], f"{row['dry_run_gib']:.3f}", _gib(row["model_gib"]),
                          "" if row["ratio"] is None else f"{row['ratio']:.2f}")
        console.print(table)
        comms = Table(title=f"rank {rank['rank']}: collectives of its last micro-batch and the "
                            f"step's end, bytes, dry run vs cost model")
        for column in ("kind", "dtype", "count", "dry run", "cost model", "ratio"):
            comms.add_column(column, justify="left" if column in ("kind", "dtype") else "right")
        for row in rank["collectives"]:
            comms.add_row(row["kind"], row["dtype"], str(row["count"]), _size(row["bytes"]),
                          _size(row["model_bytes"]), "" if row["ratio"] is None else f"{row['ratio']:.2f}")
        console.print(comms)
    console.print(f"{verdict(report)} (dry run on {report['device']}; {report['wall_s']:.0f} s)")
    if report.get("routing"):
        console.print(f"MoE routing: {report['routing']}")
    if not report["parameters_match"]:
        console.print(parameter_mismatch(report))


def parameter_mismatch(report: dict) -> str:
    """One line: which ranks hold a different number of parameter elements than the model
    has in their stages (a tie the runtime broke, a parameter dropped or duplicated)."""
    rows = [r for r in report["ranks"] if r["rank"] in report["parameter_mismatch_ranks"]]
    said = "; ".join(f"rank {r['rank']}: the runtime holds {r['parameters']['runtime']:,} "
                     f"parameters where the model has {r['parameters']['model']:,} "
                     f"(ratio {r['parameters']['runtime'] / max(1, r['parameters']['model']):.2f})"
                     for r in rows)
    return (f"the job does not train this model: {said}. A shared (tied) parameter came out "
            "as separate copies, or a parameter was dropped; this is a bug of autoplan's "
            "runtime, not of the plan.")


def budget_text(report: dict) -> str:
    """The plan's memory budget per GPU, in words: 72 GiB (80 GiB h100-sxm-80gb less 8 GiB of headroom)."""
    headroom = report["memory_headroom_gib"]
    kept = f" less {headroom:g} GiB of headroom" if headroom else ", no headroom kept"
    return (f"{report['budget_gib']:.1f} GiB ({report['gpu_memory_gib']:.0f} GiB {report['gpu']}"
            f"{kept})")


def verdict(report: dict) -> str:
    """Whether the worst rank fits in the plan's budget, and what is left of the headroom."""
    where = f"the worst rank ({report['worst_rank']})"
    if not report["fits"]:
        return (f"this job does not fit: {where} is {-report['spare_gib']:.1f} GiB over the plan's "
                f"budget of {budget_text(report)}")
    return (f"this job fits: {where} leaves {report['spare_gib']:.1f} GiB of the plan's budget of "
            f"{budget_text(report)}, and {report['spare_gib'] + report['memory_headroom_gib']:.1f} GiB "
            f"of the GPU free")


def _gib(value) -> str:
    return "" if value is None else f"{value:.3f}"


def _size(value) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front: 208.5 KiB, 14.96 GiB."""
    if value is None:
        return ""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


@click.command("check")
@click.argument("target", metavar="PLAN")
@click.argument("model", metavar="[MODEL]", required=False)
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Ranks dry-run side by side (one process each).")
@o.trust_plan_model_option
@o.json_option
@o.load_timeout_option
def command(target: str, model: str | None, workers: int, trust_plan_model: bool, as_json: bool) -> None:
    """Dry-run PLAN (a plan.json or a generated job directory) on autoplan's runtime at full
    size with fake tensors: memory per rank by category and collectives, beside the cost model.
    MODEL is the model the plan was made for (default: the one the plan names)."""
    report = check_plan(target, workers, model, trust_plan_model)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        render(report, Console())
    if not report["parameters_match"]:
        raise DryRunMismatch(parameter_mismatch(report))
    if not report["fits"]:
        raise NoFeasiblePlan(f"the dry run does not fit: {-report['spare_gib']:.1f} GiB over the "
                             f"plan's budget of {budget_text(report)}")
