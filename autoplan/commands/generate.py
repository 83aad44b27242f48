"""`autoplan generate`: write a runnable, readable torchrun job directory for a plan."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from autoplan.codegen.exports import export_notes, parse_stack_versions
from autoplan.codegen.job import default_output_dir, model_source, render_job, write_job
from autoplan.codegen.launchers import LAUNCH_FILES, LAUNCHERS
from autoplan.commands import options as o
from autoplan.commands.plan import plan_options, run_plan
from autoplan.errors import NoFeasiblePlan, UserError
from autoplan.hardware import load_gpu, load_prices
from autoplan.planfile import does_not_fit, load_checked_plan, read_plan

# Options that choose a plan; with --plan the plan is already chosen.
_CHOOSING = ("hardware", "inter_node_bandwidth", "memory_headroom", "objective", "fix", "precision", "compile_blocks",
              "time_limit")


@click.command("generate")
@o.model_argument
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), default=None,
              help="Use this plan.json (from `autoplan plan -o`) instead of planning now.")
@plan_options
@click.option("-o", "--output", type=click.Path(), default=None,
              help="Job directory (default: generated/<model>-<gpus>x<gpu> here).")
@click.option("--force", is_flag=True, help="Write into a directory that already holds files.")
@click.option("--launcher", "launchers", multiple=True, type=click.Choice(LAUNCHERS),
              help="Also write the launch file of this launcher (repeatable): skypilot -> sky.yaml, "
                   "k8s -> pytorchjob.yaml (Kubeflow v1), trainjob -> trainjob.yaml (Kubeflow Trainer v2); torchrun "
                   "(launch.sh) and slurm (slurm.sbatch) are always written.")
@o.stack_version_option
@click.pass_context
@o.load_timeout_option
def command(ctx, model, plan_file, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom,
            global_batch, seq_len, image_size, objective, fix, precision, compile_blocks, time_limit, output, force,
            launchers, stack_versions):
    """Write train.py, launch.sh, slurm.sbatch, plan.json, README.md and the plan for torchtitan
    (torchtitan.toml), Megatron-LM (megatron.args) and DeepSpeed (ds_config.json) for MODEL.

    Either plan now (the options of `autoplan plan`) or take a plan file with --plan.
    """
    versions = parse_stack_versions(stack_versions)
    if output and Path(output).exists() and not Path(output).is_dir():
        raise UserError(f"output path {output} is a file, not a directory; give -o a directory "
                        "(new or empty) for the job")
    if plan_file:
        given = [name for name in _CHOOSING
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            opts = {param.name: param.opts[-1] for param in ctx.command.params}
            flags = " ".join(opts[name] for name in given)
            raise UserError(f"--plan takes the plan as it is, so {flags} would be ignored; drop them, "
                            "or plan again without --plan")
        given_plan = read_plan(plan_file)
        _check_plan_matches(given_plan, gpu, gpus, gpus_per_node, global_batch, seq_len)
        checked = load_checked_plan(plan_file, model)
        if not checked.estimate.feasible:
            raise NoFeasiblePlan(does_not_fit(checked.estimate, plan_file))
        plan, loaded = checked.plan, checked.loaded
        takes_images = loaded.takes_images
    else:
        if gpus is None or global_batch is None:
            raise UserError("give the cluster and batch to plan for (--gpu NAME --gpus N "
                            "--global-batch B, as for `autoplan plan`), or a plan file with --plan FILE")
        job = run_plan(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom,
                       global_batch, seq_len, objective, fix, precision, top=1, quiet=True,
                       time_limit=time_limit, image_size=image_size, compile_blocks=compile_blocks)
        if job.plan is None:
            from autoplan.solve.explain import infeasible_report

            raise NoFeasiblePlan(infeasible_report(job))
        plan = job.plan
        # torch's import (about 3 s) after the arguments' checks and the cluster's
        from autoplan.models.sources import load_model

        loaded = load_model(model, seq_len=plan.seq_len) if plan.model.source == "file" else None
        takes_images = (loaded or load_model(model, seq_len=seq_len)).takes_images  # a file loaded once
    _refuse_unscored_images(plan, takes_images, model)
    model_class = type(loaded.module).__name__ if loaded is not None else ""
    source = model_source(model, plan.model.source, plan.model.name, model_class)
    files = render_job(plan, source, command_line=_command_line(ctx, model, plan_file),
                       price=_price(plan.gpu), gpu_memory_gib=_gpu_memory_gib(plan.gpu),
                       launchers=tuple(dict.fromkeys(x for x in launchers if x in LAUNCH_FILES)),
                       versions=versions)
    out_dir = Path(output) if output else default_output_dir(plan)
    write_job(files, out_dir, force)
    click.echo(f"plan: dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} ep={plan.ep} "
               f"zero={plan.zero_stage} micro-batch={plan.micro_batch} {plan.precision}")
    click.echo(f"wrote {out_dir}/: {', '.join(sorted(files))}")
    click.echo(f"launch: {shlex.quote(str(out_dir))}/launch.sh --steps 100")
    _echo_export_notes(plan, versions)


def _echo_export_notes(plan, versions: dict[str, str]) -> None:
    """What the other stacks' files cannot express (also in each file's header), on stderr."""
    for name, notes in export_notes(plan, versions):
        click.echo(f"{name}: not expressible there, nearest setting written:", err=True)
        for note in notes:
            click.echo(f"  - {note}", err=True)


# gpus and global_batch are required by `plan`, but not with --plan; the help says so
for _param in command.params:
    if _param.name in ("gpus", "global_batch"):
        _param.required = False
        _param.help = _param.help.rstrip(".") + " (required unless --plan is given)."


def _refuse_unscored_images(plan, takes_images: bool, model: str) -> None:
    """The runtime trains an image model as a classifier: it needs (batch, classes) scores."""
    if takes_images and plan.inputs.get("kind") != "images":
        raise UserError(
            f"{model} takes images, but its output is not class scores of shape (batch, classes), "
            "and the generated job's runtime trains image models as classifiers (cross-entropy "
            "on synthetic labels), so no job is written. Return (batch, num_classes) scores from "
            "forward, or train it with your own loop using the plan's degrees."
        )


def _check_plan_matches(plan, gpu, gpus, gpus_per_node, global_batch, seq_len) -> None:
    """Options given next to --plan must agree with it (they describe the cluster you have)."""
    problems = []
    if gpus is not None and gpus != plan.world_size:
        problems.append(f"--gpus {gpus} but the plan is for a world size of {plan.world_size}")
    if gpus_per_node is not None and gpus_per_node != plan.gpus_per_node:
        problems.append(f"--gpus-per-node {gpus_per_node} but the plan has {plan.gpus_per_node}")
    if global_batch is not None and global_batch != plan.global_batch:
        problems.append(f"--global-batch {global_batch} but the plan has {plan.global_batch}")
    if seq_len is not None and seq_len != plan.seq_len:
        problems.append(f"--seq-len {seq_len} but the plan has {plan.seq_len}")
    if gpu:
        if load_gpu(gpu).key != plan.gpu:
            problems.append(f"--gpu {gpu} but the plan is for {plan.gpu}")
    if problems:
        raise UserError("the plan file does not match the options: " + "; ".join(problems)
                        + ". Make a plan for this cluster with `autoplan plan`, or drop the options")


def _command_line(ctx: click.Context, model: str, plan_file: str | None) -> str:
    """The generate command (without -o/--force), shell-quoted, for the job's README."""
    parts = ["autoplan", "generate", model]
    if plan_file:
        parts += ["--plan", plan_file]
    for param in ctx.command.params:
        if param.name in ("model", "plan_file", "output", "force"):
            continue
        if ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            parts += [param.opts[-1]] if value else []
            continue
        for item in value if isinstance(value, tuple) else (value,):
            parts += [param.opts[-1] if param.opts[-1].startswith("--") else param.opts[0], str(item)]
    return " ".join(shlex.quote(part) for part in parts)


def _price(gpu_key: str) -> tuple[float, str] | None:
    try:
        prices = load_prices()
        if not prices.has(gpu_key):
            return None
        entry = prices.entry(gpu_key)
    except UserError:
        return None
    return entry.usd_per_gpu_hour, f"{entry.source}, {entry.date}"


def _gpu_memory_gib(gpu_key: str) -> float | None:
    try:
        return load_gpu(gpu_key).memory_gib
    except UserError:
        return None
