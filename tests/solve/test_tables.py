"""The search's family time bound equals the bound of the full tables, to the last bit."""

from __future__ import annotations

import pytest

from autoplan.hardware import load_gpu, make_cluster
from autoplan.solve.space import Request, outer_configs
from autoplan.solve.tables import build_tables, lower_bound_ns, time_lower_bound_ns
from autoplan.trace.tracer import graph_for_config

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=128)


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
