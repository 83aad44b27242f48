"""Trains plans with dropout and reports, per nn.Dropout named in the config, whether the two
tp ranks drew the same mask in the first forward.

usage: torchrun --nproc-per-node 2 dropout_worker.py CONFIGS.json RESULTS.json
CONFIGS.json: [{"name", "kind", "plan", "masks": {"differ": [...], "match": [...]}}, ...]
Rank 0 writes {name: {"losses", "replica_spread", "same_mask": {module: bool}}}.
"""

import gc
import json
import sys
import tempfile

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from parity_worker import full_state
from runtime_models import SEED, builder

STEPS = 3
WRAPPED = "_checkpoint_wrapped_module"  # a recomputed block's inner module


def record_first_masks(trainer: Trainer, names: list[str]) -> dict[str, torch.Tensor]:
    """name -> the positions its first forward zeroed (the input was not zero there)."""
    masks: dict[str, torch.Tensor] = {}
    modules = {name.replace(f"{WRAPPED}.", ""): module
               for part in trainer.par.parts for name, module in part.named_modules()}

    def hook(name):
        def record(module, args, out):
            if name not in masks:
                masks[name] = ((out == 0) & (args[0] != 0)).cpu()
        return record

    for name in names:
        modules[name].register_forward_hook(hook(name))
    return masks


def same_on_every_rank(masks: dict[str, torch.Tensor]) -> dict[str, bool]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, masks)
    return {name: all(torch.equal(rank[name], gathered[0][name]) for rank in gathered)
            for name in masks}


def main() -> None:
    configs = json.load(open(sys.argv[1]))
    init_distributed()
    results = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for config in configs:
            dist.barrier()
            args = TrainArgs(steps=STEPS, seed=SEED, run_dir=run_dir, log_every=10**9)
            trainer = Trainer(builder(config["kind"]), Plan.from_dict(config["plan"]), args)
            masks = record_first_masks(trainer, config["masks"]["differ"] + config["masks"]["match"])
            losses = trainer.run()
            _, spread = full_state(trainer)
            results[config["name"]] = {"losses": losses, "replica_spread": spread,
                                       "same_mask": same_on_every_rank(masks)}
            del trainer
            gc.collect()
    if dist.get_rank() == 0:
        json.dump(results, open(sys.argv[2], "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
