"""`autoplan tune`: measure the best few plans on this cluster and rank them by measurement."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from autoplan.commands import options as o
from autoplan.commands.plan import plan_options, run_plan
from autoplan.errors import NoFeasiblePlan, UserError
from autoplan.files import write_output


@click.command("tune")
@o.model_argument
@plan_options
@click.option("--candidates", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Plans to measure: those predicted within the cost model's error of the fastest, then "
                   "the fastest of each other layout.")
@click.option("--steps", type=click.IntRange(3, 10_000), default=10, show_default=True,
              help="Optimizer steps per candidate (the first 2 are warm-up and not counted).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=1800.0, show_default=True,
              metavar="SECONDS", help="Give up on a candidate that has not finished after this long.")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Folder for the candidates' jobs, results.json and tuned.toml (default: tune/<model>-<gpus>x<gpu>).")
@o.json_option
def command(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom, global_batch,
            seq_len, image_size, objective, fix, precision, compile_blocks, time_limit, candidates, steps, timeout_s,
            output, as_json):
    """Run the best plans for MODEL here, each for a few steps, and rank them by measured step time.

    Start it on the cluster the plans are for: on one node it runs each candidate's launch.sh
    (torchrun); for several nodes, inside a SLURM allocation of that many nodes. A candidate that
    fails (out of memory, a crash, the timeout) is recorded with its reason and the others go on.
    tuned.toml is this cluster's hardware file fitted to the measured step times: pass it as
    --hardware to the next plan, estimate or report.
    """
    from autoplan.codegen.job import job_name, model_source
    from autoplan.models.sources import load_model
    from autoplan.solve.plan_build import to_plan
    from autoplan.solve.preference import equivalence_band
    from autoplan.tune.candidates import pick_candidates
    from autoplan.tune.launch import run_trial, write_trial
    from autoplan.tune.refit import write_refit

    job = run_plan(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom, global_batch,
                   seq_len, objective, fix, precision, top=max(8, 2 * candidates), quiet=True,
                   time_limit=time_limit, image_size=image_size, compile_blocks=compile_blocks)
    if job.plan is None:
        from autoplan.solve.explain import infeasible_report

        raise NoFeasiblePlan(infeasible_report(job))
    out = Path(output) if output else Path("tune") / job_name(job.plan)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} already holds files; give `autoplan tune` a new or empty folder with -o")
    loaded = load_model(model, seq_len=job.plan.seq_len) if job.plan.model.source == "file" else None
    source = model_source(model, job.plan.model.source, job.plan.model.name,
                          type(loaded.module).__name__ if loaded is not None else "")
    band = equivalence_band()
    chosen = pick_candidates(job.result, band, candidates)
    trials = []
    for index, candidate in enumerate(chosen, 1):
        plan = to_plan(candidate, job.graph, job.model, job.cluster)
        trial = write_trial(plan, source, out / f"candidate-{index}", f"autoplan tune {shlex.quote(model)} (candidate {index})")
        if not as_json:
            click.echo(f"candidate {index}/{len(chosen)}: {_layout(plan)}: running {steps} steps ...", err=True)
        trials.append(run_trial(trial, steps, timeout_s))
    factor, notes = write_refit(job.cluster, trials, out / "tuned.toml")
    results = _results(trials, band, factor, notes, out)
    write_output(out / "results.json", json.dumps(results, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        _render(results)


def _layout(plan) -> str:
    return (f"dp{plan.dp} tp{plan.tp} pp{plan.pp} cp{plan.cp} ep{plan.ep} z{plan.zero_stage} "
            f"mb{plan.micro_batch}" + (f" {plan.schedule}" if plan.pp > 1 else ""))


def _results(trials, band: float, factor: float | None, notes: list[str], out: Path) -> dict:
    rows = []
    for index, t in enumerate(trials, 1):
        measured = t.measured_step_s
        rows.append({"candidate": index, "job": str(t.job_dir), "layout": _layout(t.plan), "ok": t.ok,
                     "reason": t.reason, "predicted_step_s": t.predicted_step_s, "measured_step_s": measured,
                     "error": (t.predicted_step_s / measured - 1) if measured else None,
                     "predicted_memory_gib": t.plan.estimate.get("memory_gib_per_gpu"),
                     "measured_peak_memory_gib": t.measured.get("peak_memory_gib")})
    ranked = sorted((r for r in rows if r["ok"]), key=lambda r: r["measured_step_s"])
    return {"candidates": rows, "ranking": [r["candidate"] for r in ranked],
            "fastest_measured": ranked[0]["job"] if ranked else None, "band": band,
            "refit": {"factor": factor, "hardware_file": str(out / "tuned.toml") if factor else None,
                      "notes": notes}}


def _render(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="autoplan tune: measured on this cluster",
                  caption="error: predicted / measured step time - 1; rank: by measured step time")
    for header in ("#", "layout", "pred s", "meas s", "error", "pred GiB", "meas GiB", "rank / why not"):
        table.add_column(header, justify="left" if header in ("layout", "rank / why not") else "right",
                         no_wrap=header != "rank / why not", overflow="fold")
    rank = {c: i for i, c in enumerate(results["ranking"], 1)}
    for r in results["candidates"]:
        table.add_row(str(r["candidate"]), r["layout"], f"{r['predicted_step_s']:.3f}",
                      "-" if r["measured_step_s"] is None else f"{r['measured_step_s']:.3f}",
                      "-" if r["error"] is None else f"{r['error']:+.0%}",
                      "-" if r["predicted_memory_gib"] is None else f"{r['predicted_memory_gib']:.1f}",
                      "-" if r["measured_peak_memory_gib"] is None else f"{r['measured_peak_memory_gib']:.1f}",
                      str(rank[r["candidate"]]) if r["ok"] else f"failed: {r['reason']}")
    console = Console()
    console.print(table)
    refit = results["refit"]
    if results["fastest_measured"]:
        console.print(f"fastest measured: {results['fastest_measured']} (its launch.sh runs it)")
    if refit["factor"]:
        console.print(f"fitted hardware file: {refit['hardware_file']} (device fractions x {refit['factor']:.3f}); "
                      f"pass it as --hardware to the next plan on this cluster")
    for note in refit["notes"]:
        console.print(f"note: {note}")
