"""`autoplan validate RUNS.json`: predicted vs measured throughput and memory of published runs."""

from __future__ import annotations

import json

import click

from autoplan.commands.options import json_option


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.0%}"


@click.command("validate")
@click.argument("runs_file", metavar="RUNS.json", type=click.Path(dir_okay=False), required=False)
@click.option("--run", "run_dir", type=click.Path(file_okay=False), default=None,
              help="A generated job's run directory (metrics.jsonl): measured vs predicted.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="With --run: the plan.json (default: found next to or above the run directory).")
@click.option("--warmup", type=int, default=None, help="With --run: steps to skip (default 2).")
@json_option
def command(runs_file: str | None, run_dir: str | None, plan_path: str | None, warmup: int | None,
            as_json: bool) -> None:
    """Estimate every run of RUNS.json (format of cost_models/validation/published_runs.json)
    and compare predicted with measured tokens/s per GPU and memory per GPU; or, with
    --run DIR, compare a generated job's measured steps with its plan's predictions.

    Settings a run leaves unstated (micro-batch, recomputation, ZeRO stage, sequence
    parallelism) take the best value under the cost model; the table says which.
    """
    from autoplan.errors import UserError
    from autoplan.validation import validate_file

    if run_dir:
        from autoplan.runs import render_run, validate_run

        report = validate_run(run_dir, plan_path=plan_path, warmup=warmup)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            from rich.console import Console

            render_run(report, Console())
        return
    if not runs_file:
        raise UserError("give RUNS.json (e.g. cost_models/validation/published_runs.json) or --run DIR")

    report = validate_file(runs_file)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"cost model vs {runs_file}")
    for name, justify in (("run", "left"), ("pred tok/s/GPU", "right"), ("meas tok/s/GPU", "right"),
                          ("error", "right"), ("pred GiB", "right"), ("meas GiB", "right"),
                          ("assumed", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "assumed")
    for run in report["runs"]:
        if run.get("skipped"):
            table.add_row(run["id"], "skipped", "", "", "", "", run["skipped"])
            continue
        p, m, e = run["predicted"], run["measured"], run["error"]
        fits = "" if p["feasible"] else " (OOM)"
        table.add_row(run["id"], f"{p['tokens_per_s_per_gpu']:,.0f}",
                      f"{m['tokens_per_s_per_gpu']:,.0f}" if m["tokens_per_s_per_gpu"] else "-",
                      _pct(e.get("tokens_per_s_per_gpu")), f"{p['memory_gib_per_gpu']:.1f}{fits}",
                      f"{m['memory_gib_per_gpu']:.1f}" if m.get("memory_gib_per_gpu") else "-",
                      ", ".join(f"{k}={v}" for k, v in run["assumed"].items()))
    console.print(table)
    s = report["summary"]
    console.print(
        f"{s['count']} runs, {s['skipped']} skipped, {s['predicted_infeasible']} predicted infeasible; "
        f"tokens/s/GPU error: median {s['median_abs_rel_error']:.1%}, max {s['max_abs_rel_error']:.1%}, "
        f"{s['within_25pct_fraction']:.0%} within 25%")
