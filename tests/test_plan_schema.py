"""Every plan field is checked against one schema (autoplan/plan_schema.py) by every reader:
a hand-edited value is refused by `generate`, `check`, `estimate --plan` and `report --plan`
with exit status 2 and one paragraph naming the field, and by the runtime (train.py
--check-only, as launch.sh runs it) before any value reaches the optimizer.

The commands run in-process (tests/conftest.py run_cli goes through autoplan.cli.main, which
turns a UserError into the one paragraph and exit status 2); each case is refused while the
file is read, before any model is built.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.plan import Plan, PlanFormatError

REPO = Path(__file__).resolve().parents[1]
TINY_JOB = REPO / "generated" / "tiny-gpt-4xcpu"
EXAMPLE = json.loads((TINY_JOB / "plan.json").read_text())
NAN, INF = math.nan, math.inf


def _set(data: dict, dotted: str, value) -> None:
    *parents, key = dotted.split(".")
    for name in parents:
        data = data[name]
    data[key] = value


IMAGES = {"kind": "images", "image_size": 32, "channels": 3, "num_classes": 10}

# (field as the message names it, value written to the plan file); optimizer values are what
# make_optimizer and lr_at read, the rest what the planner, cost model and runtime read
BAD_FIELDS = [
    ("optimizer.lr", NAN), ("optimizer.lr", INF), ("optimizer.lr", -INF), ("optimizer.lr", -1e-3),
    ("optimizer.lr", 0), ("optimizer.lr", "fast"), ("optimizer.lr", True), ("optimizer.lr", None),
    ("optimizer.weight_decay", NAN), ("optimizer.weight_decay", -0.1), ("optimizer.weight_decay", INF),
    ("optimizer.weight_decay", "0.1"),
    ("optimizer.betas", [0.9]), ("optimizer.betas", [0.9, 1.0]), ("optimizer.betas", [-0.1, 0.95]),
    ("optimizer.betas", "0.9,0.95"), ("optimizer.betas", [0.9, "0.95"]), ("optimizer.betas", [NAN, 0.95]),
    ("optimizer.betas", {"beta1": 0.9}), ("optimizer.betas", [0.9, 0.95, 0.99]),
    ("optimizer.grad_clip", NAN), ("optimizer.grad_clip", -1.0), ("optimizer.grad_clip", INF),
    ("optimizer.warmup_steps", -1), ("optimizer.warmup_steps", 2.5), ("optimizer.warmup_steps", "10"),
    ("optimizer.max_steps", -5), ("optimizer.max_steps", 1000.0),
    ("optimizer.name", "sgd"), ("optimizer.name", "adam"), ("optimizer.name", None),
    ("optimizer.schedule", "linear"), ("optimizer.momentum", 0.9),
    ("optimizer", "adamw"), ("optimizer", []),
    ("dp", 0), ("tp", 0), ("pp", 0), ("cp", -1), ("ep", 0), ("vpp", 0), ("micro_batch", 0),
    ("dp", 1.5), ("tp", "2"), ("tp", True), ("global_batch", NAN),
    ("zero_stage", 4), ("precision", "int8"), ("schedule", "1f2b"), ("offload", "disk"),
    ("sequence_parallel", "yes"), ("compile", "yes"), ("compile", 1), ("memory_headroom_gib", NAN), ("inter_node_bandwidth_gb_per_s", 0),
    ("inter_node_bandwidth_gb_per_s", INF), ("gpu", 7), ("gpu", ""),
    ("model.source", "web"), ("model.source", "file"), ("model.source", "config"),
    ("model.path", "evil.py"), ("model.name", ""), ("model.fingerprint", "xyz"),
    ("model.file_sha256", "abc"), ("model.code", "import os"), ("model", None),
    ("tp_styles", {"": {"lm_head": "shard_everything"}}), ("cp_buffers", {"rope_cos": -1}),
    ("stages", "layers"), ("recompute", {"layers.0-1": "most"}),
    ("estimate.step_time_s", "fast"), ("estimate.model_flops_per_token", -1),
    ("inputs", "images"), ("inputs", dict(IMAGES, kind="video")), ("inputs", dict(IMAGES, image_size=0)),
    ("inputs", dict(IMAGES, num_classes=1)), ("inputs", dict(IMAGES, channels=2.5)),
    ("inputs", dict(IMAGES, loss="import os")),
]
# the name the message gives: an edited model.source is reported on the path it now needs
NAMED = {("model.source", "file"): "model.path", ("model.source", "config"): "model.path"}


def _named(field: str, value) -> str:
    return NAMED.get((field, str(value)), field)


def _bad_plan(field: str, value) -> dict:
    data = copy.deepcopy(EXAMPLE)
    _set(data, field, value)
    return data


def test_there_are_many_cases():
    assert len(BAD_FIELDS) >= 40


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_each_bad_field_is_refused_by_every_command(field, value, tmp_path, run_cli, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_bad_plan(field, value)))  # NaN and Infinity as Python's json writes them
    monkeypatch.chdir(tmp_path)
    named = _named(field, value)
    for command in (["generate", "tiny-gpt", "--plan", "plan.json", "-o", "job"], ["check", "plan.json"],
                    ["estimate", "--plan", "plan.json"], ["report", "--plan", "plan.json"]):
        code, out, err = run_cli(*command)
        text = " ".join(err.split())
        assert code == 2, (command, out, err)
        assert named in text and "Traceback" not in err, (command, err)
        assert err.strip() and "\n\n" not in err.strip(), err  # one paragraph
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_each_bad_field_is_refused_by_the_runtimes_reader(field, value):
    with pytest.raises(PlanFormatError, match=_named(field, value).replace(".", r"\.")):
        Plan.from_dict(_bad_plan(field, value))


def test_every_committed_plan_loads():
    plans = [*REPO.glob("generated/*/plan.json"), *REPO.glob("tests/data/plan_*.json")]
    assert len(plans) >= 5
    for path in plans:
        Plan.load(path)


@pytest.mark.parametrize("optimizer", [
    {"name": "adamw", "lr": 1e-3, "betas": [0.0, 0.999], "weight_decay": 0, "warmup_steps": 0,
     "max_steps": 0, "grad_clip": 0},
    {"lr": 3e-4, "schedule": "constant"}, {"schedule": "cosine"}, {},
])
def test_valid_optimizer_settings_load(optimizer):
    assert Plan.from_dict({**EXAMPLE, "optimizer": optimizer}).optimizer == optimizer


def test_train_py_check_only_refuses_a_nan_learning_rate(tmp_path):
    # train.py as `autoplan generate` writes it, its PLAN edited by hand; launch.sh runs this
    # same `train.py --check-only` before torchrun
    text = (TINY_JOB / "train.py").read_text()
    edited = text.replace("'lr': 0.0003,", "'lr': float('nan'),")
    assert edited != text
    (tmp_path / "train.py").write_text(edited)
    result = subprocess.run([sys.executable, str(tmp_path / "train.py"), "--check-only"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "autoplan: error: optimizer.lr must be a finite number > 0, got nan" in result.stderr
    assert "Traceback" not in result.stderr


# torch's Schedule1F1B refuses fewer micro-batches than stages when the job starts, its
# interleaved schedules refuse a count that is not whole rounds of pp (5 at pp 2), and the
# zero-bubble schedules train wrong weights under ZeRO-3 (config.schedule_problem's numbers):
# a plan file asking for any is refused when read, and the planner never offers them.
TWO_STAGES, FOUR_STAGES = [["layers.0"], ["layers.1"]], [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
SCHEDULE_CASES = [
    ({"pp": 2, "dp": 2, "micro_batch": 4, "schedule": "1f1b"}, "1f1b schedule needs at least as many"),
    ({"pp": 2, "dp": 2, "micro_batch": 1, "zero_stage": 3, "schedule": "zero-bubble"}, "zero-bubble"),
    ({"pp": 2, "dp": 2, "micro_batch": 1, "global_batch": 10, "zero_stage": 1, "schedule": "zero-bubble"},
     "5 micro-batches are not 2 whole rounds"),
    ({"pp": 2, "dp": 2, "micro_batch": 1, "global_batch": 10, "vpp": 2, "stages": FOUR_STAGES,
      "schedule": "interleaved-1f1b"}, "5 micro-batches are not 2 whole rounds"),
]
SCHEDULE_IDS = ["1f1b_too_few_microbatches", "zero_bubble_zero3", "zero_bubble_partial_round",
                "interleaved_partial_round"]


@pytest.mark.parametrize("changes,message", SCHEDULE_CASES, ids=SCHEDULE_IDS)
def test_a_schedule_the_runtime_cannot_run_is_refused_when_read(changes, message):
    stages = {"stages": TWO_STAGES}
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_dict({**EXAMPLE, **stages, **changes})
    fine = {**changes, "schedule": "gpipe"}
    Plan.from_dict({**EXAMPLE, **stages, **fine})  # the same plan under GPipe loads


@pytest.mark.parametrize("fixes", [["schedule=1f1b", "micro-batch=4"], ["schedule=zero-bubble", "zero=3"],
                                   ["schedule=zero-bubble", "micro-batch=1"]],
                         ids=["1f1b_too_few_microbatches", "zero_bubble_zero3", "zero_bubble_partial_round"])
def test_the_planner_never_offers_such_a_schedule(fixes, run_cli, tmp_path):
    batch = "10" if "micro-batch=1" in fixes else "8"
    args = ["plan", "tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", batch, "--seq-len", "64",
            "--fix", "pp=2", "--fix", "dp=2", "-o", str(tmp_path / "plan.json")]
    code, out, err = run_cli(*args, *[a for fix in fixes for a in ("--fix", fix)])
    assert code == 2 and "no configuration" in " ".join(err.split()), (out, err)
    code, out, err = run_cli(*args, "--fix", fixes[1])  # free to pick the schedule, it plans
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert Plan.from_dict(plan) and not (plan["schedule"] == "zero-bubble" and plan["zero_stage"] == 3)
