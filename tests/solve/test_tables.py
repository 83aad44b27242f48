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
# Llama-4 Maverick's dense and MoE layers in turn, every fourth layer without rotary (a block
# class of its own): eight runs, placed by periods of four
LLAMA4 = dict(model_type="llama4_text", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=64, intermediate_size_mlp=128,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, vocab_size=256,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def _graph(model: dict):
    if model is not LLAMA4:
        return graph_for_config(model, 1, 64)
    transformers = pytest.importorskip("transformers")
    import torch

    from autoplan.trace.tracer import trace_model

    fields = {k: v for k, v in model.items() if k != "model_type"}
    with torch.device("meta"):
        llama4 = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**fields))
    return trace_model(llama4, (torch.zeros(1, 64, dtype=torch.long, device="meta"),), probe_runtime=False)


@pytest.mark.parametrize("model", [LLAMA, DEEPSEEK, LLAMA4], ids=["llama", "deepseek", "llama4"])
def test_least_memory_is_the_tables_bound(model):
    """The bound each ZeRO/offload variant of a family is ruled out by, from the memory terms
    alone, is the full tables' bound for every configuration of the space."""
    graph = _graph(model)
    cluster = make_cluster(load_gpu("h100"), 16)
    request = Request(num_gpus=16, gpus_per_node=8, global_batch=32, seq_len=64, max_micro_batch=2)
    configs = list(outer_configs(graph, request))
    assert {c.zero_stage for c in configs} == {0, 1, 2, 3} and {c.offload for c in configs} >= {"none", "both"}
    assert any(c.pp > 1 for c in configs) and (model is not DEEPSEEK or any(c.ep > 1 for c in configs))
    unit_sizes = set()
    for config in configs:
        tables = build_tables(graph, config, cluster)
        unit_sizes |= {len(blocks) for blocks in tables.unit_blocks}
        assert least_memory_kib(graph, config) == memory_lower_bound_kib(tables)
    assert unit_sizes == ({1, 4} if model is LLAMA4 else {1})


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


def test_a_periodic_stack_is_placed_a_period_at_a_time_and_one_chunk_groups_blocks_by_kind():
    from autoplan.solve.tables import _block_units

    names = ["mamba", "mamba", "mamba", "attention"] * 3
    periods = _block_units(names, 2)
    assert periods.blocks == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert periods.runs == ((0, 3, tuple(names[:4])),)
    # four chunks do not fit in three periods: the blocks, one run per change of kind
    singles = _block_units(names, 4)
    assert singles.blocks == tuple((i,) for i in range(12)) and len(singles.runs) == 6
    # nothing to cut: one run per kind, wherever its blocks sit
    whole = _block_units(names, 1)
    assert whole.blocks == tuple((i,) for i in (0, 1, 2, 4, 5, 6, 8, 9, 10, 3, 7, 11))
    assert whole.runs == ((0, 9, ("mamba",)), (9, 12, ("attention",)))
    # a stack of few runs is placed block by block: its cuts stay free
    assert _block_units(["dense"] * 2 + ["moe"] * 6, 2).blocks == tuple((i,) for i in range(8))


def test_the_solver_recomputation_lands_on_the_blocks_its_units_stand_for():
    from autoplan.config import ParallelConfig
    from autoplan.solve.cpsat import GroupTable, Partition, Tables
    from autoplan.solve.search import partition_to_config

    def group(name, lo, hi):
        return GroupTable(name, lo, hi, {"none": 1, "selective": 2, "full": 3}, 1,
                          {"none": 3, "selective": 2, "full": 1})

    # one chunk over a stack of kinds a, b, a, b: units sorted by kind (blocks 0, 2, 1, 3)
    tables = Tables(num_layers=4, pp=1, vpp=1, groups=[group("a", 0, 2), group("b", 2, 4)], slots=1.0,
                    in_flight=[1.0], capacity_kib=100, fixed_time_ns=[0], fixed_state_kib=[0],
                    fixed_activation_kib=[0], unit_blocks=((0,), (2,), (1,), (3,)))
    part = Partition(cuts=(0, 4), full=((1, 0),), selective=((0, 1),), objective_ns=0.0, status="OPTIMAL")
    config = partition_to_config(ParallelConfig(global_batch=4, seq_len=16), part, tables)
    assert config.layer_recompute == ("full", "selective", "none", "none") and config.stage_layers == (4,)
    # two chunks over two periods of (a, b): the second chunk's one full unit is blocks 2 and 3
    tables = Tables(num_layers=2, pp=2, vpp=1, groups=[group("a+b", 0, 2)], slots=1.0, in_flight=[1.0, 1.0],
                    capacity_kib=100, fixed_time_ns=[0, 0], fixed_state_kib=[0, 0],
                    fixed_activation_kib=[0, 0], unit_blocks=((0, 1), (2, 3)))
    part = Partition(cuts=(0, 1, 2), full=((0,), (1,)), selective=((0,), (0,)), objective_ns=0.0,
                     status="OPTIMAL")
    config = partition_to_config(ParallelConfig(global_batch=4, seq_len=16, pp=2), part, tables)
    assert config.stage_layers == (2, 2) and config.layer_recompute == ("none", "none", "full", "full")
