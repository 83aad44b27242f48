"""sky.yaml read by SkyPilot 0.14.1 itself (schema validation and Task, in
tests/codegen/skypilot_reader_worker.py): the plan's nodes and accelerators, a managed spot job
with recovery, the fastest network tier for several nodes, the checkpoint bucket mounted where
train.py resumes from.

SkyPilot pins click < 8.2, which autoplan's own environment cannot hold, so it is installed
from the package index into a folder of its own (once; AUTOPLAN_TEST_CACHE, default
~/.cache/autoplan-tests) and the reader runs in a subprocess with that folder first on its path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.codegen.job import ModelSource, render_job
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan
from multirank import run_killable

SKYPILOT = "skypilot==0.14.1"
WORKER = Path(__file__).with_name("skypilot_reader_worker.py")


@pytest.fixture(scope="module")
def skypilot_path() -> Path:
    cache = Path(os.environ.get("AUTOPLAN_TEST_CACHE", Path.home() / ".cache" / "autoplan-tests"))
    target = cache / SKYPILOT.replace("==", "-")
    if not (target / "sky" / "__init__.py").is_file():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--target", str(partial), SKYPILOT], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"installing {SKYPILOT} for its reader failed:\n{done.stderr[-3000:]}"
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return target


def sky_yaml(world_size: int, per_node: int, gpu: str = "h100-sxm-80gb") -> str:
    plan = Plan(model=ModelRef("catalog", "llama3.1-8b"), gpu=gpu, world_size=world_size, gpus_per_node=per_node,
                blocks=("layers.0", "layers.1"),
                parallel=ParallelConfig(global_batch=world_size, seq_len=128, dp=world_size,
                                        stage_layers=(2,), layer_recompute=("none", "none")))
    files = render_job(plan, ModelSource("catalog", catalog_name="llama3.1-8b"), command_line="autoplan generate",
                       launchers=("skypilot",))
    return files["sky.yaml"].decode()


CASES = {"8 nodes": (64, 8, "h100-sxm-80gb"), "1 node": (8, 8, "h100-sxm-80gb"), "cpu, 2 nodes": (4, 2, "cpu")}


@pytest.fixture(scope="module")
def read_back(skypilot_path) -> dict[str, dict]:
    texts = [sky_yaml(*case) for case in CASES.values()]
    done = run_killable([sys.executable, str(WORKER), json.dumps(texts)], timeout=180,
                        env={"PYTHONPATH": str(skypilot_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    return dict(zip(CASES, json.loads(line[len("RESULT "):])))


@pytest.mark.parametrize("case", CASES)
def test_skypilot_reads_the_plans_job(read_back, case):
    world_size, per_node, gpu = CASES[case]
    task = read_back[case]
    assert task["num_nodes"] == world_size // per_node
    if gpu == "cpu":
        assert task["accelerators"] is None and task["cpus"] == f"{per_node}+"
    else:
        assert task["accelerators"] == {"H100": per_node}
    assert task["use_spot"] is True
    assert task["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
    assert task["network_tier"] == ("best" if world_size > per_node else None)
    bucket = task["envs"]["CHECKPOINT_BUCKET"]
    assert task["storage_mounts"] == {"/checkpoints": bucket}
    assert "--checkpoint-dir /checkpoints --resume" in task["run"]
    for step in ("setup", "run"):
        subprocess.run(["bash", "-n"], input=task[step], text=True, check=True)
