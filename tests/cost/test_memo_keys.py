"""The memo keys of the per-block costs name every configuration field the costs read.

A field read but missing from a key would silently reuse another configuration's cost.
Each memoised function runs on a recording stand-in for the configuration and must read
only the fields its key holds (or properties derived from those alone).
"""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import compute, layers
from autoplan.hardware import load_gpu, make_cluster
from autoplan.trace.tracer import graph_for_config

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=128)
GRAPHS = {"dense": dict(model_type="llama", **TINY),
          "moe": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **TINY)}
COMPUTE_KEY = {"tp", "cp", "ep", "micro_batch", "precision", "sequence_parallel"}
LAYER_KEY = {"global_batch", "seq_len", "dp", "tp", "pp", "cp", "ep", "zero_stage", "offload", "micro_batch",
             "precision", "sequence_parallel", "dp_replicate",
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
def test_memoised_costs_read_only_their_key(kind, config):
    graph = graph_for_config(GRAPHS[kind], 1, 64)
    gpu = load_gpu("h100")
    cluster = make_cluster(gpu, config.world_size)
    for block in graph.segments:
        for flash in (True, False):
            seen = Recording(config)
            layers._compute_times(block, graph, seen, gpu, flash)
            assert seen.read <= COMPUTE_KEY, f"compute_times reads {seen.read - COMPUTE_KEY}"
            for mode in ("none", "selective", "full"):
                seen = Recording(config)
                layers._layer_cost(block, graph, seen, cluster, mode, flash_attention=flash,
                                   runtime=layers.Runtime(True, True))
                assert seen.read <= LAYER_KEY, f"layer_cost reads {seen.read - LAYER_KEY}"


def test_compute_times_is_shared_across_configurations_and_clusters():
    graph = graph_for_config(GRAPHS["dense"], 1, 64)
    gpu = load_gpu("h100")
    block = graph.blocks[0]
    a = layers.layer_cost(block, graph, CONFIGS[2], make_cluster(gpu, 8))
    other = ParallelConfig(global_batch=8, seq_len=64, dp=16, zero_stage=2, micro_batch=1, precision="fp32")
    b = layers.layer_cost(block, graph, other, make_cluster(gpu, 16))
    assert layers.compute_times(block, graph, CONFIGS[2], gpu) is layers.compute_times(block, graph, other, gpu)
    # the layer forwards differ only by ZeRO-2's copy of the gathered fp32 weights out of
    # FSDP2's gather buffer (compute.fsdp_copy_out_s)
    copy = compute.fsdp_copy_out_s(b.dense_params, 4, gpu)
    assert b.fwd_s - a.fwd_s == pytest.approx(copy, rel=1e-9)
