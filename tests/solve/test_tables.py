"""The search's family bounds (time, least memory) equal the bounds of the full tables, to the last bit."""

from __future__ import annotations

import pytest

from autoplan.hardware import load_gpu, make_cluster
from autoplan.solve.space import Request, outer_configs
from autoplan.solve.tables import (build_tables, least_memory_kib, lower_bound_ns, memory_lower_bound_kib,
                                   time_lower_bound_ns)
from autoplan.trace.tracer import graph_for_config

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=128)
# two dense blocks before four MoE ones (DeepSeek's first_k_dense_replace)
DEEPSEEK = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=32,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
                max_position_embeddings=128)


@pytest.mark.parametrize("model", [LLAMA, DEEPSEEK], ids=["llama", "deepseek"])
def test_least_memory_is_the_tables_bound(model):
    """The bound each ZeRO/offload variant of a family is ruled out by, from the memory terms
    alone, is the full tables' bound for every configuration of the space."""
    graph = graph_for_config(model, 1, 64)
    cluster = make_cluster(load_gpu("h100"), 16)
    request = Request(num_gpus=16, gpus_per_node=8, global_batch=32, seq_len=64, max_micro_batch=2)
    configs = list(outer_configs(graph, request))
    assert {c.zero_stage for c in configs} == {0, 1, 2, 3} and {c.offload for c in configs} >= {"none", "both"}
    assert any(c.pp > 1 for c in configs) and (model is LLAMA or any(c.ep > 1 for c in configs))
    for config in configs:
        assert least_memory_kib(graph, config) == memory_lower_bound_kib(build_tables(graph, config, cluster))


@pytest.mark.parametrize("gpu, gpus", [("h100", 8), ("a100-sxm4-80gb", 16), ("mi300x", 4)])
def test_time_lower_bound_is_the_tables_bound(gpu, gpus):
    graph = graph_for_config(LLAMA, 1, 64)
    spec = load_gpu(gpu)
    cluster = make_cluster(spec, gpus)
    request = Request(num_gpus=gpus, gpus_per_node=cluster.gpus_per_node, global_batch=2 * gpus, seq_len=64,
                      max_micro_batch=2)
    configs = list(outer_configs(graph, request))
    assert any(c.pp > 1 for c in configs) and any(c.zero_stage == 3 for c in configs)
    for config in configs:
        tables = build_tables(graph, config, cluster)
        assert time_lower_bound_ns(graph, config, cluster) == lower_bound_ns(tables, memory_aware=False)


def test_the_space_offers_only_offloads_the_runtime_applies():
    from autoplan.solve.space import RUNTIME_OFFLOADS, _offloads

    assert RUNTIME_OFFLOADS == ("none", "both")
    assert [_offloads(z, {}, True) for z in range(4)] == [["none"], ["none"], ["none", "both"], ["none", "both"]]
    assert _offloads(1, {"offload": "both"}, True) == []  # no ZeRO-1 configuration with it
