"""train() in one process (a world of one) next to another job's directories and next to
links: refused with exit status 2 before it writes, or writing around the link; the other
job's files and the links' targets stay as they were."""

from __future__ import annotations

import pytest

from autoplan.runtime import TrainArgs, train
from autoplan.runtime.rundir import DirectoryLock
from runtime_models import builder, plan_dict


@pytest.fixture
def one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _train(**args) -> list[float]:
    return train(builder("llama"), plan_dict(), TrainArgs(steps=1, **args))


def test_checkpoint_dir_inside_a_running_jobs_run_dir_is_refused(one_process, tmp_path, capsys):
    first = tmp_path / "first"
    (first / "checkpoints" / "step_000001").mkdir(parents=True)
    (first / "checkpoints" / "step_000001" / "trainer.json").write_text('{"step": 1}')
    held = [DirectoryLock(first).acquire("first-job")]  # what the first job's rank 0 holds
    try:
        with pytest.raises(SystemExit) as exc:
            _train(run_dir=str(tmp_path / "second"), checkpoint_dir=str(first / "checkpoints"),
                   checkpoint_every=1)
    finally:
        for lock in held:
            lock.release()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: the directory") and "run id first-job" in err
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_000001"]
    assert (first / "checkpoints" / "step_000001" / "trainer.json").read_text() == '{"step": 1}'
    assert not (tmp_path / "second" / "metrics.jsonl").exists()


def test_linked_metrics_file_is_refused_before_training(one_process, tmp_path, capsys):
    target = tmp_path / "precious.jsonl"
    target.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    with pytest.raises(SystemExit) as exc:
        _train(run_dir=str(run))
    assert exc.value.code == 2
    assert "metrics.jsonl is a symbolic link" in capsys.readouterr().err
    assert target.read_text() == "keep\n"


def test_a_link_in_place_of_a_checkpoint_folder_is_replaced_not_written_through(one_process, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_000001.tmp").symlink_to(elsewhere)
    (run / "checkpoints" / "step_000001").symlink_to(elsewhere)
    assert len(_train(run_dir=str(run), checkpoint_every=1)) == 1
    final = run / "checkpoints" / "step_000001"
    assert not final.is_symlink() and (final / "trainer.json").is_file()
    assert list(elsewhere.iterdir()) == []
