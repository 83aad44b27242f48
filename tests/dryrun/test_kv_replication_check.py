"""A grouped-query model with fewer K/V heads than the tp it is planned at (one K/V head, as
Gemma-2B, at tp=2) is planned and dry-runs on the runtime with the collectives the cost model
counts, the K/V weights' gradient sum over the tp group included, and holds the parameters
it counts, the whole K/V weights on every rank (cost/kv_heads.py: without it the
all-reduced bytes are 4352 where the runtime moves 20736, and the parameters 0.96 of theirs).

Before the runtime replicated K/V heads (runtime/kv_replication.py) the planner refused it:
"tp=2 does not divide the 1 kv heads". A tp that neither divides nor is a multiple of the
K/V heads is still refused, with that reason.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from autoplan.cli import cli
from autoplan.commands.check import check_plan

# (the collectives are checked on the Llama: on a Gemma the runtime all-reduces the residual
# gradient of one sequence-parallel cut that the cost model counts as a reduce-scatter, with
# K/V heads replicated or not, which is not this feature's)
LLAMA_MQA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 256,
             "max_position_embeddings": 256, "tie_word_embeddings": False}
GEMMA_MQA = {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
             "max_position_embeddings": 256, "tie_word_embeddings": False}


def _plan(tmp_path, config: dict, gpus: int, *fix: str):
    path, plan = tmp_path / "config.json", tmp_path / "plan.json"
    path.write_text(json.dumps(config))
    args = ["plan", f"hf:{path}", "--gpus", str(gpus), "--gpu", "cpu", "--gpus-per-node", str(gpus),
            "--global-batch", "8", "--seq-len", "32", "--top", "0", "-o", str(plan)]
    for item in fix:
        args += ["--fix", item]
    return CliRunner().invoke(cli, args), plan


def test_one_kv_head_at_tp2_is_planned_and_its_collectives_are_the_cost_models(tmp_path):
    out, plan = _plan(tmp_path, LLAMA_MQA, 2, "tp=2")
    assert out.exit_code == 0, out.output
    styles = json.loads(plan.read_text())["tp_styles"]["model.layers.*"]
    assert styles["self_attn.k_proj"] == styles["self_attn.v_proj"] == "colwise_kv:4,1"
    report = check_plan(str(plan), workers=1)
    assert report["parameters_match"]
    # every rank holds the K/V weights whole (their 1/tp share would be 0.96 of this)
    memory = {row["category"]: row for row in report["ranks"][0]["memory"]}
    assert memory["parameters"]["dry_run_gib"] == memory["parameters"]["model_gib"]
    assert memory["gradients"]["dry_run_gib"] == memory["gradients"]["model_gib"]
    rows = report["ranks"][0]["collectives"]
    assert {row["kind"] for row in rows} >= {"all_gather", "reduce_scatter", "all_reduce"}
    for row in rows:
        assert row["bytes"] == row["model_bytes"], row


def test_tp_neither_dividing_nor_a_multiple_of_the_kv_heads_is_refused_with_that_reason(tmp_path):
    # 12 q heads, 4 K/V heads: tp=6 divides the q heads and the MLP but not the K/V heads,
    # and 6 is no multiple of 4
    config = dict(LLAMA_MQA, hidden_size=96, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=192)
    out, _ = _plan(tmp_path, config, 6, "tp=6")
    assert out.exit_code != 0
    assert "tp=6 neither divides nor is a multiple of the 4 kv heads" in f"{out.output} {out.exception}"



def test_tp_is_offered_up_to_the_q_heads_of_a_one_kv_head_model():
    import torch
    import transformers

    from autoplan.solve.space import tp_reason
    from autoplan.trace.tracer import trace_model

    fields = {k: v for k, v in GEMMA_MQA.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**fields))
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert graph.refused == {}  # the probe ran the replicated K/V head at tp=2
    assert tp_reason(graph, 2, 8) is None and tp_reason(graph, 4, 8) is None
    assert tp_reason(graph, 8, 8) == "tp=8 does not divide the 4 heads of model.layers"
    assert tp_reason(graph, 3, 3) == "tp=3 does not divide the 4 heads of model.layers"
