"""Bit-exact resume: an uninterrupted run, then runs stopped and resumed at several steps,
all inside one torchrun launch (one process group, a fresh Trainer each time).

usage: torchrun --nproc-per-node N resume_worker.py CONFIGS.json RESULTS.json WORK_DIR
CONFIGS.json: [{"name": ..., "kind": "llama|gpt|...", "plan": {...}, "steps": 50,
                "resume_at": [7, 20, 33]}, ...]
Rank 0 writes {name: {"reference": [...], "resumed": {"7": [...], ...}}} to RESULTS.json:
each "resumed" list is the losses of steps 0..steps-1, the first part from the run that
saved at step k and stopped, the rest from the run that resumed from that checkpoint.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from parity_worker import leave
from plan_groups import groups_given_back
from runtime_models import SEED, builder


def _run(config: dict, run_dir: Path, **flags) -> list[float]:
    dist.barrier()
    args = TrainArgs(seed=SEED, run_dir=str(run_dir), log_every=10**9,
                     data=config.get("data", "synthetic"), **flags)
    with groups_given_back():
        losses = Trainer(builder(config["kind"]), Plan.from_dict(config["plan"]), args).run()
    return losses


def main() -> None:
    configs = json.load(open(sys.argv[1]))
    work = Path(sys.argv[3])
    init_distributed()
    results = {}
    for config in configs:
        steps, name = config["steps"], config["name"]
        out = {"reference": _run(config, work / name / "reference", steps=steps), "resumed": {}}
        for stop in config["resume_at"]:
            run_dir = work / name / f"stop{stop}"
            first = _run(config, run_dir, steps=stop, checkpoint_every=stop)
            rest = _run(config, run_dir, steps=steps, resume=True)
            out["resumed"][str(stop)] = first + rest
        results[name] = out
        if dist.get_rank() == 0:
            json.dump(results, open(sys.argv[2], "w"))
    leave(results, sys.argv[2])


if __name__ == "__main__":
    main()
