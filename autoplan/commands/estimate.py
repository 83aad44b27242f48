"""`autoplan estimate`: step time, throughput, MFU and per-GPU memory of one configuration."""

from __future__ import annotations

import json

import click

from autoplan.commands import options as o
from autoplan.config import OFFLOAD, PRECISIONS, RECOMPUTE, SCHEDULES, ParallelConfig
from autoplan.errors import NoFeasiblePlan, UserError
from autoplan.limits import MAX_GLOBAL_BATCH
from autoplan.hardware import resolve_cluster
from autoplan.importers import chosen_import, import_options
from autoplan.trace.load import load_graph


def config_from_options(gpus: int, dp: int | None, tp: int, pp: int, cp: int, ep: int, zero: int,
                        offload: str, micro_batch: int, global_batch: int, seq_len: int,
                        recompute: str, schedule: str | None, vpp: int, precision: str,
                        sequence_parallel: bool, compile_blocks: bool = False) -> ParallelConfig:
    """ParallelConfig from the command line; dp defaults to N / (tp x pp x cp) when it divides."""
    for name, value in (("--tp", tp), ("--pp", pp), ("--cp", cp), ("--ep", ep), ("--vpp", vpp),
                        ("--micro-batch", micro_batch), ("--global-batch", global_batch)):
        if value is None or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value}")
    if dp is None:
        model_parallel = tp * pp * cp
        if gpus % model_parallel:
            raise UserError(f"tp x pp x cp = {tp} x {pp} x {cp} = {model_parallel} does not divide "
                            f"--gpus {gpus}; choose degrees whose product divides the GPU count")
        dp = gpus // model_parallel
    if schedule is None:
        schedule = "interleaved-1f1b" if vpp > 1 else "1f1b"
    return ParallelConfig(global_batch=global_batch, seq_len=seq_len, dp=dp, tp=tp, pp=pp, cp=cp,
                          ep=ep, zero_stage=zero, offload=offload, micro_batch=micro_batch,
                          recompute=recompute, schedule=schedule, vpp=vpp, precision=precision,
                          sequence_parallel=sequence_parallel and tp > 1, compile=compile_blocks)


def estimate_plan_file(path: str, gpu: str | None = None, model: str | None = None,
                       trust_plan_model: bool = False):
    """Estimate of a plan.json with its own stages and per-block recomputation (recomputed; on
    `gpu` instead of the plan's GPU when given, in nodes of the plan's size), for MODEL when
    given, else the model the plan names."""
    from autoplan.planfile import load_checked_plan

    checked = load_checked_plan(path, model, gpu=gpu, trust_plan_model=trust_plan_model)
    return checked.estimate, checked.plan


def render(est, console) -> None:
    """A readable breakdown of one Estimate."""
    from rich.table import Table

    status = "[green]fits[/green]" if est.feasible else f"[red]does not fit[/red]: {est.reason}"
    console.print(f"Configuration {status}")
    summary = Table(show_header=False, box=None)
    rows = [("step time", f"{est.step_time_s:.3f} s"),
            ("tokens/s", f"{est.tokens_per_s:,.0f}  ({est.tokens_per_s_per_gpu:,.0f} per GPU)"),
            ("MFU / HFU", f"{est.mfu:.1%} / {est.hfu:.1%}  ({est.tflops_per_gpu:.0f} TFLOP/s per GPU "
                          f"of {est.peak_flops_per_gpu / 1e12:.0f} peak)"),
            ("pipeline bubble", f"{est.bubble_fraction:.1%} of the step"),
            ("memory per GPU", f"{est.memory_gib_per_gpu:.1f} GiB (worst stage {est.worst_rank_stage})")]
    if est.host_memory_gib_per_gpu:
        rows.append(("host memory (CPU offload)", f"{est.host_memory_gib_per_gpu:.1f} GiB per GPU, "
                                                  f"{est.host_memory_gib_per_node:.1f} GiB per node"))
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
    table = Table(title="where the memory goes (GiB, worst rank)")
    for key in est.memory_breakdown_gib:
        table.add_column(key, justify="right")
    table.add_row(*(f"{v:.2f}" for v in est.memory_breakdown_gib.values()))
    console.print(table)
    table = Table(title="where the step time goes (s)")
    for key in est.time_breakdown_s:
        table.add_column(key, justify="right")
    table.add_row(*(f"{v:.3f}" for v in est.time_breakdown_s.values()))
    console.print(table)
    if est.comm_breakdown_s:
        table = Table(title="exposed communication per step (s)")
        for key in est.comm_breakdown_s:
            table.add_column(key, justify="right")
        table.add_row(*(f"{v:.3f}" for v in est.comm_breakdown_s.values()))
        console.print(table)


