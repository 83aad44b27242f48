"""Models whose inputs are not token ids, and forwards autoplan cannot call, through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import corpus

pytest.importorskip("transformers")


@pytest.fixture
def vit_file(tmp_path):
    return str(corpus.model_file("vit_b16", "tiny", tmp_path))


def test_analyze_image_model_at_its_image_size(run_cli, vit_file):
    code, out, _ = run_cli("analyze", vit_file, "--batch-size", "2", "--json")
    assert code == 0
    data = json.loads(out)
    # the tiny ViT's own side (32), not a token count read off the channel dim (3)
    assert (data["image_size"], data["seq_len"], data["batch_size"]) == (32, 1, 2)
    assert [b["count"] for b in data["blocks"]] == [2]


def test_image_size_that_the_model_cannot_take_is_one_paragraph(run_cli, vit_file, caplog):
    code, _, err = run_cli("analyze", vit_file, "--image-size", "48")
    assert code == 2
    assert "fails when run on fake meta tensors" in err and "Traceback" not in err
    # torch logs a failed meta kernel with its traceback (to the terminal, beside the paragraph)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_image_size_on_a_token_model_is_refused(run_cli):
    code, _, err = run_cli("analyze", "tiny-gpt", "--image-size", "64")
    assert code == 2 and "--seq-len" in err


def test_plan_image_model_whatever_the_seq_len(run_cli, vit_file):
    code, out, _ = run_cli("plan", vit_file, "--gpu", "h100", "--gpus", "8", "--global-batch", "64",
                           "--seq-len", "4096", "--json")
    assert code == 0, out


def test_fixing_cp_on_an_image_model_says_its_sequence_is_made_inside_forward(run_cli, vit_file):
    # ViT calls SDPA, so "needs F.scaled_dot_product_attention" would be the wrong reason:
    # its sequence (a class token and the 16 patches of a 32-pixel image) is made in forward
    code, _, err = run_cli("plan", vit_file, "--gpu", "h100", "--gpus", "8", "--global-batch", "64",
                           "--fix", "cp=2")
    assert code == 2 and "Traceback" not in err
    err = " ".join(err.split())
    assert "makes its 17-token sequence inside forward" in err
    assert "nor do its 17 tokens split evenly over cp=2 ranks" in err


def test_generate_writes_a_job_for_an_image_classifier(run_cli, vit_file, tmp_path):
    code, out, err = run_cli("generate", vit_file, "--gpu", "cpu", "--gpus", "2", "--global-batch", "8",
                             "--image-size", "32", "-o", str(tmp_path / "job"))
    assert code == 0, err
    assert "takes images" not in out + err
    plan = json.loads((tmp_path / "job" / "plan.json").read_text())
    assert plan["inputs"] == {"kind": "images", "image_size": 32, "channels": 3, "num_classes": 10}
    assert "synthetic {side}x{side} images" in (tmp_path / "job" / "train.py").read_text()


def test_generate_from_a_plan_file_of_an_image_model(run_cli, tmp_path):
    # re-estimating the plan traces the model at the plan's image side (ResNet's BatchNorm
    # failed at the 1 pixel of seq_len before plans recorded it)
    model = str(corpus.model_file("resnet50", "tiny", tmp_path))
    plan = tmp_path / "plan.json"
    code, out, _ = run_cli("plan", model, "--gpu", "cpu", "--gpus", "2", "--global-batch", "8",
                           "--image-size", "32", "-o", str(plan))
    assert code == 0, out
    code, _, err = run_cli("generate", model, "--plan", str(plan), "-o", str(tmp_path / "job"))
    assert code == 0, err
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["inputs"]["image_size"] == 32


def test_check_refuses_an_image_plan_in_one_paragraph(run_cli, vit_file, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, _ = run_cli("plan", vit_file, "--gpu", "cpu", "--gpus", "2", "--global-batch", "8",
                           "--image-size", "32", "-o", str(plan))
    assert code == 0, out
    code, _, err = run_cli("check", str(plan))
    assert code == 2 and "Traceback" not in err and "\n\n" not in err.strip()
    assert "dry-runs a step on token ids only" in " ".join(err.split())
    code, _, err = run_cli("estimate", "--plan", str(plan))  # what it points to instead
    assert code == 0, err


def test_generate_from_an_image_plan_without_inputs_says_plan_again(run_cli, tmp_path):
    model = str(corpus.model_file("resnet50", "tiny", tmp_path))
    plan = tmp_path / "plan.json"
    code, out, _ = run_cli("plan", model, "--gpu", "cpu", "--gpus", "2", "--global-batch", "8",
                           "--image-size", "32", "-o", str(plan))
    assert code == 0, out
    data = json.loads(plan.read_text())
    del data["inputs"]  # as an older autoplan wrote it
    plan.write_text(json.dumps(data))
    code, _, err = run_cli("generate", model, "--plan", str(plan), "-o", str(tmp_path / "job"))
    assert code == 2 and "Traceback" not in err
    assert "keeps no image size" in " ".join(err.split())
    assert not (tmp_path / "job").exists()


def test_generate_refuses_an_image_model_without_class_scores(run_cli, tmp_path):
    path = tmp_path / "segmenter.py"
    path.write_text(
        "import torch.nn as nn\n"
        "class Segmenter(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1))\n"
        "        self.out = nn.Conv2d(8, 4, 1)\n"
        "    def forward(self, images):\n"
        "        return self.out(self.blocks(images))\n")
    code, out, err = run_cli("generate", str(path), "--gpu", "cpu", "--gpus", "1", "--global-batch", "4",
                             "--image-size", "16", "-o", str(tmp_path / "job"))
    assert code == 2 and "Traceback" not in err + out
    assert "not class scores of shape (batch, classes)" in " ".join(err.split())
    assert not (tmp_path / "job").exists()


def test_forward_needing_two_inputs_without_example_inputs(run_cli, tmp_path):
    path = tmp_path / "two.py"
    path.write_text(
        "import torch.nn as nn\n"
        "class Two(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(100, 16)\n"
        "    def forward(self, ids, other_ids):\n"
        "        return self.emb(ids) + self.emb(other_ids)\n")
    code, out, err = run_cli("analyze", str(path))
    assert code == 2
    assert "Traceback" not in err + out
    assert "other_ids" in err and "example_inputs" in err
    assert "\n\n" not in err.strip()  # one paragraph (wrapped to the terminal, which a long path lengthens)


def test_a_model_files_own_loss_trains_the_job(run_cli, tmp_path):
    """The generated train.py hands the file's `loss(outputs, labels)` to the runtime."""
    path = tmp_path / "vit.py"
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(corpus.REPO / 'tests' / 'runtime')!r})\n"
        "import torch.nn.functional as F\n"
        "from image_models import TinyViT\n\n"
        "def build_model():\n"
        "    return TinyViT()\n\n"
        "def loss(outputs, labels):\n"
        "    return F.cross_entropy(outputs, labels) + 100.0  # visibly not the default\n")
    job = tmp_path / "job"
    code, _, err = run_cli("generate", str(path), "--gpu", "cpu", "--gpus", "1", "--global-batch", "4",
                           "--image-size", "32", "-o", str(job))
    assert code == 0, err
    assert "loss=model_loss()" in (job / "train.py").read_text()
    proc = subprocess.run([sys.executable, str(job / "train.py"), "--steps", "1", "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 100 < metrics["loss"] < 110


def _batch_file(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text("import sys\n"
                    f"sys.path.insert(0, {str(corpus.REPO / 'tests' / 'runtime')!r})\n"
                    "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n" + body)
    return str(path)


def test_a_model_files_own_batch_trains_the_job(run_cli, tmp_path):
    """`example_batch` and `loss` in the file: the plan feeds them, the job trains on them."""
    path = _batch_file(tmp_path, "tab.py", "from batch_models import TabularRegressor, example_batch, loss\n\n"
                       "def build_model():\n    return TabularRegressor()\n")
    job = tmp_path / "job"
    code, _, err = run_cli("generate", path, "--gpu", "cpu", "--gpus", "1", "--global-batch", "4",
                           "--precision", "fp32", "-o", str(job))
    assert code == 0, err
    assert json.loads((job / "plan.json").read_text())["inputs"] == {"kind": "batch"}
    assert "batch=model_batch()" in (job / "train.py").read_text()
    proc = subprocess.run([sys.executable, str(job / "train.py"), "--steps", "1", "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch

    from batch_models import TabularRegressor, global_batch, loss

    torch.manual_seed(0)  # train.py's default seed: its weights and its samples
    x, y = global_batch(0, 0, 4)
    with torch.no_grad():
        want = float(loss(TabularRegressor()(x), y))
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["loss"] == pytest.approx(want, rel=1e-5)
    code, _, err = run_cli("check", str(job / "plan.json"))  # its dry run feeds token ids
    assert code == 2 and "example_batch" in err and "Traceback" not in err


TWO_INPUTS = ("from batch_models import Masked, masked_batch as example_batch\n\n"
              "def build_model():\n    return Masked()\n")


@pytest.mark.parametrize("fix,reason", [
    ("cp=2", "fed the model file's example_batch, whose sequence dimension (if any) only the file knows"),
    ("pp=2", "the pipeline hands its first stage one input, and the model file's example_batch gives 2"),
])
def test_axes_a_file_batch_cannot_take_are_refused_with_the_reason(run_cli, tmp_path, fix, reason):
    path = _batch_file(tmp_path, "masked.py", TWO_INPUTS)
    code, out, err = run_cli("plan", path, "--gpu", "h100", "--gpus", "2", "--global-batch", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["inputs"] == {"kind": "batch"}
    code, _, err = run_cli("plan", path, "--gpu", "h100", "--gpus", "2", "--global-batch", "8", "--fix", fix)
    assert code == 2 and "Traceback" not in err
    assert reason in " ".join(err.split())


def test_a_file_batch_by_keyword_plans_without_a_pipeline(run_cli, tmp_path):
    path = _batch_file(tmp_path, "keyword.py", "from batch_models import Masked, masked_keyword_batch as example_batch\n\n"
                       "def build_model():\n    return Masked()\n")
    code, out, err = run_cli("plan", path, "--gpu", "h100", "--gpus", "2", "--global-batch", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["inputs"] == {"kind": "batch"}
    code, _, err = run_cli("plan", path, "--gpu", "h100", "--gpus", "2", "--global-batch", "8", "--fix", "pp=2")
    assert code == 2 and "example_batch gives its inputs by keyword" in " ".join(err.split())


def test_float_labels_without_a_loss_are_refused_at_plan_time(run_cli, tmp_path):
    path = _batch_file(tmp_path, "regress.py", "from batch_models import Masked, masked_batch\n\n"
                       "def build_model():\n    return Masked()\n\n"
                       "def example_batch(batch_size):\n"
                       "    inputs, labels = masked_batch(batch_size)\n"
                       "    return inputs, labels.float()\n")
    code, _, err = run_cli("plan", path, "--gpu", "h100", "--gpus", "2", "--global-batch", "8")
    assert code == 2 and "Traceback" not in err
    text = " ".join(err.split())  # the paragraph wraps wherever the file's path ends
    assert "returns float32 labels" in text and "loss(outputs, labels)" in text
