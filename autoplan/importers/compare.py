"""Estimate an imported configuration, and set it next to autoplan's best plan (`--compare-with`)."""

from __future__ import annotations

from typing import Any

from autoplan.cost import estimate
from autoplan.importers import load_imported, parse_compare_with
from autoplan.trace.load import load_graph

_ROWS = (("step time (s)", "step_time_s", "{:.3f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
         ("MFU", "mfu", "{:.1%}"), ("memory per GPU (GiB)", "memory_gib_per_gpu", "{:.1f}"))
_KNOBS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "offload", "micro_batch", "schedule", "vpp", "recompute",
          "precision", "sequence_parallel")


def estimate_imported(graph, cluster, kind: str, value: str, *, global_batch: int | None = None):
    """(Estimate, ImportedConfig) of the user's configuration on `graph` (traced) and `cluster`."""
    imported = load_imported(kind, value, num_gpus=cluster.num_gpus, global_batch=global_batch,
                             seq_len=graph.seq_len)
    config = imported.for_graph(graph)
    return estimate(graph, config, cluster), imported


def estimate_imported_model(model: str, cluster, kind: str, value: str, *, global_batch: int | None = None,
                            seq_len: int | None = None):
    """(Estimate, ImportedConfig) of MODEL under the user's configuration: what `estimate --from-*` prints.

    The model is traced at --seq-len, else the file's sequence length, else the model's default.
    """
    imported = load_imported(kind, value, num_gpus=cluster.num_gpus, global_batch=global_batch, seq_len=seq_len)
    graph, _, _ = load_graph(model, imported.seq_len)
    return estimate(graph, imported.for_graph(graph), cluster), imported


def compare_with_plan(job, compare_with: str) -> dict[str, Any]:
    """The user's configuration (KIND=VALUE) next to the best plan of a `plan_job` result.

    Both are estimated by the same cost model on the same graph and cluster, with the plan's
    global batch and sequence length; gain = user step time / plan step time.
    """
    kind, value = parse_compare_with(compare_with)
    est, imported = estimate_imported(job.graph, job.cluster, kind, value, global_batch=job.request.global_batch)
    best = job.plan.estimate if job.plan is not None else {}
    user = est.to_dict()
    gain = None
    if best.get("step_time_s") and est.feasible:
        gain = est.step_time_s / best["step_time_s"]
    if job.plan is not None:
        plan = job.plan
        modes = sorted(set(plan.recompute.values())) or ["none"]
        best = dict(best, config={**{k: getattr(plan, k) for k in _KNOBS if hasattr(plan, k)},
                                  "recompute": "/".join(modes)})
    return {"source": imported.source, "imported": imported.to_dict(), "yours": user, "autoplan": best,
            "speedup": gain, "yours_feasible": est.feasible, "yours_reason": est.reason}


def render_comparison(comparison: dict[str, Any], console) -> None:
    """Your configuration | autoplan's plan, with the predicted gain and what was not modelled."""
    from rich.table import Table

    yours, best = comparison["yours"], comparison["autoplan"]
    table = Table(title=f"your configuration ({comparison['source']}) vs autoplan's plan")
    for name in ("", "yours", "autoplan"):
        table.add_column(name, justify="left" if not name else "right")
    for knob in _KNOBS:
        a, b = yours.get("config", {}).get(knob), best.get("config", {}).get(knob)
        table.add_row(knob, str(a), str(b) if b is not None else "-")
    for label, key, fmt in _ROWS:
        a, b = yours.get(key), best.get(key)
        table.add_row(label, fmt.format(a) if a is not None else "-", fmt.format(b) if b is not None else "-")
    console.print(table)
    if not comparison["yours_feasible"]:
        console.print(f"[red]your configuration does not fit[/red]: {comparison['yours_reason']}")
    elif comparison["speedup"] is not None:
        console.print(f"predicted gain: autoplan's plan is {comparison['speedup']:.2f}x the speed of yours "
                      f"({1 - 1 / comparison['speedup']:.0%} less step time)" if comparison["speedup"] >= 1 else
                      f"predicted: your configuration is {1 / comparison['speedup']:.2f}x faster than the plan found "
                      "(the search space may exclude something yours uses; see the notes)")
    imported = comparison["imported"]
    for note in imported["notes"]:
        console.print(f"  note: {note}")
    for item in imported["unsupported"]:
        console.print(f"  [yellow]not modelled[/yellow]: {item}")
