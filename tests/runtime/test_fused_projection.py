"""The row order, head counts and state-dict layout of fused projections under TP
(autoplan/runtime/fused_projection.py), in one process."""

from __future__ import annotations

import torch

from autoplan.runtime.fused_projection import (fused_split_problem, in_model_layout, into_runtime_layout,
                                               localise_head_counts, rank_major_order)


def test_rank_major_order_gives_each_rank_its_q_k_and_v_heads_gqa():
    # 4 q heads, 2 k and 2 v heads of 2 rows each: rows q0..q3 | k0 k1 | v0 v1
    heads = ["q0", "q1", "q2", "q3", "k0", "k1", "v0", "v1"]
    rows = [h for h in heads for _ in range(2)]
    order = rank_major_order(len(rows), (4, 2, 2), tp=2)
    held = [rows[i] for i in order.tolist()]
    assert held[:8] == ["q0", "q0", "q1", "q1", "k0", "k0", "v0", "v0"]  # rank 0
    assert held[8:] == ["q2", "q2", "q3", "q3", "k1", "k1", "v1", "v1"]  # rank 1


def test_rank_major_order_of_gate_and_up_halves():
    order = rank_major_order(8, (4, 4), tp=2).tolist()
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]  # [gate_0 | up_0 | gate_1 | up_1]


def test_kv_heads_tp_does_not_divide_are_refused_with_that_reason():
    assert fused_split_problem("colwise_qkv:4,2", 128, 2) is None
    assert "2 key/value heads" in fused_split_problem("colwise_qkv:8,2", 192, 4)
    assert fused_split_problem("colwise_gate_up", 256, 2) is None
    assert fused_split_problem("colwise_gate_up", 255, 2) is not None


def test_state_leaves_in_the_models_order_and_comes_back_in_the_runtimes():
    order = rank_major_order(8, (4, 2, 2), tp=2)
    model = torch.arange(8.0).unsqueeze(1).repeat(1, 3)
    runtime = {"w": model[order].clone(), "state.w.exp_avg": model[order].clone() * 2,
               "state.w.step": torch.tensor(3.0), "other": torch.ones(2)}
    saved = in_model_layout(runtime, {"w": (order, 0)})
    assert torch.equal(saved["w"], model) and torch.equal(saved["state.w.exp_avg"], model * 2)
    assert saved["other"] is runtime["other"] and saved["state.w.step"] is runtime["state.w.step"]
    loaded = {key: value + 1 if value.dim() else value for key, value in saved.items()}
    into_runtime_layout(loaded, runtime, {"w": (order, 0)})  # in place
    assert torch.equal(runtime["w"], (model + 1)[order])
    assert torch.equal(runtime["state.w.exp_avg"], (model * 2 + 1)[order])


def test_phi3_attention_reads_the_ranks_head_counts_from_its_own_config_copy():
    import transformers

    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=1, intermediate_size=128, vocab_size=256)
    attention = transformers.models.phi3.modeling_phi3.Phi3Attention(config, layer_idx=0)
    localise_head_counts(attention, heads=4, kv_heads=2, tp=2)
    assert (attention.config.num_attention_heads, attention.config.num_key_value_heads) == (2, 1)
    assert attention.num_key_value_heads == 1
    assert (attention.head_dim, attention.num_key_value_groups) == (16, 2)  # per head: unchanged
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)  # the model's own
    assert attention.config._attn_implementation == config._attn_implementation


def test_an_attention_that_views_its_output_by_all_heads_width_gets_the_ranks_width():
    # RemBERT views its context as (batch, seq, all_head_size): the rank holds half the heads
    import transformers

    config = transformers.RemBertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                        intermediate_size=128, vocab_size=256)
    attention = transformers.models.rembert.modeling_rembert.RemBertSelfAttention(config)
    localise_head_counts(attention, heads=4, kv_heads=4, tp=2, q_width=64)
    assert (attention.num_attention_heads, attention.all_head_size) == (2, 32)
    assert attention.attention_head_size == 16  # per head: unchanged


def test_a_plan_names_the_qkv_style_with_its_head_counts():
    from autoplan.config import tp_style_known

    assert tp_style_known("colwise_qkv:4,2") and tp_style_known("colwise_gate_up")
    assert not tp_style_known("colwise_qkv") and not tp_style_known("colwise_qkv:4")
    assert not tp_style_known("colwise_gate_up:2") and not tp_style_known("colwise:1")
