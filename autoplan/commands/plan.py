"""`autoplan plan`: the fastest (or cheapest) plan, its estimate, runners-up and why."""

from __future__ import annotations

import json
from pathlib import Path

import click

from autoplan.codegen.exports import EXPORTS, parse_stack_versions, render_export
from autoplan.commands import options as o
from autoplan.errors import NoFeasiblePlan, UserError
from autoplan.hardware import resolve_cluster
from autoplan.importers import compare_with_option
from autoplan.planfile import write_plan

EXPORT_FORMATS = ("torchtitan", "megatron", "deepspeed")  # autoplan.codegen.exports.EXPORTS


def plan_options(func):
    """The options shared by `plan` and `generate`."""
    for option in reversed([
        o.gpu_option, o.hardware_option, o.gpus_option, o.gpus_per_node_option,
        o.inter_node_bandwidth_option, o.memory_headroom_option, o.global_batch_option, o.seq_len_option,
        o.image_size_option,
        click.option("--objective", type=click.Choice(["time", "cost"]), default="time", show_default=True,
                     help="Minimise step time, or cost per step."),
        o.fix_option, o.precision_option, o.compile_option, o.time_limit_option(),
    ]):
        func = option(func)
    return func


def run_plan(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom,
             global_batch, seq_len, objective, fix, precision, top, quiet, time_limit=None, image_size=None,
             compile_blocks=False):
    # before the planner's imports (torch, about 3 s): a mistyped GPU or count is answered at once
    cluster = resolve_cluster(gpu, hardware, gpus, gpus_per_node, memory_headroom, inter_node_bandwidth)
    from autoplan.solve.api import plan_job
    from autoplan.trace.load import load_graph, require_blocks
    from autoplan.solve.space import parse_fix

    fixed = parse_fix(fix)
    graph, ref, seq = load_graph(model, seq_len, image_size)
    require_blocks(graph, model)
    limit = {} if time_limit is None else {"time_limit_s": _positive_time_limit(time_limit)}
    limit["compile_blocks"] = compile_blocks
    if quiet:
        return plan_job(graph, ref, cluster, global_batch=global_batch, seq_len=seq, fixed=fixed,
                        precision=precision, objective=objective, top=top, **limit)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("searching plans", total=None)
        job = plan_job(graph, ref, cluster, global_batch=global_batch, seq_len=seq, fixed=fixed,
                       precision=precision, objective=objective, top=top, **limit,
                       progress=lambda done, total: progress.update(task, completed=done, total=total))
    return job


def _positive_time_limit(seconds: float) -> float:
    if not seconds > 0:
        raise UserError(f"--time-limit must be a positive number of seconds, got {seconds:g}")
    return seconds


@click.command("plan")
@o.model_argument
@plan_options
@o.top_option(3)
@o.json_option
@click.option("--format", "output_format", type=click.Choice(["text", "json", *EXPORT_FORMATS]), default="text",
              show_default=True, help="How to print the plan: text, json (as --json), or the configuration of "
              "another stack: torchtitan (TOML), megatron (arguments), deepspeed (JSON); what that stack cannot "
              "express goes to stderr and the file's header.")
@o.stack_version_option
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write plan.json here.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@compare_with_option
@o.load_timeout_option
def command(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom, global_batch,
            seq_len, image_size, objective, fix, precision, compile_blocks, time_limit, top, as_json, output_format,
            stack_versions, output, force, compare_with):
    """Find the provably best parallel plan for MODEL on a cluster and explain it."""
    if as_json and output_format not in ("text", "json"):
        raise UserError(f"--json and --format {output_format} ask for two outputs; give one of them")
    export = output_format if output_format in EXPORT_FORMATS else None
    versions = parse_stack_versions(stack_versions)
    as_json = as_json or output_format == "json"
    if output and Path(output).exists() and not force:
        raise UserError(f"{output} exists; pass --force to overwrite it or choose another -o path")
    job = run_plan(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom,
                   global_batch, seq_len, objective, fix, precision, top, quiet=as_json or export is not None,
                   time_limit=time_limit, image_size=image_size, compile_blocks=compile_blocks)
    from autoplan.solve.explain import explain, infeasible_report, job_json, render_job

    if job.plan is None:
        report = infeasible_report(job)
        if as_json:
            click.echo(json.dumps(job_json(job, []), indent=2))
        raise NoFeasiblePlan(report)
    explanation = explain(job)
    comparison = None
    if compare_with:
        from autoplan.importers.compare import compare_with_plan

        comparison = compare_with_plan(job, compare_with)
    if output:
        write_plan(job.plan, output)
    if export is not None:
        _echo_export(job.plan, export, versions)
        return
    if as_json:
        out = job_json(job, explanation)
        if comparison is not None:
            out["comparison"] = comparison
        click.echo(json.dumps(out, indent=2))
    else:
        from rich.console import Console

        render_job(job, explanation, Console())
        if comparison is not None:
            from autoplan.importers.compare import render_comparison

            render_comparison(comparison, Console())
        if output:
            click.echo(f"plan written to {output}")


def _echo_export(plan, name: str, versions: dict[str, str]) -> None:
    """The plan in another stack's format on stdout; what it cannot express on stderr."""
    export = EXPORTS[name]
    text, notes = render_export(plan, name, versions)
    click.echo(text, nl=False)
    for note in notes:
        click.echo(f"{export.file_name}: not expressible in {export.stack}: {note}", err=True)
