"""`autoplan generate`: --plan files, refusals and bad input (exit status 2, one clear message)."""

from __future__ import annotations

import json

import pytest

from codegen_helpers import generate


@pytest.fixture
def plan_file(tiny_job, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text((tiny_job / "plan.json").read_text())
    return path


def edited(plan_file, **changes):
    data = json.loads(plan_file.read_text())
    data.update(changes)
    plan_file.write_text(json.dumps(data))
    return plan_file


def test_plan_file_gives_the_same_job(tiny_job, plan_file, tmp_path):
    out = tmp_path / "again"
    code, stdout, stderr = generate("tiny-gpt", "--plan", str(plan_file), "--gpus", "4", "-o", str(out))
    assert code == 0, stdout + stderr
    for name in ("train.py", "plan.json", "launch.sh", "slurm.sbatch", "ds_config.json"):
        assert (out / name).read_bytes() == (tiny_job / name).read_bytes(), name


def expect_user_error(*args, match: str) -> str:
    code, stdout, stderr = generate(*args)
    assert code == 2, stdout + stderr
    assert "Traceback" not in stderr
    # the paragraph is wrapped to the terminal, where a long temporary path moves the breaks
    assert match in " ".join(stderr.split()), stderr
    return stderr


def test_not_a_plan_file(plan_file, tmp_path):
    data = json.loads(plan_file.read_text())
    data["banana"] = 1
    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps(data))
    expect_user_error("tiny-gpt", "--plan", str(bad), match="not a plan file")
    expect_user_error("tiny-gpt", "--plan", str(edited(plan_file, format_version=99)),
                      match="format_version")
    (tmp_path / "junk.json").write_text("not json")
    expect_user_error("tiny-gpt", "--plan", str(tmp_path / "junk.json"), match="not JSON")
    expect_user_error("tiny-gpt", "--plan", str(tmp_path / "missing.json"), match="does not exist")


def test_world_size_that_does_not_match(plan_file):
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "--gpus", "8", match="world size of 4")
    # a plan whose degrees do not multiply to its world size is not a valid plan
    expect_user_error("tiny-gpt", "--plan", str(edited(plan_file, world_size=8)), match="world_size 8")


def test_plan_for_another_model(plan_file):
    expect_user_error("tiny-moe", "--plan", str(plan_file), match="was made for the model")


def test_plan_options_that_would_be_ignored(plan_file):
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "--fix", "tp=2", match="--fix")
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "--memory-headroom", "1", match="--memory-headroom ")


def test_nothing_to_plan_with():
    expect_user_error("tiny-gpt", "--gpu", "cpu", match="--global-batch")


def test_output_path_that_is_a_file(plan_file, tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "-o", str(target), match="is a file")
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "-o", str(target / "sub"),
                      match="is a file")


def test_existing_directory_needs_force(plan_file, tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "-o", str(out), match="--force")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    code, stdout, stderr = generate("tiny-gpt", "--plan", str(plan_file), "-o", str(out), "--force")
    assert code == 0, stdout + stderr
    assert (out / "notes.txt").read_text() == "mine" and (out / "train.py").is_file()


@pytest.mark.parametrize("name", ["launch.sh", "README.md"])
def test_force_does_not_write_through_a_link_in_the_job_folder(plan_file, tmp_path, name):
    out = tmp_path / "job"
    code, stdout, stderr = generate("tiny-gpt", "--plan", str(plan_file), "-o", str(out))
    assert code == 0, stdout + stderr
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    target.chmod(0o644)
    (out / name).unlink()
    (out / name).symlink_to(target)
    expect_user_error("tiny-gpt", "--plan", str(plan_file), "-o", str(out), "--force",
                      match=f"{out / name} is a symbolic link (to {target})")
    assert target.read_text() == "keep me" and target.stat().st_mode & 0o777 == 0o644
    assert (out / name).is_symlink()  # the refused run changed nothing


def test_nothing_fits_is_exit_1(tmp_path):
    code, stdout, stderr = generate("llama3.1-70b", "--gpu", "cpu", "--gpus", "2", "--global-batch", "2",
                                    "-o", str(tmp_path / "x"))
    assert code == 1, stdout + stderr
    assert not (tmp_path / "x").exists()


def test_partial_last_node_is_refused(plan_file, tmp_path):
    # the planner refuses such a cluster; a plan file can still say 6 ranks on 4-GPU nodes
    uneven = edited(plan_file, world_size=6, dp=6, global_batch=12)
    expect_user_error("tiny-gpt", "--plan", str(uneven), "-o", str(tmp_path / "x"), match="do not fill whole nodes")
