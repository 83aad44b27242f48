"""`autoplan report`: time, GPU-hours and cost across GPU types and cluster sizes, with charts."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import click

from autoplan.commands import options as o
from autoplan.errors import NoFeasiblePlan, UserError
from autoplan.files import write_output
from autoplan.hardware import GB, load_hardware_file, load_prices, parse_price_options
from autoplan.report.arguments import check_positive, gpu_prices, parse_counts, parse_gpus, parse_tokens

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


def _sweep_gpus(gpu, hardware, gpus_per_node, inter_node_bandwidth):
    """(GPU list, GPUs per node, NIC GB/s) of the sweep: --gpu names, or the GPU of a --hardware file
    with its node size and NIC rate (the command line overrides either)."""
    if gpu and hardware:
        raise UserError("give either --gpu NAMES or --hardware FILE, not both: a hardware file describes one "
                        "GPU type (run the report once per file)")
    if not hardware:
        return parse_gpus(gpu), gpus_per_node, inter_node_bandwidth
    cluster = load_hardware_file(hardware)
    nic = cluster.inter_node_bandwidth_bytes_per_s / GB if inter_node_bandwidth is None else inter_node_bandwidth
    return [cluster.gpu], gpus_per_node or cluster.gpus_per_node, nic


def _check_priced_gpus_are_known(price_overrides: dict[str, float], gpu_list) -> None:
    """A --price for a GPU name autoplan does not know (a typo) would be ignored: say so instead.
    A known GPU outside this sweep may be priced (one set of --price flags for many sweeps)."""
    from autoplan.hardware import list_gpus

    names = {name for g in (*gpu_list, *list_gpus()) for name in (g.key, *g.aliases)}
    stray = sorted(key for key in price_overrides if key not in names)
    if stray:
        raise UserError(f"--price {stray[0]}=... names no GPU autoplan knows (this sweep plans "
                        f"{', '.join(g.key for g in gpu_list)}; `autoplan gpus` lists the names); fix the name")


def _run_sweep(model, tokens, seq_len, global_batch, gpu, hardware, gpus, gpus_per_node, fix, top, prices,
               precision, assumptions, error, price_list, budget, deadline, time_limit, memory_headroom,
               inter_node_bandwidth, show_progress, price_overrides):
    if not model or not (gpu or hardware) or not gpus or global_batch is None or tokens is None:
        raise UserError("a sweep needs MODEL, --tokens N, --gpu NAMES (or --hardware FILE), --gpus COUNTS and "
                        "--global-batch B (or give --plan plan.json for one plan in depth).")
    check_positive("--global-batch", global_batch)
    for name, value in (("--budget", budget), ("--deadline", deadline)):
        if value is not None:
            check_positive(name, value)
    if gpus_per_node is not None:
        check_positive("--gpus-per-node", gpus_per_node)
    if top < 0:
        raise UserError(f"--top must be zero or more runners-up, got {top}.")
    gpu_list, per_node, nic = _sweep_gpus(gpu, hardware, gpus_per_node, inter_node_bandwidth)
    _check_priced_gpus_are_known(price_overrides, gpu_list)
    counts = parse_counts(gpus)
    usd = gpu_prices(gpu_list, prices)  # every price before any work
    # the planner (torch, about 3 s) once the arguments above are known to be good
    from autoplan.report.sweep import run_sweep
    from autoplan.trace.load import load_graph, require_blocks
    from autoplan.solve.space import parse_fix

    fixed = parse_fix(fix)
    graph, ref, seq = load_graph(model, seq_len)  # traced once, reused for every cluster
    require_blocks(graph, model)
    kwargs = dict(seq_len=seq, global_batch=global_batch, tokens=tokens, prices=usd, precision=precision,
                  assumptions=assumptions, error=error, price_list=price_list, budget_usd=budget,
                  deadline_days=deadline, time_limit_s=time_limit, memory_headroom_gib=memory_headroom,
                  inter_node_bandwidth_gb_per_s=nic, gpus_per_node=per_node, fixed=fixed, top=top)
    if not show_progress:
        return run_sweep(graph, ref, gpu_list, counts, **kwargs)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("planning {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=len(gpu_list) * len(counts))
        return run_sweep(graph, ref, gpu_list, counts, **kwargs,
                         progress=lambda done, total, label: bar.update(task, completed=done, description=label))


# options that describe the clusters of a sweep; a plan file carries its own
_SWEEP_ONLY = ("gpu", "hardware", "gpus", "gpus_per_node", "global_batch", "seq_len", "fix", "top",
               "precision", "memory_headroom", "inter_node_bandwidth", "time_limit", "budget", "deadline")


@click.command("report")
@click.argument("model", metavar="[MODEL]", required=False)
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), default=None,
              help="Report one plan file (from `autoplan plan -o`) in depth instead of a sweep.")
@click.option("--tokens", default=None,
              help="Total training tokens, e.g. 2T, 300B, 1.5e12 (required for a sweep; with --plan, "
                   "default: one optimizer step).")
@o.seq_len_option
@o.global_batch_unless_plan_option
@o.gpu_list_option
@o.hardware_option
@click.option("--gpus", default=None, help="GPU counts separated by commas, e.g. 64,128,256 (required unless "
                                           "--plan is given).")
@o.gpus_per_node_option
@o.fix_option
@o.top_option(0, per_cluster=True)
@click.option("--price", multiple=True, metavar="GPU=USD",
              help="USD per GPU-hour for a GPU (repeatable); overrides the price list.")
@click.option("--price-list", default="default", show_default=True, help="Price list in cost_models/prices/.")
@click.option("--budget", type=float, default=None, help="Budget in USD: recommend the fastest run within it.")
@click.option("--deadline", type=float, default=None, help="Deadline in days: recommend the cheapest run within it.")
@o.precision_option
@click.option("--failure-rate", type=float, default=None,
              help="Interruptions per GPU-hour (default 1.97e-5: Llama 3, 419 in 54 days on 16,384 GPUs).")
@click.option("--checkpoint-gb-per-s", type=float, default=None,
              help="Checkpoint write bandwidth per GPU in GB/s (default 0.122: Llama 3 storage, 2 TB/s / 16,384 GPUs).")
@click.option("--restart-minutes", type=float, default=None, help="Time to restart after an interruption (default 10).")
@o.time_limit_option(per_cluster=True)
@o.memory_headroom_option
@o.inter_node_bandwidth_option
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="terminal (default), md, html or json; with -o the file suffix decides when not given.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the report here.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@o.trust_plan_model_option
@click.pass_context
@o.load_timeout_option
def command(ctx, model, plan_file, tokens, seq_len, global_batch, gpu, hardware, gpus, gpus_per_node, fix, top,
            price, price_list, budget, deadline, precision, failure_rate, checkpoint_gb_per_s, restart_minutes,
            time_limit, memory_headroom, inter_node_bandwidth, fmt, output, force, trust_plan_model):
    """Plan MODEL on every GPU type and count and compare time to train, GPU-hours and cost.

    For each cluster: the best plan, step time, time to train --tokens (with checkpoints,
    interruptions and restarts), GPU-hours, cost, MFU, memory headroom, or why nothing fits;
    the Pareto frontier of time vs cost and a recommendation per objective. With --plan, one
    plan in depth: memory per stage, step-time breakdown, pipeline timeline (of MODEL when
    given, else of the model the plan names).
    """
    from autoplan.report.accuracy import published_runs_error

    fmt = _format(fmt, output)
    out = Path(output) if output else None
    if out and fmt != "md":  # Markdown checks its chart files too, in write_markdown
        from autoplan.report.render_files import check_writable

        check_writable([out], force)
    n_tokens = parse_tokens(tokens) if tokens is not None else None
    prices = load_prices(parse_price_options(price), price_list)
    assumptions = _assumptions(failure_rate, checkpoint_gb_per_s, restart_minutes)
    error = published_runs_error()  # the one error source (accuracy.ErrorBand); a calibration may supply another
    if plan_file:
        from autoplan.report.document import load_plan_detail, plan_dict

        given = [name for name in _SWEEP_ONLY
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise UserError(f"--plan reports one plan file with its own model and cluster; leave out {flags} "
                            "(or drop --plan to sweep clusters).")
        detail = load_plan_detail(plan_file, tokens=n_tokens, prices=prices, assumptions=assumptions, error=error,
                                  model=model, trust_plan_model=trust_plan_model)
        n_tokens = detail.run.steps * detail.plan.global_batch * detail.plan.seq_len if n_tokens is None \
            else n_tokens
        sweep = None
        doc = plan_dict(detail, tokens=n_tokens, assumptions=assumptions, error=error, price_list=prices.name)
    else:
        show = fmt != "json" and sys.stderr.isatty()
        sweep = _run_sweep(model, n_tokens, seq_len, global_batch, gpu, hardware, gpus, gpus_per_node, fix, top,
                           prices, precision, assumptions, error, prices.name, budget, deadline, time_limit,
                           memory_headroom, inter_node_bandwidth, show, parse_price_options(price))
        from autoplan.report.document import fastest_detail, sweep_dict

        detail = fastest_detail(sweep)
        doc = sweep_dict(sweep)
    _emit(doc, fmt, out, force, sweep, detail)
    if sweep is not None and detail is None:  # the document says why for each cluster
        first = doc["rows"][0]
        raise NoFeasiblePlan(f"no plan fits on any of the {len(doc['rows'])} clusters of this sweep; "
                             f"{first['label']}: {first['reason']} (each row says why); sweep larger counts with "
                             "--gpus, or GPUs with more memory with --gpu")


def _emit(doc, fmt, out, force, sweep, detail) -> None:
    if fmt in ("html", "md"):  # charts: matplotlib, imported only for the formats that draw
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
            handle = io.StringIO()
            print_report(doc, Console(file=handle, width=160, force_terminal=False))
            write_output(out, handle.getvalue())
            click.echo(f"report written to {out}")
        else:
            print_report(doc, Console())
        return
    if out:
        write_output(out, text)
        click.echo(f"report written to {out}")
    else:
        click.echo(text, nl=False)
