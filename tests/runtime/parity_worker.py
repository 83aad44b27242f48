"""Runs many plans inside one torchrun launch (one process group, a fresh model each).

usage: torchrun --nproc-per-node N parity_worker.py CONFIGS.json RESULTS.json RUN_DIR
CONFIGS.json: [{"name": ..., "kind": "llama|mixtral|gpt", "plan": {...}}, ...]
Rank 0 writes {name: {"losses": [...], "grad_norms": [...], "replica_spread": x, "seconds": s}}
to RESULTS.json after each plan, and the model's full state after the last step (every
tensor unsharded, by FQN) to RUN_DIR/<name>.pt.
"""

import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from autoplan.runtime.fused_projection import fused_row_orders, in_model_layout
from plan_groups import groups_given_back
from runtime_models import SEED, STEPS, builder, hooks


def full_state(trainer: Trainer) -> tuple[dict[str, torch.Tensor], float]:
    """On rank 0: every tensor of the model's state unsharded, by FQN (each pipeline stage's
    from its ranks), and the largest difference between two ranks' copies of one tensor
    (replicas must stay identical). Elsewhere: ({}, 0.0)."""
    options = StateDictOptions(full_state_dict=True)  # gathers FSDP / TP / EP shards
    local = {key: value.detach().cpu().clone()
             for part in trainer.par.parts if part.state_dict()  # a stage may hold nothing
             for key, value in in_model_layout(get_model_state_dict(part, options=options),
                                               fused_row_orders(part)).items()
             if key not in trainer.unsaved}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    merged, spread = {}, 0.0
    for state in gathered or []:
        for key, value in state.items():
            if key in merged:
                spread = max(spread, float((merged[key] - value).abs().max()))
            merged.setdefault(key, value)
    return merged, spread


def float8_facts(trainer: Trainer) -> dict:
    """How rank 0's Float8Linears scale their weights (torchao's granularity per linear), how
    many weights FSDP gathers in float8 (torchao's WeightWithDynamicFloat8CastTensor) and how
    many of those hold a scale precomputed after the last optimizer step."""
    linears = [m for part in trainer.par.parts for m in part.modules() if type(m).__name__ == "Float8Linear"]
    weights = [getattr(m.weight, "_local_tensor", m.weight) for m in linears]
    gathered = [w for w in weights if type(w).__name__ == "WeightWithDynamicFloat8CastTensor"]
    return {"float8_scaling": sorted({m.config.cast_config_weight.scaling_granularity.value for m in linears}),
            "float8_gathered": len(gathered),
            "float8_precomputed": sum(w._precomputed_scale is not None for w in gathered)}


def leave(results: dict, path: str) -> None:
    """Rank 0 writes `results` to `path`; then every rank frees the FSDP/DTensor cycles
    (runtime/loop.py train) and leaves once no peer still talks."""
    if dist.get_rank() == 0:
        json.dump(results, open(path, "w"))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_case(config: dict) -> dict:
    """Trains one plan; rank 0 saves the model's full state after the last step."""
    start = time.perf_counter()
    args = TrainArgs(steps=config.get("steps", STEPS), seed=SEED, run_dir=sys.argv[3], log_every=10**9,
                     data=config.get("data", "synthetic"))
    trainer = Trainer(builder(config["kind"]), Plan.from_dict(config["plan"]), args, **hooks(config["kind"]))
    losses = trainer.run()
    state, spread = full_state(trainer)
    modules = [m for part in trainer.par.parts for m in part.modules()]
    if dist.get_rank() == 0:
        print(f"{config['name']}: {time.perf_counter() - start:.1f}s {losses} {trainer.grad_norms}", flush=True)
        Path(sys.argv[3]).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(sys.argv[3]) / f"{config['name']}.pt")
    return {"losses": losses, "grad_norms": trainer.grad_norms, "replica_spread": spread,
            "seconds": time.perf_counter() - start,
            "compiled_modules": sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules),
            "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in modules),
            **float8_facts(trainer)}


def main() -> None:
    configs = json.load(open(sys.argv[1]))
    init_distributed()
    results = {}
    for config in configs:
        dist.barrier()
        # the plan's FSDP/DTensor cycles and groups go now, not in a later plan's collectives:
        # a fresh clone's run once died of heap corruption inside the next plan's first all-reduce
        with groups_given_back():
            results[config["name"]] = run_case(config)
        if dist.get_rank() == 0:
            json.dump(results, open(sys.argv[2], "w"))
    leave(results, sys.argv[2])


if __name__ == "__main__":
    main()
