"""`autoplan validate RUNS.json`: predicted vs measured throughput and memory of published runs."""

from __future__ import annotations

import json

import click

from autoplan.commands.options import json_option
from autoplan.errors import UserError


# numeric columns and their widths: they keep them on a narrow terminal (a pipe is 80
# columns), where the run id folds and the assumptions column is left out
NUMBER_COLUMNS = (("pred t/s", 8), ("meas t/s", 8), ("error", 6), ("pred GiB", 8), ("meas GiB", 8))
ASSUMED_MIN_WIDTH = 24


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _runs_table(runs: list[dict], title: str, width: int):
    """(rich Table, whether the assumed column was left out for lack of width)."""
    from rich.table import Table

    numbers = sum(w for _, w in NUMBER_COLUMNS)
    run_width = min(max((len(r["id"]) for r in runs), default=3), 48)
    borders = 3 * (len(NUMBER_COLUMNS) + 2) + 1
    show_assumed = width - borders - numbers - run_width >= ASSUMED_MIN_WIDTH
    if not show_assumed:
        run_width = max(12, min(run_width, width - (borders - 3) - numbers))
    table = Table(title=title, caption="t/s: tokens/s per GPU; error: predicted / measured - 1")
    table.add_column("run", width=run_width, overflow="fold")
    for name, column_width in NUMBER_COLUMNS:
        table.add_column(name, justify="right", width=column_width, no_wrap=True)
    if show_assumed:
        table.add_column("assumed")
    for run in runs:
        if run.get("skipped"):
            table.add_row(run["id"], "skipped", "", "", "", "", *([run["skipped"]] if show_assumed else []))
            continue
        p, m, e = run["predicted"], run["measured"], run["error"]
        fits = "" if p["feasible"] else " OOM"
        cells = [run["id"], f"{p['tokens_per_s_per_gpu']:,.0f}",
                 f"{m['tokens_per_s_per_gpu']:,.0f}" if m["tokens_per_s_per_gpu"] else "-",
                 _pct(e.get("tokens_per_s_per_gpu")), f"{p['memory_gib_per_gpu']:.1f}{fits}",
                 f"{m['memory_gib_per_gpu']:.1f}" if m.get("memory_gib_per_gpu") else "-"]
        if show_assumed:
            cells.append(", ".join(f"{k}={v}" for k, v in run["assumed"].items()))
        table.add_row(*cells)
    return table, not show_assumed


def _cpu_estimate(plan_file) -> dict:
    """The plan's estimate on CPU ranks (cost_models/gpus/cpu.toml), for a CPU run of a GPU plan."""
    from autoplan.commands.estimate import estimate_plan_file

    return estimate_plan_file(str(plan_file), gpu="cpu")[0].to_dict()


@click.command("validate")
@click.argument("runs_file", metavar="[RUNS.json]", type=click.Path(dir_okay=False), required=False)
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
    from autoplan.validate.published import validate_file

    if run_dir:
        from autoplan.validate.measured import render_run, compare_run_dir

        report = compare_run_dir(run_dir, plan_path=plan_path, warmup=warmup, cpu_estimate=_cpu_estimate)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            from rich.console import Console

            render_run(report, Console())
        return
    if not runs_file:
        raise UserError("give RUNS.json (e.g. cost_models/validation/published_runs.json) or --run DIR")

    report = validate_file(runs_file)
    for problem in report["malformed"]:
        click.echo(f"warning: {problem}", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console

    console = Console()
    table, hidden = _runs_table(report["runs"], f"cost model vs {runs_file}", console.width)
    console.print(table)
    if hidden:
        console.print("(the assumed settings need a wider terminal, or --json)")
    s = report["summary"]
    console.print(
        f"{s['count']} runs, {s['skipped']} skipped, {s['predicted_infeasible']} predicted infeasible; "
        f"tokens/s/GPU error: median {_share(s['median_abs_rel_error'], '.1%')}, "
        f"max {_share(s['max_abs_rel_error'], '.1%')}, {_share(s['within_25pct_fraction'], '.0%')} within 25%; "
        f"memory error: median {_share(s['memory_median_abs_rel_error'], '.1%')} over {s['memory_compared']} runs")
    console.print(_family_table(report["by_family"]))


def _family_table(families: dict):
    """Accuracy per runtime family (cost_models/validation/runtime_families.toml)."""
    from rich.table import Table

    table = Table(title="by runtime family", caption="error: |predicted / measured - 1|")
    for name in ("family", "runs", "OOM", "t/s median", "within 25%", "GiB median", "GiB runs"):
        table.add_column(name, justify="left" if name == "family" else "right", no_wrap=True)
    for name, f in families.items():
        table.add_row(name, str(f["count"]), str(f["predicted_infeasible"]),
                      _share(f["median_abs_rel_error"], ".1%"), _share(f["within_25pct_fraction"], ".0%"),
                      _share(f["memory_median_abs_rel_error"], ".1%"), str(f["memory_compared"]))
    return table


def _share(value, spec: str) -> str:
    """A fraction as a percentage; "-" when no run had a measured value to compare."""
    return "-" if value is None else format(value, spec)
