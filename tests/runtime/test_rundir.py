"""The run directory lock and the metrics rows of replayed steps (autoplan.runtime.rundir)."""

from __future__ import annotations

import json

import pytest

from autoplan.errors import UserError
from autoplan.files import write_file
from autoplan.runtime.rundir import (LOCK_NAME, DirectoryLock, check_unlocked, drop_metrics_from,
                                      job_directories, lock_job, refuse_linked_run_files)


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


def test_a_directory_inside_or_above_another_jobs_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    first = lock_job(job_directories(str(run), str(run / "checkpoints")), "job-a")
    try:
        # the checkpoint folder of a second job inside the first job's run directory
        with pytest.raises(UserError, match=r"in use by job pid \d+ .*\(run id job-a\).*its lock is on"):
            lock_job(job_directories(str(tmp_path / "run2"), str(run / "checkpoints")), "job-b")
        with pytest.raises(UserError, match="in use"):  # a run directory above the first job's
            lock_job(job_directories(str(tmp_path), str(tmp_path / "ckpt")), "job-b")
        with pytest.raises(UserError, match="in use"):
            check_unlocked(run / "checkpoints", "job-b")
        # the refused job holds nothing: its run directory is free for a third job
        lock_job(job_directories(str(tmp_path / "run2"), str(tmp_path / "ckpt2")), "job-c")[0].release()
    finally:
        for lock in first:
            lock.release()
    held = lock_job(job_directories(str(tmp_path / "run2"), str(run / "checkpoints")), "job-b")
    assert [lock.directory for lock in held] == [tmp_path / "run2", run / "checkpoints"]
    for lock in held:
        lock.release()


def test_a_restarted_worker_takes_only_a_directory_its_own_run_held(tmp_path):
    DirectoryLock(tmp_path).acquire("first-launch").release()  # that job has ended
    with pytest.raises(UserError, match=r"run id first-launch"):
        DirectoryLock(tmp_path).acquire("second-launch", restarted=True)
    DirectoryLock(tmp_path).acquire("first-launch", restarted=True).release()
    DirectoryLock(tmp_path).acquire("second-launch").release()  # a new launch may take it


def test_a_linked_lock_file_is_refused_and_its_target_kept(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(target)
    with pytest.raises(UserError, match=rf"{LOCK_NAME} is a symbolic link \(to {target}\)"):
        DirectoryLock(run).acquire("job-a")
    with pytest.raises(UserError, match="is a symbolic link"):
        check_unlocked(run, "job-a")
    assert target.read_text() == "keep me"


def test_linked_metrics_files_are_refused_and_their_targets_kept(tmp_path):
    target = tmp_path / "precious.jsonl"
    target.write_text('{"step": 5}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        refuse_linked_run_files(run)
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        write_file(run / "metrics.jsonl", b'{"step": 0}\n', append=True)  # MetricsLog.write
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        drop_metrics_from(run / "metrics.jsonl", 0)
    assert target.read_text() == '{"step": 5}\n'
    # a link where the rewrite's temporary file goes is removed, its target kept
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run / "metrics.jsonl.tmp").symlink_to(target)
    assert drop_metrics_from(run / "metrics.jsonl", 1) == 1
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n' and not (run / "metrics.jsonl").is_symlink()
    assert target.read_text() == '{"step": 5}\n'
