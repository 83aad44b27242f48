"""Measured vs predicted peak memory per rank for tiny plans on autoplan.runtime.

    python benchmarks/runtime_memory.py [--nproc 2] [--out benchmarks/runtime_memory.json]

Re-launches itself under torchrun (gloo on CPU, NCCL on CUDA). For each plan it trains one
warm-up step, then measures one step: on CPU with torch.distributed._tools.mem_tracker.
MemTracker (parameters, gradients, optimizer states, activations, temporaries of the
tracked modules), on CUDA with the caching allocator's max_memory_allocated. The
prediction comes from `predicted_memory_bytes(plan)`; the ratio measured/predicted is
printed when a prediction exists: against the whole prediction and against its tensor part
(the prediction minus its fixed per-process overhead), which is what MemTracker measures.
Writes a JSON list and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
         "vocab_size": 512, "max_position_embeddings": 256}


def plans(world: int) -> dict[str, dict]:
    base = {"model": {"source": "config", "name": "tiny-llama-128"}, "gpu": "cpu",
            "world_size": world, "gpus_per_node": world, "global_batch": 8, "seq_len": 128,
            "precision": "fp32", "micro_batch": 4, "format_version": 1,  # 1 micro-batch: MemTracker tracks one forward per module
            "optimizer": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                          "warmup_steps": 1, "max_steps": 10, "grad_clip": 1.0}}
    return {f"ddp dp{world}": dict(base, dp=world, zero_stage=0),
            f"zero3 dp{world}": dict(base, dp=world, zero_stage=3),
            f"zero3+full-recompute dp{world}": dict(base, dp=world, zero_stage=3, recompute={
                f"layers.{i}": "full" for i in range(4)})}


def predicted_memory_bytes(plan) -> float | None:
    """The cost model's peak bytes per rank for `plan`, or None where it is unavailable.

    Tries `autoplan.cost.estimate_plan(plan)` first (the intended hook), then the cost
    model's `estimate(graph, ParallelConfig, cluster)` on this script's model, then the
    plan's own stored estimate."""
    breakdown = predicted_breakdown_bytes(plan)
    return sum(breakdown.values()) if breakdown else None


def predicted_breakdown_bytes(plan) -> dict[str, float] | None:
    """Predicted bytes per rank by category (parameters, ..., overhead), or None."""
    try:
        from autoplan.cost import estimate_plan
    except ImportError:
        estimate_plan = None
    try:
        if estimate_plan is not None:
            result = estimate_plan(plan)
        else:
            result = _estimate_with_cost_model(plan)
        gib = getattr(result, "memory_breakdown_gib", None)
        if gib is None and isinstance(result, dict):
            gib = result.get("memory_breakdown_gib")
        if gib:
            return {k: float(v) * 2**30 for k, v in gib.items()}
    except Exception as exc:  # a prediction failure must not hide the measurement
        print(f"prediction unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    stored = (plan.estimate or {}).get("memory_breakdown_gib")
    return {k: float(v) * 2**30 for k, v in stored.items()} if stored else None


def _estimate_with_cost_model(plan):
    import tempfile

    from autoplan.cost.estimate import estimate
    from autoplan.trace.load import load_graph
    from autoplan.hardware import resolve_cluster

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(MODEL))
        graph, _, _ = load_graph(str(path), plan.seq_len)
    modes = set(plan.recompute.values()) or {"none"}
    # `estimate` takes one recompute mode for every block
    config = plan.parallel.with_(recompute=modes.pop() if len(modes) == 1 else "selective",
                                 layer_recompute=None)
    return estimate(graph, config, resolve_cluster("cpu", None, plan.world_size, plan.gpus_per_node))


def measure(name: str, plan_dict: dict) -> dict:
    import torch
    import torch.distributed as dist

    from autoplan.models import build_model
    from autoplan.plan import Plan
    from autoplan.runtime import TrainArgs, Trainer

    plan = Plan.from_dict(plan_dict)
    trainer = Trainer(lambda: build_model(MODEL), plan, TrainArgs(steps=2, run_dir="/tmp/ap-mem"))
    trainer.step(0)  # warm-up: optimizer states exist from here on
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        trainer.step(1)
        peak, method = torch.cuda.max_memory_allocated(), "cuda max_memory_allocated"
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(*trainer.par.parts, *trainer.optimizers)
        with tracker:
            trainer.step(1)
        snapshot = tracker.get_tracker_snapshot("peak")
        peak = max(sum(v for k, v in by_type.items() if k != "Total") if "Total" not in by_type
                   else by_type["Total"] for by_type in snapshot.values())
        method = "MemTracker"
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, int(peak))
    row = {"plan": name, "method": method, "peak_bytes_per_rank": peaks}
    if dist.get_rank() == 0:
        breakdown = predicted_breakdown_bytes(plan)
        predicted = sum(breakdown.values()) if breakdown else None
        # MemTracker counts tensors only; the cost model adds a fixed per-process overhead
        # (CUDA context, allocator slack), so the tensor-only ratio is the comparable one.
        tensors = predicted - breakdown.get("overhead", 0.0) if breakdown else None
        row.update({"predicted_bytes": predicted, "predicted_tensor_bytes": tensors,
                    "predicted_breakdown_bytes": breakdown,
                    "ratio_measured_over_predicted": max(peaks) / predicted if predicted else None,
                    "ratio_measured_over_predicted_tensors": max(peaks) / tensors if tensors else None})
    return row


def worker(out: str) -> None:
    import torch.distributed as dist

    from autoplan.runtime import init_distributed

    init_distributed()
    rows = [measure(name, p) for name, p in plans(dist.get_world_size()).items()]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"{'plan':28s} {'method':11s} {'measured MiB/rank':>18s} {'predicted MiB':>14s} "
              f"{'ratio':>6s} {'pred. tensors MiB':>18s} {'ratio':>6s}")
        for row in rows:
            peaks = "/".join(f"{b / 2**20:.1f}" for b in row["peak_bytes_per_rank"])

            def fmt(value, scale=2**20, spec=".1f"):
                return format(value / scale, spec) if value else "n/a"

            print(f"{row['plan']:28s} {row['method']:11s} {peaks:>18s} "
                  f"{fmt(row['predicted_bytes']):>14s} "
                  f"{fmt(row['ratio_measured_over_predicted'], 1, '.3f'):>6s} "
                  f"{fmt(row['predicted_tensor_bytes']):>18s} "
                  f"{fmt(row['ratio_measured_over_predicted_tensors'], 1, '.2f'):>6s}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "runtime_memory.json"))
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.out)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", __file__, "--out", args.out]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
