"""torch.compile per block as a plan choice (ParallelConfig.compile): the cost model counts the
compiled block's fused kernels (compute.block_times, torchtitan's apply_compile), never more time
than eager, and the same memory (the cost model keeps eager's saved tensors)."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import estimate
from autoplan.hardware import load_gpu, make_cluster
from autoplan.trace.tracer import graph_for_config

LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=688, vocab_size=4096, max_position_embeddings=1024)
MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("config, degrees", [
    (LLAMA, dict(dp=8, zero_stage=3, recompute="selective")),
    (LLAMA, dict(dp=2, tp=4, sequence_parallel=True)),
    (LLAMA, dict(dp=4, pp=2, schedule="1f1b", micro_batch=1)),
    (MIXTRAL, dict(dp=8, ep=4, zero_stage=2)),
])
def test_a_compiled_plan_is_faster_and_holds_the_same_memory(config, degrees):
    graph = graph_for_config(config, 1, 1024)
    cluster = make_cluster(load_gpu("h100-sxm-80gb"), 8, 8)
    eager = estimate(graph, ParallelConfig(global_batch=16, seq_len=1024, **degrees), cluster)
    compiled = estimate(graph, ParallelConfig(global_batch=16, seq_len=1024, compile=True, **degrees), cluster)
    assert compiled.step_time_s < eager.step_time_s
    assert compiled.memory_gib_per_gpu == eager.memory_gib_per_gpu
