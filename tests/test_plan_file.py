"""plan.json fields are checked on load (autoplan.plan_schema.field_problems), every wrong one named."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from autoplan.plan import Plan, PlanFormatError

EXAMPLE = json.loads((Path(__file__).resolve().parents[1] / "generated" / "tiny-gpt-4xcpu"
                      / "plan.json").read_text())


@pytest.mark.parametrize("changes,message", [
    ({"zero_stage": 7}, "zero_stage must be 0, 1, 2 or 3, got 7"),
    ({"zero_stage": True}, "zero_stage must be 0, 1, 2 or 3, got True"),
    ({"recompute": "full"}, "recompute must map block paths"),
    ({"recompute": {"layers.0": "most"}}, "recompute must map block paths"),
    ({"dp": "4"}, "dp must be a positive integer, got '4'"),
    ({"micro_batch": 0}, "micro_batch must be a positive integer, got 0"),
    ({"world_size": 4_000_000, "dp": 4_000_000}, "world_size 4,000,000 is above autoplan's limit"),
    ({"precision": "int4"}, "precision must be one of"),
    ({"schedule": None}, "schedule must be one of"),
    ({"memory_headroom_gib": -1}, "memory_headroom_gib must be a number >= 0"),
    ({"stages": [["layers.0", 1]]}, "stages must be a list of lists"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr must be a finite number > 0"),
    ({"model": {"source": "web", "name": "x"}}, "model.source must be one of"),
    ({"precision": "fp8", "float8_recipe": "blockwise"}, "float8_recipe must be one of"),
    ({"precision": "fp8", "float8_all_gather": "yes"}, "float8_all_gather must be true or false"),
    ({"float8_recipe": "rowwise"}, "float8_recipe and float8_all_gather apply to fp8 plans only"),
    ({"precision": "fp8", "float8_all_gather": True}, "float8_all_gather needs ZeRO-3"),
    ({"precision": "fp8", "zero_stage": 3, "float8_all_gather": True, "float8_recipe": "rowwise"},
     "float8_all_gather needs the tensorwise recipe"),
])
def test_wrong_fields_are_named(changes, message):
    with pytest.raises(PlanFormatError, match=message.replace("(", r"\(").replace("{", r"\{")):
        Plan.from_dict({**EXAMPLE, **changes})


def test_every_wrong_field_is_reported_at_once():
    with pytest.raises(PlanFormatError) as exc:
        Plan.from_dict({**EXAMPLE, "zero_stage": 9, "offload": "disk", "tp": -1})
    assert all(name in str(exc.value) for name in ("zero_stage", "offload", "tp"))


def test_the_example_plan_loads():
    assert Plan.from_dict(EXAMPLE).world_size == 4


def test_an_fp8_plan_file_keeps_its_float8_settings_and_others_have_none():
    fp8 = {**EXAMPLE, "precision": "fp8", "zero_stage": 3, "float8_all_gather": True}
    plan = Plan.from_dict(fp8)
    assert (plan.float8_recipe, plan.float8_all_gather) == ("tensorwise", True)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert {"float8_recipe": "tensorwise", "float8_all_gather": True}.items() <= plan.to_dict().items()
    assert not {"float8_recipe", "float8_all_gather"} & set(Plan.from_dict(EXAMPLE).to_dict())


# ---------------------------------------------------------------- the model a plan names

TINY_MODEL = '''
from pathlib import Path

import torch.nn as nn

with open(Path(__file__).parent / "imported.log", "a") as log:  # the marker: this file ran
    log.write(__file__ + "\\n")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)
'''
EVIL = '''
from pathlib import Path

(Path(__file__).parent / "imported.log").write_text("evil.py ran")
'''
PLAN_COMMANDS = {"check": ["check", "plans/plan.json"], "estimate": ["estimate", "--plan", "plans/plan.json"],
                 "report": ["report", "--plan", "plans/plan.json"]}


def _cli(*args: str) -> tuple[int, str]:
    """The CLI in-process, as tests/conftest.py run_cli: (exit status, stdout + stderr)."""
    import click
    from click.testing import CliRunner

    from autoplan.cli import main

    @click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.pass_context
    def entry(ctx):
        main(ctx.args)

    result = CliRunner().invoke(entry, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout + result.stderr


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """models/tiny.py and plans/plan.json made for it with `autoplan plan` (the marker removed)."""
    root = tmp_path_factory.mktemp("planned")
    (root / "models").mkdir()
    (root / "models" / "tiny.py").write_text(TINY_MODEL)
    (root / "plans").mkdir()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        code, out = _cli("plan", "models/tiny.py", "--gpu", "cpu", "--gpus", "1", "--global-batch", "2",
                         "--seq-len", "16", "-o", "plans/plan.json")
    finally:
        os.chdir(cwd)
    assert code == 0, out
    (root / "models" / "imported.log").unlink()
    return root


@pytest.fixture
def job(planned, tmp_path, monkeypatch) -> Path:
    shutil.copytree(planned, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _edit_plan(root: Path, **model) -> None:
    path = root / "plans" / "plan.json"
    data = json.loads(path.read_text())
    data["model"].update(model)
    data["model"] = {k: v for k, v in data["model"].items() if v is not None}
    path.write_text(json.dumps(data))


def _markers(root: Path) -> list[Path]:
    return sorted(root.rglob("imported.log"))


def test_the_plan_names_its_model_relative_to_itself_with_the_files_hash(job, tmp_path):
    data = json.loads((job / "plans" / "plan.json").read_text())
    assert data["model"]["path"] == "../models/tiny.py"
    assert data["model"]["file_sha256"] == hashlib.sha256((job / "models" / "tiny.py").read_bytes()).hexdigest()
    elsewhere = job / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)  # not where the plan was made: the path is the plan file's
    code, out = _cli("estimate", "--plan", "../plans/plan.json")
    assert code == 0, out
    assert _markers(job) == [job / "models" / "imported.log"]  # its bytes matched: it may run


def _relative_elsewhere(root: Path) -> None:
    (root / "evil.py").write_text(EVIL)  # beside the current directory, not the plan file
    _edit_plan(root, path="evil.py")


def _absolute(root: Path) -> None:
    (root / "evil.py").write_text(EVIL)
    _edit_plan(root, path=str(root / "evil.py"))


def _edited_bytes(root: Path) -> None:
    model = root / "models" / "tiny.py"
    model.write_text(model.read_text() + "\n# edited after planning\n")


def _no_hash(root: Path) -> None:
    _edit_plan(root, file_sha256=None)  # as a plan made before autoplan recorded it


UNTRUSTED = {"relative path, resolved against the plan's folder": (_relative_elsewhere, "does not exist"),
             "absolute path to other bytes": (_absolute, "file_sha256 differs"),
             "model file edited after planning": (_edited_bytes, "file_sha256 differs"),
             "plan without file_sha256": (_no_hash, "records no sha256")}


@pytest.mark.parametrize("command", sorted(PLAN_COMMANDS))
@pytest.mark.parametrize("case", sorted(UNTRUSTED))
def test_a_plan_never_runs_a_model_file_it_cannot_vouch_for(job, case, command):
    edit, message = UNTRUSTED[case]
    edit(job)
    code, out = _cli(*PLAN_COMMANDS[command])
    assert code == 2, out
    text = " ".join(out.split())
    assert message in text and "MODEL" in text and "Traceback" not in out, out
    assert "\n\n" not in out.strip()  # one paragraph
    assert _markers(job) == []  # no model file ran


def test_the_model_given_on_the_command_line_is_the_users_choice(job):
    _edited_bytes(job)  # a comment: the same parameters, so the same model fingerprint
    code, out = _cli("estimate", "models/tiny.py", "--plan", "plans/plan.json")
    assert code == 0, out
    code, out = _cli("report", "models/tiny.py", "--plan", "plans/plan.json", "--price", "cpu=1")
    assert code == 0, out
    assert _markers(job) == [job / "models" / "imported.log"]


def test_trust_plan_model_loads_the_file_the_plan_names(job):
    _no_hash(job)
    code, out = _cli("estimate", "--plan", "plans/plan.json", "--trust-plan-model")
    assert code == 0, out
    assert _markers(job) == [job / "models" / "imported.log"]
    # trusted, but still the model the plan was made for (its fingerprint)
    (job / "models" / "tiny.py").write_text(TINY_MODEL.replace("nn.Linear(16, 64)", "nn.Linear(16, 65)"))
    code, out = _cli("estimate", "--plan", "plans/plan.json", "--trust-plan-model")
    assert code == 2 and "fingerprint differs" in " ".join(out.split()), out


def test_an_edited_model_source_is_refused(job):
    # a model file's plan edited to say its model is a config built with its transformers class
    _edit_plan(job, source="transformers")
    code, out = _cli("estimate", "--plan", "plans/plan.json")
    assert code == 2 and "model.path of a transformers model must be a path ending in .json" in \
        " ".join(out.split()), out
    assert _markers(job) == []
