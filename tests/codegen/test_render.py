"""Rendering: escaping of user strings, literal plans, and the generated files' syntax."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import py_compile
import runpy
import shlex
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.codegen.job import (_file_builder, environment, md_escape, py_literal, safe_name,
                              sh_quote)
from autoplan.errors import UserError
from autoplan.plan import Plan

from codegen_helpers import REPO, TINY, generate

NASTY = ["plain", "with space", "it's", 'say "hi"', "back\\slash", "new\nline", "$(rm -rf ~)",
         "`id`", "semi;colon", "tab\tchar", "ünïcode", "'''", '"""', "{{ jinja }}", "# hash"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(), children, max_size=6),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_py_literal_round_trips(value):
    text = py_literal(value, width=40)  # narrow, so nesting and line packing are exercised
    assert ast.literal_eval(text) == value


def test_py_literal_non_finite_floats_are_code_not_names():
    assert eval(py_literal({"a": math.inf})) == {"a": math.inf}  # noqa: S307 (our own literal)


@pytest.mark.parametrize("text", NASTY)
def test_sh_quote_is_one_word_for_bash(text):
    out = subprocess.run(["bash", "-c", f"printf %s {sh_quote(text)}"], capture_output=True,
                         text=True, check=True).stdout
    assert out == text


@pytest.mark.parametrize("text", NASTY)
def test_md_escape_stays_on_one_line_and_out_of_tables(text):
    escaped = md_escape(text)
    assert "\n" not in escaped
    assert "|" not in escaped.replace("\\|", "")


@pytest.mark.parametrize("text", NASTY)
def test_safe_name(text):
    name = safe_name(text)
    assert name and all(c.isalnum() or c in "._-" for c in name)


def test_templates_refuse_raw_user_strings():
    env = environment()
    with pytest.raises(ValueError, match="unescaped"):
        env.from_string("x = {{ name }}").render(name='a "b"')
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("x = {{ missing }}").render()
    assert env.from_string("x = {{ name|py }}").render(name='a "b"') == "x = 'a \"b\"'"


@pytest.mark.parametrize("source,expected", [
    ("def build_model(seq_len=8):\n    pass\nclass M: pass\n", ("build_model", '(seq_len=PLAN["seq_len"])')),
    ("def build_model():\n    pass\nmodel = 1\n", ("build_model", "()")),
    ("from elsewhere import build_model\n", ("build_model", "()")),
    ("import torch\nmodel = torch.nn.Linear(2, 2)\n", ("model", "")),
    ("class Net: pass\n", ("Net", "()")),
])
def test_file_builder_follows_the_loader_rule(source, expected):
    assert _file_builder(source.encode(), "Net") == expected


# ---------------------------------------------------------------- the generated tiny job


def test_job_files(tiny_job):
    assert sorted(p.name for p in tiny_job.iterdir()) == sorted(
        ["train.py", "launch.sh", "slurm.sbatch", "plan.json", "ds_config.json", "torchtitan.toml", "megatron.args",
         "README.md"])
    for name in ("train.py", "launch.sh", "slurm.sbatch"):
        assert (tiny_job / name).stat().st_mode & 0o111, f"{name} is not executable"
    json.loads((tiny_job / "ds_config.json").read_text())


