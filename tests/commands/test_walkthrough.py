"""The tiny walkthrough a new user follows: sequence length defaults and limits, the example
model file vs the catalog, a pipeline-free plan's schedule, and report's planning options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.config import schedule_label
from autoplan.models.catalog import catalog_names
from autoplan.models.sources import load_model

REPO = Path(__file__).resolve().parents[2]
NANO = str(REPO / "examples" / "nano_gpt.py")
CPU = ("--gpu", "cpu", "--gpus-per-node", "4", "--global-batch", "8")


def test_a_model_files_position_table_is_the_default_and_the_limit(run_cli):
    code, out, err = run_cli("analyze", NANO, "--json")
    assert code == 0, err
    assert json.loads(out)["seq_len"] == 256  # examples/nano_gpt.py: MAX_SEQ = 256 rows of `pos`
    code, _, err = run_cli("analyze", NANO, "--seq-len", "257")
    assert code == 2 and "257 exceeds the model's 256 positions" in err and "Traceback" not in err
    code, _, err = run_cli("plan", NANO, "--gpus", "4", *CPU, "--seq-len", "2048")
    assert code == 2 and "--seq-len 256 or less" in " ".join(err.split())


def test_position_limits_of_other_models(write_model):
    wpe = write_model("wpe.py", "import torch.nn as nn\n"
                      "class GPT(nn.Module):\n"
                      "    def __init__(self):\n"
                      "        super().__init__()\n"
                      "        self.wte, self.wpe = nn.Embedding(32, 8), nn.Embedding(64, 8)\n"
                      "        self.head = nn.Linear(8, 32)\n")
    assert load_model(wpe).default_seq_len == 64
    no_table = write_model("mlp.py", "import torch.nn as nn\nmodel = nn.Sequential(nn.Embedding(32, 8), "
                           "nn.Linear(8, 32))\n")
    assert load_model(no_table).default_seq_len is None  # nothing to go by: the commands' 2048
    config = write_model("config.json", json.dumps({"model_type": "gpt2", "n_embd": 16, "n_layer": 1,
                                                    "n_head": 2, "vocab_size": 64, "n_positions": 512}))
    assert load_model(config).default_seq_len == 512  # 2048 would exceed its positions
    assert load_model("llama3.1-8b").default_seq_len == 8192  # the catalog's own training length


@pytest.fixture
def write_model(tmp_path):
    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def test_an_example_file_named_like_a_catalog_model_is_that_model():
    examples = {p.stem.replace("_", "-"): p for p in (REPO / "examples").glob("*.py")}
    for name in set(examples) & set(catalog_names()):
        from_file = load_model(str(examples[name])).module
        from_catalog = load_model(name).module
        shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
        assert shapes(from_file) == shapes(from_catalog), f"examples/{examples[name].name} is not catalog {name}"
    # the walkthrough's model file is a GPT-2-style model, and says it is not the catalog's tiny-gpt
    assert "tiny-gpt" not in examples and "not the catalog's\n`tiny-gpt`" in (REPO / "examples/nano_gpt.py").read_text()


def test_a_plan_without_a_pipeline_shows_no_schedule(run_cli):
    assert schedule_label(1, "1f1b") == "none"
    assert schedule_label(4, "interleaved-1f1b", 2) == "interleaved-1f1b v2"
    code, out, err = run_cli("plan", "tiny-gpt", "--gpus", "4", *CPU, "--seq-len", "32", "--fix", "pp=1",
                             "--top", "2")
    assert code == 0, err
    assert "none (pp=1)" in out and "1f1b" not in out  # neither the plan nor its pp=1 runners-up
    assert "pipeline stage" not in out and "worst stage" not in out  # no stage without a pipeline
    assert "offload" in out.split("Runners-up")[1].split("Why")[0]  # the runners-up's offload column


def test_report_plans_with_the_same_options_as_plan(run_cli, tmp_path):
    sweep = ("report", "tiny-gpt", "--tokens", "1M", "--seq-len", "32", "--global-batch", "8", "--gpus", "4,8",
             "--price", "cpu=1", "--format", "json")
    code, out, err = run_cli(*sweep, "--gpu", "cpu", "--gpus-per-node", "4", "--fix", "tp=2", "--top", "1")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert all(r["fits"] and r["config"]["tp"] == 2 for r in rows)
    assert all(len(r["runners_up"]) == 1 and r["runners_up"][0]["config"]["tp"] == 2 for r in rows)
    # one CPU rank per node: tp=2 would straddle nodes, so no cluster fits: the report, then exit 1
    code, out, err = run_cli(*sweep, "--gpu", "cpu", "--gpus-per-node", "1", "--fix", "tp=2")
    assert code == 1 and not any(r["fits"] for r in json.loads(out)["rows"]) and "no plan fits" in err
    hardware = tmp_path / "cpu-node.toml"
    hardware.write_text((REPO / "cost_models" / "gpus" / "cpu.toml").read_text())
    code, out, err = run_cli(*sweep, "--hardware", str(hardware), "--fix", "micro-batch=1")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["gpu"] for r in rows] == ["cpu", "cpu"] and all(r["config"]["micro_batch"] == 1 for r in rows)
    code, _, err = run_cli(*sweep, "--hardware", str(hardware), "--gpu", "cpu")
    assert code == 2 and "not both" in err


def test_report_of_a_plan_file_needs_no_tokens(run_cli, tmp_path):
    plan = tmp_path / "plan.json"
    code, _, err = run_cli("plan", "tiny-gpt", "--gpus", "4", *CPU, "--seq-len", "32", "-o", str(plan))
    assert code == 0, err
    code, out, err = run_cli("report", "--plan", str(plan), "--price", "cpu=1", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["tokens"] == 8 * 32 and doc["detail"]["steps"] == 1  # priced for one optimizer step
    code, _, err = run_cli("report", "--plan", str(plan), "--gpus-per-node", "4")
    assert code == 2 and "--gpus-per-node" in err


def test_the_walkthroughs_report_of_a_cpu_plan_needs_no_price(run_cli, tmp_path):
    # the cpu device has no rental price: the walkthrough's `report --plan tiny-job/plan.json`
    # prices it at 0 and says so, instead of exiting 2 until --price cpu=... is given
    plan = tmp_path / "plan.json"
    code, _, err = run_cli("plan", "tiny-gpt", "--gpus", "4", *CPU, "--seq-len", "32", "-o", str(plan))
    assert code == 0, err
    code, out, err = run_cli("report", "--plan", str(plan))
    assert code == 0, err
    assert "0 USD per hour" in " ".join(out.split())
    code, out, err = run_cli("report", "--plan", str(plan), "--format", "json")
    assert code == 0 and json.loads(out)["detail"]["usd_per_gpu_hour"] == 0
