"""Runs many plans inside one torchrun launch (one process group, a fresh model each).

usage: torchrun --nproc-per-node N parity_worker.py CONFIGS.json RESULTS.json RUN_DIR
CONFIGS.json: [{"name": ..., "kind": "llama|mixtral|gpt", "plan": {...}}, ...]
Rank 0 writes {name: {"losses": [...], "seconds": s}} to RESULTS.json after each plan.
"""

import gc
import json
import sys
import time

import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from runtime_models import SEED, STEPS, builder


def main() -> None:
    configs = json.load(open(sys.argv[1]))
    init_distributed()
    results = {}
    for config in configs:
        dist.barrier()
        start = time.perf_counter()
        plan = Plan.from_dict(config["plan"])
        args = TrainArgs(steps=config.get("steps", STEPS), seed=SEED, run_dir=sys.argv[3], log_every=10**9,
                         data=config.get("data", "synthetic"))
        trainer = Trainer(builder(config["kind"]), plan, args)
        losses = trainer.run()
        results[config["name"]] = {"losses": losses, "grad_norms": trainer.grad_norms,
                                   "seconds": time.perf_counter() - start}
        if dist.get_rank() == 0:
            print(f"{config['name']}: {time.perf_counter() - start:.1f}s {losses} {trainer.grad_norms}", flush=True)
            json.dump(results, open(sys.argv[2], "w"))
    gc.collect()  # free FSDP/DTensor cycles before teardown (runtime/loop.py train)
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
