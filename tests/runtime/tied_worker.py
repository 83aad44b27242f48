"""Trains tied-parameter models under several plans in one torchrun launch.

usage: torchrun --nproc-per-node N tied_worker.py CONFIGS.json RESULTS_DIR RUN_DIR
CONFIGS.json: [{"name": ..., "kind": ..., "plan": {...}}, ...]
Rank 0 writes RESULTS_DIR/<name>.pt: {"losses", "params" (full values by name, tied names
included, every pipeline stage's), "distinct": how many distinct parameter objects rank 0's
parts hold}, or
{"error": text} when the runtime refused the plan.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import UserError
from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from plan_groups import groups_given_back
from runtime_models import SEED
from tied_models import STEPS, build


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter name of this rank's parts -> its full value (the same call order on
    every rank, so the gathers of DTensor parameters match)."""
    out = {}
    for part in trainer.par.parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            value = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = value.detach().clone()
    return out


def run_case(config: dict) -> dict:
    """The result rank 0 saves for one plan: losses and full parameters, or the refusal."""
    args = TrainArgs(steps=STEPS, seed=SEED, run_dir=sys.argv[3], log_every=10**9)
    kind = config["kind"]
    try:
        trainer = Trainer(lambda: build(kind), Plan.from_dict(config["plan"]), args)
    except UserError as exc:
        return {"error": str(exc)}
    losses = trainer.run()
    stages = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(full_params(trainer), stages, dst=0)
    params = {name: value for share in stages or [] for name, value in share.items()}
    distinct = len({id(p) for part in trainer.par.parts for p in part.parameters()})
    return {"losses": losses, "params": params, "distinct": distinct}


def main() -> None:
    configs = json.load(open(sys.argv[1]))
    results = Path(sys.argv[2])
    init_distributed()
    for config in configs:
        dist.barrier()
        with groups_given_back():
            outcome = run_case(config)
        if dist.get_rank() == 0:
            torch.save(outcome, results / f"{config['name']}.pt")
            print(f"{config['name']}: {outcome.get('losses', outcome.get('error'))}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
