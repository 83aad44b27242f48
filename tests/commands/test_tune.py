"""`autoplan tune` end to end on 4 gloo ranks: plan tiny-gpt, write each candidate's job, run
each through its launch.sh for a few steps, rank by measurement, fit tuned.toml. The second
candidate's train.py is broken on purpose: it is recorded with the job's own error and the
first one is still measured and ranked."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import autoplan.tune.launch as launch
from autoplan.cli import cli
from autoplan.hardware import load_hardware_file

pytestmark = pytest.mark.slow


def test_tune_measures_ranks_and_survives_a_failing_candidate(tmp_path, monkeypatch):
    written = []
    real_write = launch.write_trial

    def write_and_break_the_second(plan, source, job_dir, command_line):
        trial = real_write(plan, source, job_dir, command_line)
        written.append(trial)
        if len(written) == 2:
            train = trial.job_dir / "train.py"
            train.write_text(train.read_text().replace(
                "def main() -> None:", "def main() -> None:\n    raise SystemExit('autoplan: error: injected failure')", 1))
        return trial

    monkeypatch.setattr(launch, "write_trial", write_and_break_the_second)
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    out = tmp_path / "tune"
    result = CliRunner().invoke(cli, ["tune", "tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", "8",
                                      "--seq-len", "64", "--candidates", "2", "--steps", "3", "-o", str(out),
                                      "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    first, second = results["candidates"]
    assert first["ok"] and first["measured_step_s"] > 0 and first["error"] is not None
    assert not second["ok"] and "injected failure" in second["reason"]
    assert results["ranking"] == [1] and results["fastest_measured"] == str(out / "candidate-1")
    assert (out / "candidate-1" / "runs" / "tune" / "metrics.jsonl").is_file()
    tuned = load_hardware_file(out / "tuned.toml")
    assert results["refit"]["factor"] == pytest.approx(first["predicted_step_s"] / first["measured_step_s"])
    assert "fitted by autoplan tune" in tuned.gpu.sources["efficiency.hbm_fraction"]


def test_tune_refuses_a_folder_that_holds_files(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = CliRunner().invoke(cli, ["tune", "tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", "8",
                                      "--seq-len", "64", "-o", str(tmp_path)])
    assert result.exit_code != 0 and "already holds files" in str(result.exception or result.output)
    assert (tmp_path / "keep.txt").read_text() == "mine"
