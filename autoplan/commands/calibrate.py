"""`autoplan calibrate`: measure the machines it runs on (under torchrun) and write a hardware file."""

from __future__ import annotations

import json

import click

from autoplan.commands.options import load_timeout_option
from autoplan.errors import UserError
from autoplan.hardware import GB, TFLOPS


def gemm_shapes_of(model: str, seq_len: int | None) -> tuple[tuple[int, int, int], ...]:
    """Distinct (m, n, k) of the matmul-like ops of MODEL traced at batch 1 (no TP split)."""
    from autoplan.trace.load import load_graph

    graph, _, _ = load_graph(model, seq_len)
    shapes = {(m, n, k) for seg in (graph.pre, *graph.blocks, graph.post) for m, n, k, _ in seg.gemm_shapes}
    if not shapes:
        raise UserError(f"the model {model} has no matmul-like ops to calibrate; use the standard shapes "
                        "(omit --model)")
    return tuple(sorted(shapes, key=lambda s: s[0] * s[1] * s[2]))


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return choice


def _render(result, path, cluster) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"matmul on {result.device_name} (slowest rank)")
    for name in ("dtype", "shapes", "best TFLOP/s", "at m x n x k"):
        table.add_column(name, justify="right" if name != "dtype" else "left")
    for dtype in dict.fromkeys(p.dtype for p in result.matmul):
        pts = [p for p in result.matmul if p.dtype == dtype]
        best = max(pts, key=lambda p: p.flops_per_s)
        table.add_row(dtype, str(len(pts)), f"{best.flops_per_s / TFLOPS:.3f}", f"{best.m}x{best.n}x{best.k}")
    console.print(table)
    if result.copy_bytes_per_s:
        console.print(f"memory copy: {result.copy_bytes_per_s / GB:.2f} GB/s")
    fits = result.fits()
    if fits:
        table = Table(title="collectives: t = alpha + F*S/busbw (nccl-tests convention)")
        for name in ("scope", "collective", "ranks", "alpha (us)", "busbw (GB/s)"):
            table.add_column(name, justify="left" if name in ("scope", "collective") else "right")
        for (scope, op), fit in fits.items():
            table.add_row(scope, op, str(fit.group_size), f"{fit.alpha_s * 1e6:,.1f}",
                          f"{fit.busbw_bytes_per_s / GB:.3f}")
        console.print(table)
    for item in result.not_measured:
        console.print(f"[yellow]not measured[/yellow]: {item}")
    console.print(f"wrote {path} ({cluster.num_nodes} node(s) x {cluster.gpus_per_node}) and its raw "
                  f"measurements in {path.with_name(path.stem + '.measurements.json').name}, "
                  f"in {result.seconds:.1f} s. Use it with --hardware {path}.")


@click.command("calibrate")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="calibrated.toml", show_default=True,
              help="Hardware file to write (cost_models format; rank 0 writes it).")
@click.option("--quick", is_flag=True, help="Tiny sizes and one trial: seconds, for tests and smoke checks.")
@click.option("--model", default=None, metavar="MODEL",
              help="Time the GEMM shapes of MODEL (batch 1, --seq-len) instead of the standard squares.")
@click.option("--seq-len", type=int, default=None, help="Sequence length for --model's shapes.")
@click.option("--gpu", "gpu", default=None,
              help="Catalogue GPU whose datasheet numbers are refined (default: from the device name; cpu on CPU).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--device-only", is_flag=True,
              help="Only matmul and memory bandwidth (works with one rank); collectives kept from the base file.")
@click.option("--gpus-per-node", type=int, default=None,
              help="GPUs per node to record (default: the node's device count; ranks per node on CPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as one JSON object.")
@load_timeout_option
def command(output, quick, model, seq_len, gpu, device, device_only, gpus_per_node, as_json) -> None:
    """Measure matmul throughput, memory bandwidth and collectives on the ranks torchrun started,
    and write a hardware file that estimate, plan and report accept with --hardware.

    \b
    torchrun --nproc-per-node 8 -m autoplan calibrate -o h200-node.toml
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m autoplan calibrate
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 -m autoplan calibrate --quick   # CPU ranks, gloo
    autoplan calibrate --device-only            # one process: matmul and memory bandwidth only
    """
    from pathlib import Path

    from autoplan.calibrate import fit, measure

    env = measure.launch_env()
    measure.check_launch(env, device_only)  # before any work: exit 2 with what could be measured
    if gpus_per_node is not None and gpus_per_node < 1:
        raise UserError(f"--gpus-per-node must be positive, got {gpus_per_node}")
    dev = _device(device)
    base = fit.base_gpu_for(dev, gpu)
    shapes = gemm_shapes_of(model, seq_len) if model else None
    settings = measure.Settings(device=dev, quick=quick, gemm_shapes=shapes, device_only=device_only,
                            dtypes=("fp32", "tf32", "bf16", "fp16"))
    if env.rank == 0 and not as_json:
        click.echo(f"autoplan calibrate: {env.world_size} rank(s), {env.num_nodes} node(s), {dev}, "
                   f"base {base.key}{', quick' if quick else ''}", err=True)
    if env.rank == 0 and not as_json:
        from rich.progress import BarColumn, Progress, TextColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      transient=False) as bar:
            task = bar.add_task("calibrating", total=None)
            result = measure.run(settings, env, base, lambda done, total, text: bar.update(
                task, completed=done, total=total, description=text))
    else:
        result = measure.run(settings, env, base)
    if env.rank != 0:
        return
    path, cluster = fit.write(result, base, Path(output), standard_shapes=shapes is None,
                              gpus_per_node=gpus_per_node)
    if as_json:
        data = result.to_dict()
        data["hardware_file"] = str(path)
        click.echo(json.dumps(data, indent=2))
        return
    _render(result, path, cluster)