def test_train_py_holds_the_exact_plan(tiny_job):
    tree = ast.parse((tiny_job / "train.py").read_text())
    assigned = {node.targets[0].id: node.value for node in tree.body
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    plan = json.loads((tiny_job / "plan.json").read_text())
    assert ast.literal_eval(assigned["PLAN"]) == plan
    assert Plan.from_dict(plan).world_size == 4
    assert ast.get_docstring(tree).count("torchrun --nnodes 1 --nproc-per-node 4 train.py") == 1


def test_generated_python_compiles_and_scripts_parse(tiny_job):
    py_compile.compile(str(tiny_job / "train.py"), doraise=True, cfile=str(tiny_job.parent / "t.pyc"))
    for script in ("launch.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(tiny_job / script)], check=True)


def test_shellcheck(tiny_job, shellcheck):
    result = subprocess.run([shellcheck, "-S", "style", "launch.sh", "slurm.sbatch"], cwd=tiny_job,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_build_model_of_train_py_is_the_planned_model(tiny_job):
    namespace = runpy.run_path(str(tiny_job / "train.py"), run_name="not_main")
    with torch.device("meta"):
        model = namespace["build_model"]()  # raises UserError if the fingerprint differs
    assert sum(p.numel() for p in model.parameters()) > 0


def test_readme_shows_the_prediction_and_launch(tiny_job):
    readme = (tiny_job / "README.md").read_text()
    est = json.loads((tiny_job / "plan.json").read_text())["estimate"]
    assert f"{est['step_time_s']:.3f} s" in readme
    assert f"{est['mfu']:.1%}" in readme
    assert "./launch.sh --steps 100" in readme
    assert "autoplan generate tiny-gpt --gpu cpu --gpus 4" in readme  # the regeneration command
    assert str(tiny_job) not in readme  # no absolute paths


# ---------------------------------------------------------------- user strings that need escaping


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "dir with 'quote\""
    folder.mkdir()
    path = folder / "my \"odd\" model's.py"
    shutil.copy(REPO / "examples" / "nano_gpt.py", path)
    return path


def test_model_file_path_with_space_and_quotes(odd_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default output dir is relative to the current directory
    code, out, err = generate(str(odd_model), *TINY, "--gpus", "2")
    assert code == 0, out + err
    (job,) = (tmp_path / "generated").iterdir()
    assert job.name == "my-odd-model-s-2xcpu"
    assert (job / "model.py").read_bytes() == odd_model.read_bytes()
    text = (job / "train.py").read_text()
    ast.parse(text)
    plan = json.loads((job / "plan.json").read_text())
    # the job's plan names its own copy, relative to plan.json (as `autoplan check JOB` reads it)
    assert plan["model"]["path"] == "model.py"
    assert plan["model"]["file_sha256"] == hashlib.sha256(odd_model.read_bytes()).hexdigest()
    # the path reaches train.py only inside the repr'd PLAN literal
    assert str(odd_model) not in text.replace(repr(str(odd_model)), "")
    for script in ("launch.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(job / script)], check=True)
        assert "odd" not in (job / script).read_text().replace("my-odd-model-s", "")
    readme = (job / "README.md").read_text()
    command = readme.split("## Regenerate")[1].split("```bash\n")[1].split("\n```")[0]
    assert shlex.split(command)[:3] == ["autoplan", "generate", str(odd_model)]
    # train.py builds the copied model.py, and it is the planned model (fingerprint check)
    namespace = runpy.run_path(str(job / "train.py"), run_name="not_main")
    with torch.device("meta"):
        model = namespace["build_model"]()
    assert type(model).__name__ == "NanoGPT"
    # an edited copy is not the planned model any more: train.py stops before training
    (job / "model.py").write_text(odd_model.read_text().replace("LAYERS, HEADS, MAX_SEQ = 256, 64, 2",
                                                                "LAYERS, HEADS, MAX_SEQ = 256, 64, 3"))
    with torch.device("meta"), pytest.raises(UserError, match="differs"):
        runpy.run_path(str(job / "train.py"), run_name="not_main")["build_model"]()


def test_config_json_is_copied_and_built_from(tmp_path):
    config = json.loads((REPO / "cost_models" / "models" / "tiny-gpt.json").read_text())
    src = tmp_path / "my cfg" / "config.json"
    src.parent.mkdir()
    src.write_text(json.dumps(config))
    out = tmp_path / "job"
    code, stdout, stderr = generate(str(src), *TINY, "--gpus", "2", "-o", str(out))
    assert code == 0, stdout + stderr
    assert (out / "config.json").read_bytes() == src.read_bytes()
    src.write_text("{}")  # the job no longer needs the original
    namespace = runpy.run_path(str(out / "train.py"), run_name="not_main")
    with torch.device("meta"):
        model = namespace["build_model"]()
    assert sum(p.numel() for p in model.parameters()) > 0
    (out / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    with torch.device("meta"), pytest.raises(UserError, match="differs"):
        runpy.run_path(str(out / "train.py"), run_name="not_main")["build_model"]()


def _tiny_llama_config(tmp_path: Path) -> Path:
    """A transformers Llama config.json of the tiny size."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    src = tmp_path / "llama" / "config.json"
    src.parent.mkdir()
    src.write_text(json.dumps(config))
    return src


def test_transformers_config_job_builds_the_transformers_class(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = _tiny_llama_config(tmp_path)
    out = tmp_path / "job"
    code, stdout, stderr = generate(f"hf:{src}", *TINY, "--gpus", "2", "-o", str(out))
    assert code == 0, stdout + stderr
    train = (out / "train.py").read_text()
    assert "from autoplan.models.hf import build_transformers_model" in train
    namespace = runpy.run_path(str(out / "train.py"), run_name="not_main")
    with torch.device("meta"):
        model = namespace["build_model"]()
    assert type(model) is transformers.LlamaForCausalLM


def test_plan_file_of_a_transformers_config_is_read_back(tmp_path, run_cli):
    # plan -o plan.json, then generate/estimate --plan plan.json: the plan's model source
    # "transformers" was not in the plan file schema, so every reader refused the file
    pytest.importorskip("transformers")
    src = _tiny_llama_config(tmp_path)
    plan = tmp_path / "plan.json"
    code, stdout, stderr = run_cli("plan", f"hf:{src}", *TINY, "--gpus", "2", "-o", str(plan))
    assert code == 0, stdout + stderr
    assert json.loads(plan.read_text())["model"]["source"] == "transformers"
    from autoplan.codegen.launchers import generate_command

    assert f"generate hf:{src} " in generate_command(Plan.load(plan))  # as the report prints it
    code, stdout, stderr = run_cli("estimate", "--plan", str(plan))  # the plan's own model: hf:
    assert code == 0, stdout + stderr
    out = tmp_path / "job"
    code, stdout, stderr = generate(f"hf:{src}", "--plan", str(plan), "-o", str(out))
    assert code == 0, stdout + stderr
    assert "build_transformers_model" in (out / "train.py").read_text()


def test_reference_config_job_does_not_import_transformers(tiny_job):
    assert "transformers" not in (tiny_job / "train.py").read_text()
