"""Checkpoint/resume through the public train() API, and a rank killed mid-training.

The uninterrupted 10-step run is the single-process reference (runtime_models), so
"identical" means within the 1e-5 relative fp32 tolerance of test_parity (resuming onto
another plan changes the summation order); same-plan resume is checked at 1e-6.
"""

from __future__ import annotations

import json

import pytest

from runtime_models import plan_dict, reference_run

STEPS = 10


def _rel(a, b):
    return abs(a - b) / abs(b)


def _write(tmp, name, plan):
    path = tmp / name
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.slow
def test_resume_same_and_other_plan(torchrun, tmp_path):
    ref_losses, _ = reference_run("llama", steps=STEPS)
    save_plan = _write(tmp_path, "zero3.json", plan_dict(dp=2, zero_stage=3))
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    first = torchrun("ckpt_worker.py", 2, save_plan, tmp_path / "first.json", "--steps", "5",
                     "--seed", "1234", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                     "--run-dir", run)
    assert first.returncode == 0, first.stderr[-4000:]
    assert (ckpt / "step_000005" / "trainer.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5))
    assert {"step", "loss", "lr", "tokens_per_s", "mfu", "peak_memory_gib", "step_time_s"} <= set(records[0])
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in records)

    same = torchrun("ckpt_worker.py", 2, save_plan, tmp_path / "same.json", "--steps", "10",
                    "--seed", "1234", "--checkpoint-dir", ckpt, "--resume", "--run-dir", run)
    assert same.returncode == 0, same.stderr[-4000:]
    assert "resumed from" in same.stdout and "(step 5)" in same.stdout
    resumed = json.loads((tmp_path / "same.json").read_text())
    assert len(resumed) == 5
    assert max(_rel(a, b) for a, b in zip(resumed, ref_losses[5:])) <= 1e-6

    # Onto another world size and plan: 4 ranks, dp2 x tp2 (FSDP + TP), same checkpoint.
    other_plan = _write(tmp_path, "dp2tp2.json", plan_dict(dp=2, tp=2, zero_stage=3))
    other = torchrun("ckpt_worker.py", 4, other_plan, tmp_path / "other.json", "--steps", "10",
                     "--seed", "1234", "--checkpoint-dir", ckpt, "--resume",
                     "--run-dir", tmp_path / "run4")
    assert other.returncode == 0, other.stderr[-4000:]
    resharded = json.loads((tmp_path / "other.json").read_text())
    assert max(_rel(a, b) for a, b in zip(resharded, ref_losses[5:])) <= 1e-5


@pytest.mark.slow
def test_killed_rank_resumes_from_last_complete_checkpoint(torchrun, tmp_path):
    ref_losses, _ = reference_run("llama", steps=STEPS)
    plan = _write(tmp_path, "pp2.json", plan_dict(pp=2, schedule="1f1b"))
    ckpt = tmp_path / "ckpt"
    proc = torchrun("ckpt_worker.py", 2, plan, tmp_path / "out.json", "--steps", "10",
                    "--seed", "1234", "--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                    "--resume", "--run-dir", tmp_path / "run",
                    torchrun_args=("--max-restarts=1",),
                    env={"AUTOPLAN_TEST_CRASH_STEP": "7"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Steps 0-6 ran, checkpoint 6 is the last complete one; the half-written step 8/9
    # folders left by the dying rank must be skipped.
    assert "(step 6)" in proc.stdout, proc.stdout[-2000:]
    losses = json.loads((tmp_path / "out.json").read_text())
    assert len(losses) == 4  # steps 6..9 after the restart
    assert _rel(losses[-1], ref_losses[-1]) <= 1e-6


@pytest.mark.slow
def test_zero1_checkpoint_resumes_as_zero1_and_as_fsdp(torchrun, tmp_path):
    """ZeRO-1 keeps each optimizer state on one rank; the checkpoint must still hold all."""
    ref_losses, _ = reference_run("llama", steps=STEPS)
    zero1 = _write(tmp_path, "zero1.json", plan_dict(dp=2, zero_stage=1))
    ckpt = tmp_path / "ckpt"
    first = torchrun("ckpt_worker.py", 2, zero1, tmp_path / "first.json", "--steps", "5",
                     "--seed", "1234", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                     "--run-dir", tmp_path / "run")
    assert first.returncode == 0, first.stderr[-4000:]
    for name, plan in [("again", zero1),
                       ("fsdp", _write(tmp_path, "zero2.json", plan_dict(dp=2, zero_stage=2)))]:
        proc = torchrun("ckpt_worker.py", 2, plan, tmp_path / f"{name}.json", "--steps", "10",
                        "--seed", "1234", "--checkpoint-dir", ckpt, "--resume",
                        "--run-dir", tmp_path / "run")
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses = json.loads((tmp_path / f"{name}.json").read_text())
        assert max(_rel(a, b) for a, b in zip(losses, ref_losses[5:])) <= 1e-5, name
