"""The run directory lock and the metrics rows of replayed steps (autoplan.runtime.rundir)."""

from __future__ import annotations

import json

import pytest

from autoplan.errors import UserError
from autoplan.runtime.rundir import DirectoryLock, check_unlocked, drop_metrics_from, job_directories


def test_second_lock_on_a_directory_is_refused_until_released(tmp_path):
    first = DirectoryLock(tmp_path).acquire("job-a")
    with pytest.raises(UserError, match=r"is in use by job pid \d+ on .* \(run id job-a\)"):
        DirectoryLock(tmp_path).acquire("job-b")
    with pytest.raises(UserError, match="is in use"):
        check_unlocked(tmp_path, "job-b")
    check_unlocked(tmp_path, "job-a")  # the same job's other node
    first.release()
    check_unlocked(tmp_path, "job-b")
    DirectoryLock(tmp_path).acquire("job-b").release()


def test_checkpoint_directory_is_locked_only_outside_the_run_directory(tmp_path):
    run = tmp_path / "run"
    assert job_directories(str(run), str(run / "checkpoints")) == [run]
    assert job_directories(str(run), str(tmp_path / "ckpt")) == [run, tmp_path / "ckpt"]


def test_replayed_steps_and_a_torn_line_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in range(8)]
    path.write_text("\n".join(rows) + '\n{"step": 8, "lo')
    assert drop_metrics_from(path, 6) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(6))
    assert drop_metrics_from(path, 6) == 0
    assert drop_metrics_from(tmp_path / "missing.jsonl", 0) == 0
