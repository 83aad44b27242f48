"""Command-line flags of a generated train.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class TrainArgs:
    steps: int = 10
    seed: int = 0
    data: str = "synthetic"  # "synthetic" or a token .bin file
    data_dtype: str | None = None  # uint16 | uint32; default by vocab size
    checkpoint_dir: str | None = None  # default <run_dir>/checkpoints
    checkpoint_every: int = 0  # 0: only at the end when a checkpoint dir is given
    resume: bool = False
    run_dir: str = "./runs/latest"
    log_every: int = 1
    check_only: bool = False  # check plan, data, run directory and checkpoints, then exit
    skip_bad_steps: int = 0  # non-finite (NaN/inf) steps skipped before the run stops (exit 3)
    allow_data_change: bool = False  # resume although --data differs from the checkpoint's

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or f"{self.run_dir.rstrip('/')}/checkpoints"


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    parser = argparse.ArgumentParser(description="Train with an autoplan plan (launch with torchrun).")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run in total")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--data", default="synthetic", metavar="synthetic|PATH",
                        help="'synthetic' random tokens, or a flat token .bin file")
    parser.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                        help="token width in the .bin file (default: uint16 if the vocab fits)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="DCP checkpoint folder (default <run-dir>/checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="save every N steps (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint, if any")
    parser.add_argument("--run-dir", default="./runs/latest", help="metrics.jsonl goes here")
    parser.add_argument("--log-every", type=int, default=1, metavar="N",
                        help="print a log line every N steps on rank 0")
    parser.add_argument("--check-only", action="store_true",
                        help="check the plan, the data, the run directory and (with --resume) the "
                             "checkpoints in this one process, then exit (launch.sh does this "
                             "before torchrun starts the ranks)")
    parser.add_argument("--skip-bad-steps", type=int, default=0, metavar="N",
                        help="skip up to N steps whose loss or gradient norm is NaN/inf (no "
                             "optimizer step, each one logged); the next one stops the run with "
                             "exit status 3 (default 0: the first one does)")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume although the --data file differs (size or sampled contents) "
                             "from the one the checkpoint was trained on")
    ns = parser.parse_args(argv)
    if ns.steps < 0 or ns.checkpoint_every < 0 or ns.log_every < 1 or ns.skip_bad_steps < 0:
        parser.error("--steps, --checkpoint-every and --skip-bad-steps must be >= 0, --log-every >= 1")
    return TrainArgs(steps=ns.steps, seed=ns.seed, data=ns.data, data_dtype=ns.data_dtype,
                     checkpoint_dir=ns.checkpoint_dir, checkpoint_every=ns.checkpoint_every,
                     resume=ns.resume, run_dir=ns.run_dir, log_every=ns.log_every,
                     check_only=ns.check_only, skip_bad_steps=ns.skip_bad_steps,
                     allow_data_change=ns.allow_data_change)
