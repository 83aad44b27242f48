"""The issue's bar for `autoplan check`: at full size, on plans where activations dominate,
the cost model's memory per rank is within 5% of the dry run of the job's own runtime.

Llama 3.1 8B on 8 H100 at 8K tokens, each plan made by `autoplan plan` with one axis or mode
fixed (the solver picks the rest); the committed 8B example (a two-stage interleaved
pipeline) is held to the same bar in test_check_examples.py, which dry-runs it once. 5% is the
issue's tolerance; benchmarks/results/check_vs_model.txt has every category of these and more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from autoplan.cli import cli
from autoplan.commands.check import check_plan

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ["plan", "llama3.1-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "32",
            "--seq-len", "8192"]
FIXES = {"cp2": "cp=2 pp=1 tp=1",  # ring attention, selective recompute on most blocks
         "tp2_sp_zero1": "tp=2 pp=1 cp=1 zero=1",  # autocast from fp32 weights, TP + SP
         "full_recompute_mb2": "recompute=full pp=1 tp=1 cp=1 micro-batch=2 offload=none"}


def totals(report: dict) -> list[tuple[int, float, float]]:
    """(rank, dry-run GiB, cost model GiB) of each rank's total at its peak."""
    rows = [(rank["rank"], row) for rank in report["ranks"] for row in rank["memory"]
            if row["category"] == "total at peak"]
    return [(rank, row["dry_run_gib"], row["model_gib"]) for rank, row in rows]


@pytest.mark.parametrize("name", sorted(FIXES))
def test_model_memory_is_within_5_percent_of_the_dry_run(name, tmp_path):
    plan = tmp_path / "plan.json"
    args = [arg for fix in FIXES[name].split() for arg in ("--fix", fix)]
    made = CliRunner().invoke(cli, [*LLAMA_8B, *args, "-o", str(plan)])
    assert made.exit_code == 0, made.output
    for rank, dry, model in totals(check_plan(str(plan), workers=1)):
        assert abs(model / dry - 1) <= 0.05, (name, rank, dry, model)

