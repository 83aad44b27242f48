"""benchmarks/gpu_acceptance.sh --dry-run: the GPU acceptance script's whole path (generate,
check, train through launch.sh, validate, the report and its verdict) on CPU ranks with a tiny
model, so the script a GPU session runs once is known to run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from multirank import run_killable

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.sh"


def test_dry_run_walks_the_whole_path(tmp_path):
    out = tmp_path / "acceptance"
    done = run_killable(["bash", str(SCRIPT), "--dry-run", "--steps", "3", "--out", str(out)], timeout=600,
                        env={"PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.startswith(("bf16 ", "fp8 "))}
    assert set(rows) == {"bf16"}
    assert all(float(row[2]) > 0 for row in rows.values())  # a measured step time
    assert "torchtitan: not compared (not judged in --dry-run)" in done.stdout and done.stdout.rstrip().endswith("PASS")
    assert (out / "run-bf16" / "metrics.jsonl").is_file() and (out / "job-bf16" / "plan.json").is_file()


def test_an_out_folder_with_files_is_refused(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    done = run_killable(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)], timeout=120,
                        env={"PYTHON": sys.executable})
    assert done.returncode == 2 and "already holds files" in done.stderr
    assert (tmp_path / "mine.txt").read_text() == "keep"
