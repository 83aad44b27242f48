"""Trains plans with dropout and reports, per nn.Dropout named in the config, how many
different masks the ranks drew in the first forward.

usage: torchrun --nproc-per-node N dropout_worker.py CONFIGS.json RESULTS.json
CONFIGS.json: [{"name", "kind", "plan", "masks": {module: expected count}}, ...]
Rank 0 writes {name: {"losses", "replica_spread", "masks": {module: count}, "streams": [[pipeline
ranks of the processes whose random stream is one], ...]}}.
"""

import json
import sys
import tempfile

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from autoplan.runtime.tying import model_fqn
from parity_worker import full_state, leave
from plan_groups import groups_given_back
from runtime_models import SEED, builder

STEPS = 2  # the masks are the first forward's; the second step trains on the first's update


def record_first_masks(trainer: Trainer, names: list[str]) -> dict[str, torch.Tensor]:
    """name -> the positions its first forward zeroed (the input was not zero there)."""
    masks: dict[str, torch.Tensor] = {}
    modules = {model_fqn(name): module for part in trainer.par.parts for name, module in part.named_modules()}

    def hook(name):
        def record(module, args, out):
            if name not in masks:
                masks[name] = ((out == 0) & (args[0] != 0)).cpu()
        return record

    for name in names:
        modules[name].register_forward_hook(hook(name))
    return masks


def distinct_over_ranks(masks: dict[str, torch.Tensor]) -> dict[str, int]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, masks)
    return {name: len({rank[name].numpy().tobytes() for rank in gathered}) for name in masks}


def streams(trainer: Trainer) -> list[list[int]]:
    """The pipeline ranks of the processes that share one random stream, per stream."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (trainer.mesh.pp_rank, torch.get_rng_state().numpy().tobytes()))
    groups: dict[bytes, list[int]] = {}
    for pp_rank, state in gathered:
        groups.setdefault(state, []).append(pp_rank)
    return sorted(groups.values())


def run_case(config: dict, run_dir: str) -> dict:
    args = TrainArgs(steps=STEPS, seed=SEED, run_dir=run_dir, log_every=10**9)
    trainer = Trainer(builder(config["kind"]), Plan.from_dict(config["plan"]), args)
    shared = streams(trainer)  # before the first step draws from them
    masks = record_first_masks(trainer, list(config["masks"]))
    losses = trainer.run()
    _, spread = full_state(trainer)
    return {"losses": losses, "replica_spread": spread, "masks": distinct_over_ranks(masks),
            "streams": shared}


def main() -> None:
    configs = json.load(open(sys.argv[1]))
    init_distributed()
    results = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for config in configs:
            dist.barrier()
            with groups_given_back():
                results[config["name"]] = run_case(config, run_dir)
    leave(results, sys.argv[2])


if __name__ == "__main__":
    main()
