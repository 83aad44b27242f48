"""Checkpoint/resume worker, through the public API (parse_args + train).

usage: torchrun ... ckpt_worker.py PLAN.json RESULTS.json [train.py flags...]
   or: torchrun ... ckpt_worker.py --jobs JOBS.json
JOBS.json: [[PLAN.json, RESULTS.json, [train.py flags...]], ...], trained one after the other
in one process group (a launch costs more than a tiny model's steps): each job a fresh
train(), as a new launch would run it, resuming from what the jobs before it saved.
Env AUTOPLAN_TEST_CRASH_STEP=k: on the first attempt (TORCHELASTIC_RESTART_COUNT=0), rank 1
leaves a half-written checkpoint behind and dies at step k (tests --max-restarts).
"""

import json
import os
import sys

import torch.distributed as dist

import autoplan.runtime.loop as loop
from autoplan.runtime import init_distributed, parse_args, train
from plan_groups import groups_given_back
from runtime_models import builder


def _install_crash(step_to_die: int) -> None:
    original = loop.Trainer.step

    def step(self, step):
        if (step == step_to_die and dist.get_rank() == 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            root = self.args.checkpoint_path
            os.makedirs(f"{root}/step_{step_to_die + 2:06d}.tmp", exist_ok=True)  # mid-save
            os.makedirs(f"{root}/step_{step_to_die + 1:06d}", exist_ok=True)  # no trainer.json
            open(f"{root}/step_{step_to_die + 1:06d}/.metadata", "wb").write(b"garbage")
            os._exit(17)
        return original(self, step)

    loop.Trainer.step = step


def run_job(plan_path: str, results_path: str, flags: list[str]) -> None:
    plan = json.load(open(plan_path))
    losses = train(builder(plan["model"]["name"].split("-", 1)[1]), plan, parse_args(flags))
    if os.environ["RANK"] == "0":
        json.dump(losses, open(results_path, "w"))


def main() -> None:
    if "AUTOPLAN_TEST_CRASH_STEP" in os.environ:
        _install_crash(int(os.environ["AUTOPLAN_TEST_CRASH_STEP"]))
    if sys.argv[1] != "--jobs":
        run_job(sys.argv[1], sys.argv[2], sys.argv[3:])  # train() has closed the process group
        return
    init_distributed()  # held across the jobs: train() leaves a group it did not create
    for plan_path, results_path, flags in json.load(open(sys.argv[2])):
        with groups_given_back():
            run_job(plan_path, results_path, flags)
    loop._leave(owns_group=True)  # as train() leaves a group it created


if __name__ == "__main__":
    main()
