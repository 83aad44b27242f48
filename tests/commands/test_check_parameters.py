"""`autoplan check` counts the parameters the runtime holds after applying the plan against
the model's, and fails (exit status 1, one line naming the ranks) when they differ: a tied
parameter the runtime split into copies trains a different model."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from autoplan.cli import main
from autoplan.commands.check import check_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "generated" / "tiny-gpt-4xcpu" / "plan.json"
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from runtime_models import llama_tp_styles  # noqa: E402
from tied_models import TIED_LLAMA  # noqa: E402


def _tied_tp_plan(tmp_path: Path, **changes) -> str:
    """The tiny job's plan on a Llama with tied embeddings, over tp=2 x dp=2 (or `changes`)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TIED_LLAMA))
    from autoplan.models import build_model
    from autoplan.models.sources import fingerprint

    with torch.device("meta"):
        print_ = fingerprint(build_model(TIED_LLAMA), TIED_LLAMA)
    data = json.loads(TINY.read_text())
    blocks = [f"layers.{i}" for i in range(TIED_LLAMA["num_hidden_layers"])]
    data.update(model={"source": "config", "name": "tied-llama", "path": str(config),
                       "fingerprint": print_, "file_sha256": hashlib.sha256(config.read_bytes()).hexdigest()},
                dp=2, tp=2,
                sequence_parallel=True, tp_styles=llama_tp_styles(len(blocks)), format_version=1,
                stages=[blocks], recompute={})
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_tied_model_under_tp_holds_the_models_parameters(tmp_path):
    from autoplan.models import build_model

    report = check_plan(_tied_tp_plan(tmp_path), workers=1)
    with torch.device("meta"):
        expected = sum(p.numel() for p in build_model(TIED_LLAMA).parameters())
    assert report["ranks"][0]["parameters"] == {"runtime": expected, "model": expected}
    assert report["parameters_match"]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_tied_model_under_pp_holds_a_copy_per_stage_and_sums_their_gradients(tmp_path, zero_stage):
    # the embedding on stage 0, the head tied to it on stage 1: a copy on each pipeline rank
    # (the model's parameters of that stage), whose gradients the two ranks all-reduce once a
    # step in fp32 (at ZeRO-3 their FSDP shards): the cost model counts the same bytes
    from autoplan.models import build_model

    plan = _tied_tp_plan(tmp_path, tp=1, pp=2, dp=2, zero_stage=zero_stage, sequence_parallel=False,
                         tp_styles={}, stages=[["layers.0", "layers.1"], ["layers.2", "layers.3"]])
    report = check_plan(plan, workers=2)
    assert report["parameters_match"]
    embedding = TIED_LLAMA["vocab_size"] * TIED_LLAMA["hidden_size"]
    with torch.device("meta"):
        total = sum(p.numel() for p in build_model(TIED_LLAMA).parameters())
    assert sum(r["parameters"]["runtime"] for r in report["ranks"]) == total + embedding
    for rank in report["ranks"]:
        for row in rank["collectives"]:
            # (a pipelined ZeRO-3 stage's all-gathers are not the cost model's, tied or not:
            # another matter than the tie's all-reduce)
            if zero_stage == 0 or row["kind"] != "all_gather":
                assert row["bytes"] == row["model_bytes"], (rank["rank"], row)
    tied_bytes = 4 * embedding // (2 if zero_stage == 3 else 1)
    ranks = {rank["pipeline_rank"]: rank for rank in report["ranks"]}
    reduced = [sum(r["bytes"] for r in ranks[pp]["collectives"] if (r["kind"], r["dtype"]) == ("all_reduce", "float32"))
               for pp in (0, 1)]
    if zero_stage == 3:  # FSDP reduce-scatters: the tie's is the only fp32 all-reduce
        assert reduced == [tied_bytes, tied_bytes]
    else:  # beside the data-parallel all-reduce of every gradient of the stage
        assert all(r > tied_bytes for r in reduced)


def test_check_fails_when_the_runtime_holds_another_parameter_count(monkeypatch, capsys):
    report = {"ranks": [{"rank": 0, "parameters": {"runtime": 180_800, "model": 164_416}}],
              "parameters_match": False, "parameter_mismatch_ranks": [0], "fits": True}
    monkeypatch.setattr("autoplan.commands.check.check_plan", lambda target, workers, *_: report)
    with pytest.raises(SystemExit) as exit_:
        main(["check", "plan.json", "--json"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "rank 0: the runtime holds 180,800 parameters where the model has 164,416 (ratio 1.10)" in err
