"""The cost cache (cost/cache.py): its keys name every configuration field a cost reads,
and it changes no number.

A field read but missing from a key would silently reuse another configuration's cost.
Each cached function runs on a recording stand-in for the configuration and must read
only the fields its key holds (or properties derived from those alone).
"""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import CostCache, compute, estimate, estimate_partition, layers, partition
from autoplan.hardware import load_gpu, make_cluster
from autoplan.trace.tracer import graph_for_config

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=128)
GRAPHS = {"dense": dict(model_type="llama", **TINY),
          "moe": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **TINY)}
COMPUTE_KEY = {"tp", "cp", "ep", "micro_batch", "precision", "sequence_parallel"}
ACTIVATION_KEY = {"tp", "cp", "micro_batch", "precision", "sequence_parallel",
                  "zero_stage"}  # keyed as whether autocast computes from fp32 weights
STATES_KEY = {"dp", "tp", "pp", "cp", "ep", "zero_stage", "offload", "precision", "dp_replicate",
              "dp_shard"}  # = dp // dp_replicate
LAYER_KEY = {"global_batch", "seq_len", "dp", "tp", "pp", "cp", "ep", "zero_stage", "offload", "micro_batch",
             "precision", "sequence_parallel", "dp_replicate", "compile",
             "async_tp", "float8_recipe", "float8_all_gather",
             "dp_shard",  # = dp // dp_replicate
             "num_microbatches"}  # = global_batch // (dp * micro_batch)


class Recording:
    """Reads through to a ParallelConfig, remembering every field asked for."""

    def __init__(self, config: ParallelConfig):
        self._config, self.read = config, set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._config, name)


CONFIGS = [
    ParallelConfig(global_batch=16, seq_len=64, dp=2, tp=2, pp=2, cp=2, ep=2, zero_stage=3, offload="both",
                   micro_batch=2, precision="bf16", dp_replicate=2),
    ParallelConfig(global_batch=8, seq_len=64, dp=4, tp=2, pp=1, cp=1, ep=4, zero_stage=1,
                   offload="optimizer", micro_batch=1, precision="fp8", sequence_parallel=False),
    ParallelConfig(global_batch=8, seq_len=64, dp=8, zero_stage=0, micro_batch=1, precision="fp32"),
]


@pytest.mark.parametrize("kind", sorted(GRAPHS))
@pytest.mark.parametrize("config", CONFIGS)
def test_cached_costs_read_only_their_key(kind, config):
    graph = graph_for_config(GRAPHS[kind], 1, 64)
    gpu = load_gpu("h100")
    cluster = make_cluster(gpu, config.world_size)
    for block in graph.segments:
        for flash in (True, False):
            seen = Recording(config)
            layers._compute_times(block, graph, seen, gpu, flash)
            assert seen.read <= COMPUTE_KEY, f"compute_times reads {seen.read - COMPUTE_KEY}"
            for runtime in (layers.Runtime(), layers.Runtime(True, True)):
                seen = Recording(config)
                layers._layer_states(block, graph, seen, runtime)
                assert seen.read <= STATES_KEY, f"layer_states reads {seen.read - STATES_KEY}"
            for mode in ("none", "selective", "full"):
                for policy in ("op", "attention_core", layers.sac.OP_SAC):
                    seen = Recording(config)
                    layers._activation_bytes(block, graph, seen, mode, flash, layers.Runtime(
                        selective_policy=policy, sp_saves_gathered_inputs=True))
                    assert seen.read <= ACTIVATION_KEY, f"activation_bytes reads {seen.read - ACTIVATION_KEY}"
                seen = Recording(config)
                layers._layer_cost(block, graph, seen, cluster, mode, flash_attention=flash,
                                   runtime=layers.Runtime(True, True))
                assert seen.read <= LAYER_KEY, f"layer_cost reads {seen.read - LAYER_KEY}"


def test_compute_times_is_shared_across_configurations_and_clusters():
    graph = graph_for_config(GRAPHS["dense"], 1, 64)
    gpu = load_gpu("h100")
    block = graph.blocks[0]
    cache = CostCache()
    a = layers.layer_cost(block, graph, CONFIGS[2], make_cluster(gpu, 8), cache=cache)
    other = ParallelConfig(global_batch=8, seq_len=64, dp=16, zero_stage=2, micro_batch=1, precision="fp32")
    b = layers.layer_cost(block, graph, other, make_cluster(gpu, 16), cache=cache)
    assert (layers.compute_times(block, graph, CONFIGS[2], gpu, cache=cache)
            is layers.compute_times(block, graph, other, gpu, cache=cache))
    # the layer forwards differ only by ZeRO-2's copy of the gathered fp32 weights out of
    # FSDP2's gather buffer (compute.fsdp_copy_out_s)
    copy = compute.fsdp_copy_out_s(b.dense_params, 4, gpu)
    assert b.fwd_s - a.fwd_s == pytest.approx(copy, rel=1e-9)


def test_without_a_cache_every_cost_is_computed_afresh():
    graph = graph_for_config(GRAPHS["dense"], 1, 64)
    cluster = make_cluster(load_gpu("h100"), 8)
    block = graph.blocks[0]
    first = layers.layer_cost(block, graph, CONFIGS[2], cluster)
    again = layers.layer_cost(block, graph, CONFIGS[2], cluster)
    assert first is not again and first == again
    cache = CostCache()
    assert (layers.layer_cost(block, graph, CONFIGS[2], cluster, cache=cache)
            is layers.layer_cost(block, graph, CONFIGS[2], cluster, cache=cache))


def test_clusters_alike_but_for_their_links_do_not_share_costs():
    """A cluster is keyed by identity: a second cluster of the same GPU and count with a slower
    inter-node link must get its own (slower: latency-bound at this size) communication, not the first cluster's."""
    graph = graph_for_config(GRAPHS["dense"], 1, 64)
    gpu = load_gpu("h100")
    config = ParallelConfig(global_batch=64, seq_len=64, dp=16, zero_stage=3, micro_batch=1)
    fast, slow = make_cluster(gpu, 16), make_cluster(gpu, 16, inter_node_bandwidth_gb_per_s=1.0)
    cache = CostCache()
    block = graph.blocks[0]
    on_fast = layers.layer_cost(block, graph, config, fast, cache=cache)
    on_slow = layers.layer_cost(block, graph, config, slow, cache=cache)
    assert on_slow.comm_total_s["zero3"] > on_fast.comm_total_s["zero3"]
    assert on_slow == layers.layer_cost(block, graph, config, slow)


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_an_estimate_is_the_same_with_and_without_a_cache(config):
    graph = graph_for_config(GRAPHS["moe"], 1, 64)
    cluster = make_cluster(load_gpu("h100"), config.world_size)
    cache = CostCache()
    estimate_partition(graph, config, cluster, partition(graph, config), cache=cache)  # fills it
    cached = estimate_partition(graph, config, cluster, partition(graph, config), cache=cache)
    assert cached.to_dict() == estimate(graph, config, cluster).to_dict()
