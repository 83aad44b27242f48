"""`validate --run`: predicted vs measured of a run directory (synthetic, and the generated tiny job)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import subprocess
from pathlib import Path

import pytest

from autoplan.calibrate.error import measured_error
from autoplan.errors import UserError
from autoplan.planfile import write_plan
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan
from autoplan.validate.measured import render_run, compare_run_dir

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, estimate: dict | None = None, gpu: str = "h100-sxm-80gb") -> Path:
    job = tmp_path / "job"
    (job / "runs" / "r1").mkdir(parents=True, exist_ok=True)
    est = {"step_time_s": 0.5, "tokens_per_s": 8 * 128 / 0.5, "mfu": 0.02, "memory_gib_per_gpu": 1.5,
           "per_stage": [{"stage": 0, "memory_gib": 1.5}, {"stage": 1, "memory_gib": 1.0}]}
    write_plan(Plan(model=ModelRef("catalog", "tiny-gpt"), gpu=gpu, world_size=4, gpus_per_node=8,
                    parallel=ParallelConfig(global_batch=8, seq_len=128, dp=2, pp=2, stage_layers=(1, 1)),
                    blocks=("layers.0", "layers.1"),
                    estimate=est if estimate is None else estimate), job / "plan.json")
    return job


def _metrics(run: Path, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_synthetic_run_errors_skip_warmup(tmp_path):
    run = _job(tmp_path) / "runs" / "r1"
    times = [5.0, 2.0, 0.4, 0.4, 0.6]  # the first two are warm-up and must not count
    rows = []
    for step, t in enumerate(times):
        rows.append({"step": step, "loss": 5.0, "lr": 1e-4, "tokens_per_s": 1024 / t, "mfu": 0.01,
                     "peak_memory_gib": 1.0 + 0.1 * step, "step_time_s": t, "rank": 0})
        rows.append({"step": step, "loss": 5.0, "lr": 1e-4, "tokens_per_s": 1024 / t, "mfu": 0.01,
                     "peak_memory_gib": 2.0, "step_time_s": t, "rank": 3})
    _metrics(run, rows)
    report = compare_run_dir(run)
    assert (report["warmup_steps"], report["steps_used"]) == (2, 3)
    assert report["measured"]["step_time_s"] == pytest.approx(0.4)  # median of 0.4, 0.4, 0.6
    assert report["error"]["step_time_s"] == pytest.approx((0.5 - 0.4) / 0.4)
    assert report["error"]["tokens_per_s"] == pytest.approx((2048 - 2560) / 2560)
    assert report["error"]["mfu"] == pytest.approx(1.0)  # 0.02 predicted vs 0.01 measured
    ranks = {r["rank"]: r for r in report["per_rank"]}
    # rank 0 is pipeline stage 0 (1.5 GiB predicted), rank 3 stage 1 (1.0 GiB); peaks over steps 2..4
    assert ranks[0]["measured_peak_memory_gib"] == pytest.approx(1.4) and ranks[0]["predicted_memory_gib"] == 1.5
    assert ranks[3]["stage"] == 1 and ranks[3]["error"] == pytest.approx(-0.5)
    assert measured_error(run) == pytest.approx(0.25)


def test_short_run_keeps_one_step_and_step_time_from_tokens(tmp_path):
    run = _job(tmp_path) / "runs" / "r1"
    _metrics(run, [{"step": 0, "loss": 1.0, "lr": 0.0, "tokens_per_s": 2048.0, "mfu": None,
                    "peak_memory_gib": 1.0}])
    report = compare_run_dir(run)
    assert (report["warmup_steps"], report["steps_used"]) == (0, 1)
    assert report["measured"]["step_time_s"] == pytest.approx(0.5)  # 8 x 128 tokens / 2048 tok/s
    assert report["error"]["mfu"] is None and report["notes"]


def test_render_prints_every_metric(tmp_path):
    from rich.console import Console

    run = _job(tmp_path) / "runs" / "r1"
    _metrics(run, [{"step": s, "loss": 1.0, "lr": 0.0, "tokens_per_s": 2048.0, "mfu": 0.01,
                    "peak_memory_gib": 1.0, "step_time_s": 0.5} for s in range(4)])
    console = Console(record=True, width=150)
    render_run(compare_run_dir(run), console)
    text = console.export_text()
    for label in ("step time", "tokens/s", "MFU", "peak memory", "+0.0%"):
        assert label in text


def test_bad_runs_are_user_errors(tmp_path):
    job = _job(tmp_path)
    run = job / "runs" / "r1"
    with pytest.raises(UserError, match="does not exist"):
        compare_run_dir(run)
    (run / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(UserError, match="line 2"):
        compare_run_dir(run)
    with pytest.raises(UserError, match="no plan.json"):
        compare_run_dir(tmp_path)  # metrics aside, there is no plan above tmp_path
    _job(tmp_path, estimate={})
    _metrics(run, [{"step": 0, "step_time_s": 1.0}])
    with pytest.raises(UserError, match="no predicted estimate"):
        compare_run_dir(run)


GENERATED = REPO / "generated" / "tiny-gpt-4xcpu"


@pytest.mark.slow
@pytest.mark.skipif(not (GENERATED / "launch.sh").is_file(), reason="generated tiny job not present")
def test_validate_a_real_run_of_the_generated_tiny_job(tmp_path):
    job = tmp_path / "tiny-gpt-4xcpu"
    shutil.copytree(GENERATED, job)
    run = job / "runs" / "test"
    proc = subprocess.Popen(["bash", str(job / "launch.sh"), "--steps", "6", "--run-dir", str(run)],
                            cwd=job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable,
                                     PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"tiny job hung:\n{out[-2000:]}\n{err[-2000:]}")
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    report = compare_run_dir(run)
    assert report["steps_total"] == 6 and report["warmup_steps"] == 2
    for key in ("step_time_s", "tokens_per_s", "peak_memory_gib"):
        assert report["measured"][key] > 0
    # a CPU run: compared with the CPU cost model, its process RSS not compared with device memory
    assert (report["device"], report["cost_model"]) == ("cpu", "cpu")
    assert report["error"]["step_time_s"] is not None and report["error"]["peak_memory_gib"] is None
    assert report["plan"].endswith("plan.json") and report["per_rank"][0]["rank"] == 0


def _cpu_rows(step_time_s: float) -> list[dict]:
    return [{"step": s, "loss": 1.0, "lr": 0.0, "tokens_per_s": 1024 / step_time_s, "mfu": 0.001,
             "peak_memory_gib": 0.33, "step_time_s": step_time_s, "device": "cpu"} for s in range(4)]


def test_a_cpu_run_of_a_gpu_plan_is_compared_with_the_cpu_cost_model(tmp_path):
    run = _job(tmp_path) / "runs" / "r1"  # the plan predicts 0.5 s on an H100
    _metrics(run, _cpu_rows(2.0))
    with pytest.raises(UserError, match="ran on CPU but .* planned for h100-sxm-80gb"):
        compare_run_dir(run)  # never compared with the GPU's prediction
    cpu = {"step_time_s": 1.0, "tokens_per_s": 1024.0, "mfu": 0.002, "memory_gib_per_gpu": 1.1,
           "per_stage": [{"stage": 0, "memory_gib": 1.1}]}
    asked = []
    report = compare_run_dir(run, cpu_estimate=lambda path: asked.append(path) or cpu)
    assert asked == [run.parent.parent / "plan.json"]
    assert (report["device"], report["cost_model"], report["gpu"]) == ("cpu", "cpu", "h100-sxm-80gb")
    assert report["error"]["step_time_s"] == pytest.approx(-0.5)  # 1 s predicted on CPU vs 2 s measured
    assert report["error"]["peak_memory_gib"] is None and report["per_rank"][0]["error"] is None
    assert any("re-estimated on 4 CPU ranks" in note for note in report["notes"])


def test_cpu_run_notes_match_the_sign_of_the_errors(tmp_path):
    from rich.console import Console

    run = _job(tmp_path, gpu="cpu") / "runs" / "r1"  # predicts 0.5 s and 1.5 GiB on CPU ranks
    _metrics(run, _cpu_rows(2.0))
    slow = compare_run_dir(run)
    assert slow["error"]["step_time_s"] == pytest.approx(-0.75)
    assert any("4.0x the predicted time" in n for n in slow["notes"])
    assert not any("read high" in n for n in slow["notes"])  # measured RSS 0.33 < 1.5 predicted
    assert any("memory is not compared" in n for n in slow["notes"])
    console = Console(record=True, width=120)
    render_run(slow, console)
    text = console.export_text()
    assert "CPU run (4 gloo ranks)" in text and "vs the cpu cost model" in text and "RSS" in text
    _metrics(run, _cpu_rows(0.25))
    fast = compare_run_dir(run)
    assert fast["error"]["step_time_s"] == pytest.approx(1.0)
    assert any("0.50x the predicted time: faster" in n for n in fast["notes"])
