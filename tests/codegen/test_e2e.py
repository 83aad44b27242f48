"""Generated jobs run: launch.sh on 2 gloo ranks trains, checkpoints and resumes; PP+TP matches 1 rank.

Slow (each launch starts torch in every rank: 10-30 s on 2 cores); run with `-m slow`.
"""

from __future__ import annotations

import json
import shutil

import pytest

from codegen_helpers import REPO, TINY, free_port, generate, pattern_tokens, run_script

pytestmark = pytest.mark.slow

METRIC_KEYS = {"step", "loss", "lr", "tokens_per_s", "mfu", "peak_memory_gib"}


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def launch(job, *args, cwd, env=None):
    result = run_script(job / "launch.sh", *map(str, args), cwd=cwd, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_tiny_job_trains_checkpoints_and_resumes(two_rank_job, tmp_path):
    data = pattern_tokens(tmp_path / "data dir" / "tokens.bin")  # a space: "$@" must stay quoted
    run = tmp_path / "run"
    launch(two_rank_job, "--steps", 6, "--checkpoint-every", 3, "--run-dir", run, "--data", data, cwd=tmp_path)
    first = metrics(run)
    assert [m["step"] for m in first] == list(range(6))
    assert all(METRIC_KEYS <= set(m) for m in first)
    losses = [m["loss"] for m in first]
    # the repeating token pattern is learnt at once: ~0.1 lower after 6 warm-up steps
    # (seeded and deterministic; 0.02 leaves room for other CPUs' rounding)
    assert losses[-1] < losses[0] - 0.02, losses
    checkpoints = sorted(p for p in (run / "checkpoints").iterdir() if any(p.iterdir()))
    assert len(checkpoints) == 2, checkpoints  # after steps 3 and 6

    # the second launch goes through the c10d rendezvous of RDZV_ENDPOINT (multi-node path)
    result = launch(two_rank_job, "--steps", 9, "--checkpoint-every", 3, "--run-dir", run, "--data", data,
                    "--resume", cwd=tmp_path, env={"RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
                                                    "RDZV_ID": "resume-test"})
    assert "resumed" in result.stdout + result.stderr
    steps = [m["step"] for m in metrics(run)]
    assert steps == list(range(9)), steps  # continues at step 6, nothing repeated


def test_pp_and_tp_job_matches_the_one_rank_job_in_fp32(tmp_path):
    jobs = {}
    for name, extra in {"pp2tp2": ["--gpus", "4", "--fix", "pp=2", "--fix", "tp=2"],
                        "single": ["--gpus", "1"]}.items():
        code, out, err = generate("tiny-gpt", *TINY, *extra, "--precision", "fp32",
                                  "-o", str(tmp_path / name))
        assert code == 0, out + err
        jobs[name] = tmp_path / name
    plan = json.loads((jobs["pp2tp2"] / "plan.json").read_text())
    assert (plan["pp"], plan["tp"], plan["precision"]) == (2, 2, "fp32")
    data = pattern_tokens(tmp_path / "tokens.bin")
    losses = {}
    for name, job in jobs.items():
        launch(job, "--steps", 4, "--seed", 7, "--data", data, "--run-dir", tmp_path / f"run-{name}",
               cwd=tmp_path)
        losses[name] = [m["loss"] for m in metrics(tmp_path / f"run-{name}")]
    # fp32: only the summation order differs between the plans (1e-4 relative)
    assert losses["pp2tp2"] == pytest.approx(losses["single"], rel=1e-4)
    assert losses["single"][-1] < losses["single"][0]


def test_job_from_a_model_file_with_an_odd_path_runs(tmp_path):
    folder = tmp_path / "it's a \"model\" dir"
    folder.mkdir()
    model = shutil.copy(REPO / "examples" / "nano_gpt.py", folder / "my model.py")
    job = tmp_path / "job"
    code, out, err = generate(str(model), *TINY, "--gpus", "2", "-o", str(job))
    assert code == 0, out + err
    shutil.rmtree(folder)  # the job holds its own copy of the model
    launch(job, "--steps", 2, "--run-dir", tmp_path / "run", cwd=tmp_path)
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0, 1]
