"""Which K/V head a rank computes, its head counts and the refusals of
autoplan/runtime/kv_replication.py, in one process (the training itself: test_parity.py's
hf_gemma_mqa_* and hf_llama_tp4_* cases, test_checkpoint.py)."""

from __future__ import annotations

from autoplan.runtime.fused_projection import localise_head_counts
from autoplan.runtime.kv_replication import kv_split_problem, local_kv_heads


def test_tp_dividing_or_a_multiple_of_the_kv_heads_is_accepted_others_refused():
    assert kv_split_problem(4, 2, 2) is None and kv_split_problem(4, 2, 4) is None
    assert kv_split_problem(8, 1, 8) is None and kv_split_problem(64, 8, 16) is None
    assert kv_split_problem(4, 1, 8) == "tp=8 does not divide its 4 query heads"
    assert kv_split_problem(12, 4, 6).startswith(
        "tp=6 neither divides nor is a multiple of its 4 key/value heads")


def test_a_rank_computes_its_share_or_one_head():
    assert [local_kv_heads(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert local_kv_heads(1, 2) == 1


def test_gemma_attention_reads_the_ranks_counts_with_a_replicated_kv_head():
    import transformers

    config = transformers.GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=16, num_hidden_layers=1, intermediate_size=128,
                                      vocab_size=256)
    attention = transformers.models.gemma.modeling_gemma.GemmaAttention(config, layer_idx=0)
    localise_head_counts(attention, heads=4, kv_heads=1, tp=2, local_kv=1)
    # 2 q heads share this rank's one K/V head: repeat_kv must expand it 2 times, not 4
    assert attention.num_key_value_groups == 2 and attention.head_dim == 16
    assert (attention.config.num_attention_heads, attention.config.num_key_value_heads) == (2, 1)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)  # the model's own


def test_a_plan_names_the_kv_style_with_its_head_counts():
    from autoplan.config import tp_style_known

    assert tp_style_known("colwise_kv:4,1")
    assert not tp_style_known("colwise_kv") and not tp_style_known("colwise_kv:4")