@click.command("estimate")
@click.argument("model", metavar="MODEL", required=False)
@o.gpu_option
@o.hardware_option
@o.gpus_unless_plan_option
@o.gpus_per_node_option
@o.inter_node_bandwidth_option
@o.memory_headroom_option
@click.option("--dp", type=int, default=None, help="Data-parallel degree (default: N / (tp x pp x cp)).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel degree.")
@click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel degree.")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel degree (carved from dp x cp).")
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True, help="ZeRO stage.")
@click.option("--offload", type=click.Choice(OFFLOAD), default="none", show_default=True,
              help="What is kept in host memory instead of the GPU's: the optimizer state (DeepSpeed "
                   "ZeRO-Offload), the parameters, or both (FSDP2's CPUOffloadPolicy, which moves "
                   "parameters, gradients and the optimizer step together; parameters and both need "
                   "--zero 2 or 3). The estimate then reports host memory per GPU and per node and "
                   "an 'offload' share of the step time.")
@click.option("--micro-batch", type=int, default=1, show_default=True, help="Sequences per micro-batch.")
@click.option("--global-batch", type=int, default=None, callback=o.at_most(MAX_GLOBAL_BATCH),
              help="Global batch in sequences per optimizer step (required unless --plan or an imported "
                   "configuration gives it).")
@o.seq_len_option
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="none", show_default=True,
              help="Activation recomputation of every block: none, selective (attention only) or full.")
@click.option("--schedule", type=click.Choice(SCHEDULES), default=None,
              help="Pipeline schedule (default 1f1b, interleaved-1f1b with --vpp > 1).")
@click.option("--vpp", type=int, default=1, show_default=True, help="Virtual stages per rank (interleaved).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True,
              help="Training precision of this configuration.")
@click.option("--sequence-parallel/--no-sequence-parallel", default=True, show_default=True,
              help="Megatron sequence parallelism with TP.")
@o.compile_option
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Estimate a plan.json (its config, stages and per-block recomputation) for MODEL, "
                   "or for the model the plan names when MODEL is left out.")
@o.trust_plan_model_option
@import_options
@o.json_option
@o.load_timeout_option
def command(model, gpu, hardware, gpus, gpus_per_node, inter_node_bandwidth, memory_headroom, dp, tp, pp, cp, ep,
            zero, offload, micro_batch, global_batch, seq_len, recompute, schedule, vpp, precision,
            sequence_parallel, compile_blocks, plan_path, trust_plan_model, from_deepspeed, from_megatron, from_torchtitan, as_json) -> None:
    """Predict step time, tokens/s, MFU and memory per GPU of MODEL under one configuration
    (given by the options, a plan.json, or your DeepSpeed / Megatron-LM / torchtitan config)."""
    chosen = chosen_import(from_deepspeed, from_megatron, from_torchtitan)
    imported = None
    if chosen:
        if plan_path or dp or tp != 1 or pp != 1 or cp != 1 or ep != 1 or zero or vpp != 1 \
                or recompute != "none" or compile_blocks:
            raise UserError("--from-deepspeed/--from-megatron/--from-torchtitan gives the configuration; "
                            "drop --plan and the --dp/--tp/--pp/--cp/--ep/--zero/--vpp/--recompute/--compile "
                            "options")
        if not model or gpus is None:
            raise UserError("give MODEL and --gpus N with an imported configuration")
        from autoplan.importers.compare import estimate_imported_model

        cluster = resolve_cluster(gpu, hardware, gpus, gpus_per_node, memory_headroom, inter_node_bandwidth)
        est, imported = estimate_imported_model(model, cluster, *chosen, global_batch=global_batch,
                                                seq_len=seq_len)
    elif plan_path:
        if memory_headroom or inter_node_bandwidth is not None:
            raise UserError("--plan takes the plan's own cluster (--memory-headroom, --inter-node-bandwidth); "
                            "drop them, or plan again")
        if compile_blocks:
            raise UserError("--plan takes the plan's own torch.compile choice (its \"compile\" key); drop "
                            "--compile, or plan again with it")
        est, _ = estimate_plan_file(plan_path, model=model, trust_plan_model=trust_plan_model)
    else:
        if not model:
            raise UserError("give MODEL (a catalog name, config.json or model.py), or --plan plan.json")
        if gpus is None:
            raise UserError("give the number of GPUs with --gpus N")
        if global_batch is None:
            raise UserError("give the global batch in sequences with --global-batch G")
        cluster = resolve_cluster(gpu, hardware, gpus, gpus_per_node, memory_headroom, inter_node_bandwidth)
        from autoplan.cost import estimate  # after the cluster: a mistyped GPU is answered without torch

        graph, _, seq = load_graph(model, seq_len)
        config = config_from_options(gpus, dp, tp, pp, cp, ep, zero, offload, micro_batch,
                                     global_batch, seq, recompute, schedule, vpp, precision,
                                     sequence_parallel, compile_blocks)
        est = estimate(graph, config, cluster)
    _output(est, imported, as_json)
    if not est.feasible:  # "nothing fits" is exit status 1, as for `autoplan plan`
        raise NoFeasiblePlan(f"the configuration does not fit: {est.reason}")


def _output(est, imported, as_json: bool) -> None:
    if as_json:
        out = est.to_dict()
        if imported is not None:
            out["imported"] = imported.to_dict()
        click.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console

    if imported is not None:
        from autoplan.importers import render_imported

        render_imported(imported, Console())
    render(est, Console())
