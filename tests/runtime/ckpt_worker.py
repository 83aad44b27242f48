"""Checkpoint/resume worker, through the public API (parse_args + train).

usage: torchrun ... ckpt_worker.py PLAN.json RESULTS.json [train.py flags...]
Env AUTOPLAN_TEST_CRASH_STEP=k: on the first attempt (TORCHELASTIC_RESTART_COUNT=0), rank 1
leaves a half-written checkpoint behind and dies at step k (tests --max-restarts).
"""

import json
import os
import sys

import torch.distributed as dist

import autoplan.runtime.loop as loop
from autoplan.runtime import parse_args, train
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


def main() -> None:
    plan = json.load(open(sys.argv[1]))
    if "AUTOPLAN_TEST_CRASH_STEP" in os.environ:
        _install_crash(int(os.environ["AUTOPLAN_TEST_CRASH_STEP"]))
    losses = train(builder(plan["model"]["name"].split("-", 1)[1]), plan, parse_args(sys.argv[3:]))
    if os.environ["RANK"] == "0":  # train() has closed the process group
        json.dump(losses, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
