"""A model with fused [all q | all k | all v] and [gate | up] projections (Phi-3) is planned
at tp=2 and dry-runs on the runtime with the collectives the cost model counts.

Before the runtime split such projections per rank the planner refused tp for Phi-3
(`--fix tp=2` found no plan). The cost model counts the tensor-parallel collectives per
column/row pair, whatever the column holds, so the dry run's bytes per kind and dtype must
be the cost model's exactly.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from autoplan.cli import cli
from autoplan.commands.check import check_plan

# a tiny Phi-3 with GQA (2 K/V heads for 4 q heads), so q, k and v differ in size
PHI3 = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "pad_token_id": 0,
        "bos_token_id": 0, "eos_token_id": 0}


def test_phi3_at_tp2_is_planned_and_its_collectives_are_the_cost_models(tmp_path):
    config, plan = tmp_path / "config.json", tmp_path / "plan.json"
    config.write_text(json.dumps(PHI3))
    out = CliRunner().invoke(cli, ["plan", f"hf:{config}", "--gpus", "2", "--gpu", "cpu",
                                   "--gpus-per-node", "2", "--global-batch", "8", "--seq-len", "32",
                                   "--fix", "tp=2", "--top", "0", "-o", str(plan)])
    assert out.exit_code == 0, out.output
    styles = json.loads(plan.read_text())["tp_styles"]["model.layers.*"]
    assert styles["self_attn.qkv_proj"] == "colwise_qkv:4,2"
    assert styles["mlp.gate_up_proj"] == "colwise_gate_up"
    report = check_plan(str(plan), workers=1)
    assert report["parameters_match"]
    rows = report["ranks"][0]["collectives"]
    assert {row["kind"] for row in rows} >= {"all_gather", "reduce_scatter"}  # sequence parallel
    for row in rows:
        assert row["bytes"] == row["model_bytes"], row


def test_phi3_tp_that_splits_a_kv_head_is_refused_with_that_reason(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PHI3))
    out = CliRunner().invoke(cli, ["plan", f"hf:{config}", "--gpus", "4", "--gpu", "cpu",
                                   "--gpus-per-node", "4", "--global-batch", "8", "--seq-len", "32",
                                   "--fix", "tp=4"])
    assert out.exit_code != 0  # the command line's main() turns this UserError into exit 2
    assert "tp=4 does not divide the 2 kv heads" in f"{out.output} {out.exception}"
