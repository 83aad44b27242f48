"""Every committed GPU example passes its own `autoplan check`: the dry run of the job's own
runtime, at full size on fake tensors, stays within the plan's budget (the GPU's memory less
the headroom the plan keeps). The planner keeps the estimate x (1 + the measured error of
cost_models/memory_model_error.toml) within that budget; this is the test of that margin.
Each example dry-runs in 30 s to 2 min on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.commands.check import check_plan

ROOT = Path(__file__).resolve().parents[2]
GPU_EXAMPLES = [e["dir"] for e in json.loads((ROOT / "generated" / "examples.json").read_text())
                if "cpu" not in e["args"]]


@pytest.mark.slow
@pytest.mark.parametrize("example", GPU_EXAMPLES)
def test_each_gpu_example_fits_its_own_budget(example):
    job = ROOT / "generated" / example
    report = check_plan(str(job), workers=2)
    headroom = json.loads((job / "plan.json").read_text())["memory_headroom_gib"]
    assert headroom > 0 and report["budget_gib"] == pytest.approx(report["gpu_memory_gib"] - headroom)
    worst = max(rank["peak_gib"] for rank in report["ranks"])
    assert report["fits"] and worst <= report["budget_gib"], (example, worst, report["budget_gib"])
