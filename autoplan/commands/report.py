"""`autoplan report`: time, GPU-hours and cost across GPU types and cluster sizes, with charts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from autoplan.commands import options as o
from autoplan.errors import UserError

FORMATS = ("terminal", "md", "html", "json")
SUFFIX_FORMATS = {".md": "md", ".markdown": "md", ".html": "html", ".htm": "html", ".json": "json",
                  ".txt": "terminal"}


def _format(fmt: str | None, output: str | None) -> str:
    if fmt:
        return fmt
    if output is None:
        return "terminal"
    suffix = Path(output).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise UserError(f"cannot tell the report format from '{output}'; pass --format {'|'.join(FORMATS)}")
    return SUFFIX_FORMATS[suffix]


def _assumptions(failure_rate, checkpoint_gb_per_s, restart_minutes):
    from autoplan.report.goodput import GoodputAssumptions
    from autoplan.report.sweep import check_positive

    base = GoodputAssumptions()
    for name, value in (("--failure-rate", failure_rate), ("--checkpoint-gb-per-s", checkpoint_gb_per_s)):
        if value is not None:
            check_positive(name, value)
    if restart_minutes is not None and restart_minutes < 0:
        raise UserError(f"--restart-minutes must be zero or more, got {restart_minutes}.")
    return GoodputAssumptions(
        failures_per_gpu_hour=base.failures_per_gpu_hour if failure_rate is None else failure_rate,
        checkpoint_write_bytes_per_s_per_gpu=base.checkpoint_write_bytes_per_s_per_gpu
        if checkpoint_gb_per_s is None else checkpoint_gb_per_s * 1e9,
        restart_s=base.restart_s if restart_minutes is None else restart_minutes * 60.0)


def _run_sweep(model, tokens, seq_len, global_batch, gpu, gpus, prices, precision, assumptions, error,
               price_list, budget, deadline, time_limit, memory_headroom, inter_node_bandwidth, show_progress):
    from autoplan.report.sweep import check_positive, gpu_prices, parse_counts, parse_gpus, run_sweep
    from autoplan.solve.api import load_graph

    if not model or not gpu or not gpus or global_batch is None:
        raise UserError("a sweep needs MODEL, --gpu NAMES, --gpus COUNTS and --global-batch "
                        "(or give --plan plan.json for one plan in depth).")
    check_positive("--global-batch", global_batch)
    for name, value in (("--budget", budget), ("--deadline", deadline)):
        if value is not None:
            check_positive(name, value)
    gpu_list, counts = parse_gpus(gpu), parse_counts(gpus)
    usd = gpu_prices(gpu_list, prices)  # every price before any work
    graph, ref, seq = load_graph(model, seq_len)  # traced once, reused for every cluster
    kwargs = dict(seq_len=seq, global_batch=global_batch, tokens=tokens, prices=usd, precision=precision,
                  assumptions=assumptions, error=error, price_list=price_list, budget_usd=budget,
                  deadline_days=deadline, time_limit_s=time_limit, memory_headroom_gib=memory_headroom,
                  inter_node_bandwidth_gb_per_s=inter_node_bandwidth)
    if not show_progress:
        return run_sweep(graph, ref, gpu_list, counts, **kwargs)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("planning {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=len(gpu_list) * len(counts))
        return run_sweep(graph, ref, gpu_list, counts, **kwargs,
                         progress=lambda done, total, label: bar.update(task, completed=done, description=label))


@click.command("report")
@click.argument("model", metavar="[MODEL]", required=False)
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), default=None,
              help="Report one plan file (from `autoplan plan -o`) in depth instead of a sweep.")
@click.option("--tokens", required=True, help="Total training tokens, e.g. 2T, 300B, 1.5e12.")
@o.seq_len_option
@click.option("--global-batch", type=int, default=None, help="Global batch in sequences per optimizer step.")
@click.option("--gpu", default=None, help="GPU types separated by commas, e.g. h100,a100-sxm4-80gb,mi300x.")
@click.option("--gpus", default=None, help="GPU counts separated by commas, e.g. 64,128,256.")
@click.option("--price", multiple=True, metavar="GPU=USD",
              help="USD per GPU-hour for a GPU (repeatable); overrides the price list.")
@click.option("--price-list", default="default", show_default=True, help="Price list in cost_models/prices/.")
@click.option("--budget", type=float, default=None, help="Budget in USD: recommend the fastest run within it.")
@click.option("--deadline", type=float, default=None, help="Deadline in days: recommend the cheapest run within it.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16", "fp16", "fp8"]), default="bf16",
              show_default=True, help="Training precision; auto lets the solver pick bf16 or fp8.")
@click.option("--failure-rate", type=float, default=None,
              help="Interruptions per GPU-hour (default 1.97e-5: Llama 3, 419 in 54 days on 16,384 GPUs).")
@click.option("--checkpoint-gb-per-s", type=float, default=None,
              help="Checkpoint write bandwidth per GPU in GB/s (default 0.122: Llama 3 storage, 2 TB/s / 16,384 GPUs).")
@click.option("--restart-minutes", type=float, default=None, help="Time to restart after an interruption (default 10).")
@click.option("--time-limit", type=float, default=None, help="Search time limit per cluster in seconds.")
@o.memory_headroom_option
@o.inter_node_bandwidth_option
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="terminal (default), md, html or json; with -o the file suffix decides when not given.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the report here.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
def command(model, plan_file, tokens, seq_len, global_batch, gpu, gpus, price, price_list, budget, deadline,
            precision, failure_rate, checkpoint_gb_per_s, restart_minutes, time_limit, memory_headroom,
            inter_node_bandwidth, fmt, output, force):
    """Plan MODEL on every GPU type and count and compare time to train, GPU-hours and cost.

    For each cluster: the best plan, step time, time to train --tokens (with checkpoints,
    interruptions and restarts), GPU-hours, cost, MFU, memory headroom, or why nothing fits;
    the Pareto frontier of time vs cost and a recommendation per objective. With --plan, one
    plan in depth: memory per stage, step-time breakdown, pipeline timeline.
    """
    from autoplan.hardware import load_prices, parse_price_options
    from autoplan.report.accuracy import published_runs_error
    from autoplan.report.sweep import parse_tokens

    fmt = _format(fmt, output)
    out = Path(output) if output else None
    if out and fmt != "md":  # Markdown checks its chart files too, in write_markdown
        from autoplan.report.render_files import check_writable

        check_writable([out], force)
    n_tokens = parse_tokens(tokens)
    prices = load_prices(parse_price_options(price), price_list)
    assumptions = _assumptions(failure_rate, checkpoint_gb_per_s, restart_minutes)
    error = published_runs_error()  # the error source; a calibration can replace it (issue 8)
    if plan_file:
        from autoplan.report.document import load_plan_detail, plan_dict

        if model or gpu or gpus or memory_headroom or inter_node_bandwidth is not None:
            raise UserError("--plan reports one plan file; leave out MODEL, --gpu, --gpus, --memory-headroom and "
                            "--inter-node-bandwidth (or drop --plan to sweep clusters).")

        detail = load_plan_detail(plan_file, tokens=n_tokens, prices=prices, assumptions=assumptions, error=error)
        sweep = None
        doc = plan_dict(detail, tokens=n_tokens, assumptions=assumptions, error=error, price_list=prices.name)
    else:
        from autoplan.report.document import fastest_detail, sweep_dict

        show = fmt != "json" and sys.stderr.isatty()
        sweep = _run_sweep(model, n_tokens, seq_len, global_batch, gpu, gpus, prices, precision, assumptions,
                           error, prices.name, budget, deadline, time_limit, memory_headroom,
                           inter_node_bandwidth, show)
        detail = fastest_detail(sweep)
        doc = sweep_dict(sweep)
    _emit(doc, fmt, out, force, sweep, detail)


def _emit(doc, fmt, out, force, sweep, detail) -> None:
    from autoplan.report import render_files as rf

    if fmt == "json":
        text = json.dumps(doc, indent=2) + "\n"
    elif fmt == "html":
        text = rf.render_html(doc, rf.render_charts(sweep, detail))
    elif fmt == "md":
        charts = rf.render_charts(sweep, detail)
        if out:
            written = rf.write_markdown(out, doc, charts, force)
            click.echo(f"report written to {written[0]} with {len(written) - 1} chart files beside it")
            return
        text = rf.render_markdown(doc, {name: f"{name}.svg" for name in charts})
        click.echo("note: the chart images are written only with -o FILE.md", err=True)
    else:
        from rich.console import Console

        from autoplan.report.render_terminal import print_report

        if out:
            with out.open("w") as handle:
                print_report(doc, Console(file=handle, width=160, force_terminal=False))
            click.echo(f"report written to {out}")
        else:
            print_report(doc, Console())
        return
    if out:
        out.write_text(text)
        click.echo(f"report written to {out}")
    else:
        click.echo(text, nl=False)
