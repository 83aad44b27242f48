"""`--compile`: the plan, its file, the job's command line and the refusals around it."""

from __future__ import annotations

import json

ARGS = ("tiny-gpt", "--gpu", "h100", "--gpus", "2", "--global-batch", "4", "--seq-len", "256")


def test_plan_compile_writes_it_into_the_plan_and_its_estimate(run_cli, tmp_path):
    code, out, _ = run_cli("plan", *ARGS, "--compile", "--json", "-o", str(tmp_path / "plan.json"))
    assert code == 0
    assert json.loads(out)["plan"]["compile"] is True
    assert json.loads((tmp_path / "plan.json").read_text())["compile"] is True
    code, eager_out, _ = run_cli("plan", *ARGS, "--json")
    assert json.loads(eager_out)["plan"]["compile"] is False
    assert json.loads(out)["estimate"]["step_time_s"] < json.loads(eager_out)["estimate"]["step_time_s"]


def test_an_eager_plan_says_what_compiling_would_gain(run_cli):
    code, out, _ = run_cli("plan", *ARGS, "--json")
    notes = json.loads(out)["solver"]["notes"]
    assert code == 0 and any("--compile" in note and "faster" in note for note in notes), notes
    code, out, _ = run_cli("plan", *ARGS, "--compile", "--json")
    assert not any("--compile" in note for note in json.loads(out)["solver"]["notes"])


def test_generate_with_a_plan_file_refuses_compile_by_its_flag(run_cli, tmp_path):
    assert run_cli("plan", *ARGS, "-o", str(tmp_path / "plan.json"))[0] == 0
    code, _, err = run_cli("generate", "tiny-gpt", "--plan", str(tmp_path / "plan.json"), "--compile",
                           "-o", str(tmp_path / "job"))
    assert code == 2 and "--compile would be ignored" in err, err


def test_generate_compile_writes_the_flag_into_the_jobs_command_and_plan(run_cli, tmp_path):
    code, _, err = run_cli("generate", *ARGS, "--compile", "-o", str(tmp_path / "job"))
    assert code == 0, err
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["compile"] is True
    readme = (tmp_path / "job" / "README.md").read_text()
    assert "--compile" in readme and "--compile True" not in readme
    assert "enable = true" in (tmp_path / "job" / "torchtitan.toml").read_text()
