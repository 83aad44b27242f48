"""Bad input, run as a user runs it (`python -m autoplan ...` in a subprocess): the exit status
(2 bad input, 1 does not fit), one paragraph on stderr, no traceback, an answer in seconds.

SECONDS_LIMIT is generous for this shared 2-core machine (a command here takes 3-25 s, most
of it importing torch); the failures it guards against ran for minutes with memory growing.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import time
from pathlib import Path

import pytest

from multirank import run_killable

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_PLAN = REPO / "generated" / "llama3.1-8b-8xh100-sxm-80gb" / "plan.json"
SECONDS_LIMIT = 90.0

TWO_INPUTS = '''
import torch.nn as nn


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100)

    def forward(self, x, y):
        return self.head(self.emb(x) + self.emb(y))
'''


def autoplan(*args, cwd: Path):
    start = time.monotonic()
    result = run_killable([sys.executable, "-m", "autoplan", *map(str, args)], timeout=SECONDS_LIMIT,
                          cwd=cwd)
    return result, time.monotonic() - start


def expect(code: int, *args, cwd: Path, match: str) -> str:
    """Run, check the exit status, one paragraph naming `match`, no traceback; stderr."""
    result, seconds = autoplan(*args, cwd=cwd)
    err = result.stderr
    assert result.returncode == code, result.stdout[-2000:] + err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip() and "\n\n" not in err.strip(), err  # one paragraph
    assert match in " ".join(err.split()), err
    assert seconds < SECONDS_LIMIT
    return err


@pytest.mark.parametrize("command", [
    ["analyze"], ["plan", "--gpu", "h100", "--gpus", "8", "--global-batch", "8"],
    ["estimate", "--gpu", "h100", "--gpus", "8", "--global-batch", "8"],
    ["generate", "--gpu", "h100", "--gpus", "8", "--global-batch", "8", "-o", "job"]])
def test_forward_with_two_inputs_needs_example_inputs(tmp_path, command):
    (tmp_path / "two.py").write_text(TWO_INPUTS)
    expect(2, command[0], "two.py", *command[1:], cwd=tmp_path,
           match="takes 2 inputs (x, y) in forward")
    assert not (tmp_path / "job").exists()


def test_absurd_layer_count_is_refused_at_once(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1_000_000_000_000,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    expect(2, "analyze", "config.json", cwd=tmp_path,
           match="num_hidden_layers is 1,000,000,000,000, above autoplan's limit of 1,024")


def test_absurd_gpu_count_is_refused_at_once(tmp_path):
    expect(2, "plan", "tiny-gpt", "--gpu", "h100", "--gpus", "1000000000", "--global-batch", "8",
           cwd=tmp_path, match="--gpus is 1,000,000,000, above autoplan's limit of 1,048,576")


def _runs(tmp_path, rows) -> Path:
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": rows}))
    return path


def test_validate_names_each_malformed_row_and_validates_the_good_ones(tmp_path):
    published = json.loads((REPO / "cost_models" / "validation" / "published_runs.json").read_text())
    good = published["runs"][0]
    negative = copy.deepcopy(good) | {"id": "negative"}
    negative["parallel"]["tp"] = -2
    text = copy.deepcopy(good) | {"id": "text"}
    text["truth"]["tokens_per_s_per_gpu"] = "fast"
    no_hardware = {k: v for k, v in good.items() if k != "hardware"} | {"id": "no-hardware"}
    path = _runs(tmp_path, [good, "a string", None, 7, negative, text, no_hardware])
    result, seconds = autoplan("validate", path, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and seconds < SECONDS_LIMIT
    for expected in ('row 2 is malformed: the row is "a string"', "row 3 is malformed: the row is null",
                     "row 4 is malformed: the row is 7", "row 5 (negative) is malformed: parallel.tp is -2",
                     'row 6 (text) is malformed: truth.tokens_per_s_per_gpu is "fast"',
                     "row 7 (no-hardware) is malformed: hardware is missing"):
        assert expected in result.stderr, result.stderr
    report = json.loads(result.stdout)
    assert [r.get("skipped", "") == "" for r in report["runs"]] == [True] + [False] * 6
    assert report["runs"][0]["predicted"]["tokens_per_s_per_gpu"] > 0
    assert report["summary"]["compared"] == 1


@pytest.mark.parametrize("rows,match", [
    ([], 'has an empty "runs" list'),
    (["x", None], "no run in runs.json can be validated: row 1 is malformed"),
])
def test_validate_without_a_usable_row_is_bad_input(tmp_path, rows, match):
    _runs(tmp_path, rows)
    expect(2, "validate", "runs.json", cwd=tmp_path, match=match)


def _edited_plan(tmp_path, edit) -> str:
    plan = json.loads(EXAMPLE_PLAN.read_text())
    edit(plan)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return "plan.json"


def _needs_505_gib(plan):
    """ZeRO-2 -> none, recomputation off, the whole per-rank batch in one micro-batch."""
    plan.update(zero_stage=0, micro_batch=plan["global_batch"] // plan["dp"],
                recompute={block: "none" for block in plan["recompute"]})


def test_plan_with_zero_stage_7_is_refused_by_generate(tmp_path):
    plan = _edited_plan(tmp_path, lambda p: p.update(zero_stage=7))
    expect(2, "generate", "llama3.1-8b", "--plan", plan, "-o", "job", cwd=tmp_path,
           match="zero_stage must be 0, 1, 2 or 3, got 7")
    assert not (tmp_path / "job").exists()


def test_plan_with_recompute_as_a_string_is_refused_by_estimate(tmp_path):
    plan = _edited_plan(tmp_path, lambda p: p.update(recompute="full"))
    expect(2, "estimate", "--plan", plan, cwd=tmp_path, match="recompute must map block paths")


def test_plan_edited_to_need_505_gib_is_re_estimated_not_copied(tmp_path):
    plan = _edited_plan(tmp_path, _needs_505_gib)
    stored = json.loads((tmp_path / plan).read_text())["estimate"]["memory_gib_per_gpu"]
    assert stored < 80  # the edited file still claims the example's estimate
    err = expect(1, "generate", "llama3.1-8b", "--plan", plan, "-o", "job", cwd=tmp_path,
                 match="GiB per GPU but h100-sxm-80gb has 68.6 GiB for the estimate")
    needed = float(re.search(r"needs ([0-9.]+) GiB per GPU", " ".join(err.split())).group(1))
    assert needed > 5 * stored  # recomputed from the edited configuration, not read from the file
    assert not (tmp_path / "job").exists()
    expect(1, "estimate", "--plan", plan, cwd=tmp_path, match=f"needs {needed:.1f} GiB per GPU")


def test_plan_whose_fingerprint_does_not_match_is_refused_by_estimate(tmp_path):
    plan = _edited_plan(tmp_path, lambda p: p["model"].update(fingerprint="0" * 64))
    expect(2, "estimate", "--plan", plan, cwd=tmp_path, match="fingerprint differs")


def test_estimate_that_does_not_fit_exits_1(tmp_path):
    err = expect(1, "estimate", "llama3.1-70b", "--gpu", "h100", "--gpus", "8", "--global-batch", "8",
                 cwd=tmp_path, match="does not fit")
    assert "GiB per GPU" in err


@pytest.mark.parametrize("command, name", [
    (["plan", "tiny-gpt", "--gpu", "cpu", "--gpus", "1", "--global-batch", "2"], "plan.json"),
    (["report", "tiny-gpt", "--tokens", "1M", "--global-batch", "8", "--gpu", "h100", "--gpus", "8",
      "--format", "md"], "report.md"),
    (["report", "tiny-gpt", "--tokens", "1M", "--global-batch", "8", "--gpu", "h100", "--gpus", "8"], "report.txt"),
])
def test_output_files_make_their_folder_and_refuse_a_link(tmp_path, run_cli, command, name):
    # an -o path in folders that do not exist yet is written, not a traceback
    code, _, err = run_cli(*command, "-o", str(tmp_path / "new" / "sub" / name))
    assert code == 0, err
    assert (tmp_path / "new" / "sub" / name).stat().st_size > 0
    # a link where the file goes is refused; its target is left alone
    target = tmp_path / "elsewhere.txt"
    target.write_text("the user's file\n")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / name).symlink_to(target)
    code, _, err = run_cli(*command, "-o", str(tmp_path / "linked" / name), "--force")
    assert code == 2 and "symbolic link" in err and "Traceback" not in err
    assert target.read_text() == "the user's file\n"


@pytest.mark.parametrize("command", [
    ["plan", "tiny-gpt", "--global-batch", "16", "-o", "plan.json"],
    ["estimate", "tiny-gpt", "--global-batch", "16"],
    ["generate", "tiny-gpt", "--global-batch", "16", "-o", "job"],
    ["report", "tiny-gpt", "--global-batch", "16", "--tokens", "1T"],
])
@pytest.mark.parametrize("cluster,words", [
    (["--gpu", "h999", "--gpus", "8"], "Unknown GPU 'h999'"),
    # plan, estimate and generate take one count; report a list of them
    (["--gpu", "h100", "--gpus", "0"], r"--gpus (must be a positive number|expects positive GPU counts)"),
])
def test_a_mistyped_cluster_is_answered_before_torch_is_imported(tmp_path, command, cluster, words):
    """The cluster is checked before the planner's imports (torch: about 3 s of a 3-25 s
    command), so a typo in --gpu or --gpus is answered at once."""
    code = ("import sys; from autoplan.cli import main\n"
            "try:\n    main()\nfinally:\n    print('torch imported:', 'torch' in sys.modules)")
    result = run_killable([sys.executable, "-c", code, *command, *cluster],
                          timeout=SECONDS_LIMIT, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(words, result.stderr) and "Traceback" not in result.stderr
    assert "torch imported: False" in result.stdout, result.stdout
