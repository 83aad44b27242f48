"""torchtitan's op-level SAC: what it saves and recomputes in a traced Llama block."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import Runtime, estimate, sac
from autoplan.hardware import load_gpu, make_cluster
from autoplan.trace.tracer import graph_for_config

H, KV_HEADS, HEADS, FFN, SEQ = 64, 2, 4, 128, 64
LLAMA = dict(model_type="llama", hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
             num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=256, max_position_embeddings=128)


@pytest.fixture(scope="module")
def graph():
    return graph_for_config(LLAMA, 1, SEQ)


def _config(**kw):
    return ParallelConfig(**{**dict(global_batch=8, seq_len=SEQ, dp=1, micro_batch=2, recompute="selective"), **kw})


def test_every_second_matmul_of_a_block_is_recomputed(graph):
    # Llama block matmuls in order q, k, v, o, gate, up, down: k, o and up are recomputed
    kv = H // HEADS * KV_HEADS
    weights = {"q": H * H, "k": H * kv, "v": H * kv, "o": H * H, "gate": H * FFN, "up": H * FFN, "down": FFN * H}
    expected = (weights["k"] + weights["o"] + weights["up"]) / sum(weights.values())
    block = graph.blocks[0]
    assert sac.op_sac_recompute_fraction(graph, block) == pytest.approx(expected, rel=1e-9)


def test_saved_bytes_are_the_block_input_and_the_saved_outputs(graph):
    block = graph.blocks[0]
    kv = H // HEADS * KV_HEADS
    tokens = 2 * SEQ  # micro-batch 2
    # input + q + v + SDPA output + gate + down, 2 bytes each (bf16)
    expected = 2 * tokens * (H + H + kv + H + FFN + H)
    assert sac.op_sac_activation_bytes(graph, block, _config()) == pytest.approx(expected, rel=1e-9)
    # TP shards the saved outputs, not the block input (no sequence parallelism)
    tp2 = _config(dp=1, tp=2, sequence_parallel=False)
    assert sac.op_sac_activation_bytes(graph, block, tp2) == pytest.approx(
        2 * tokens * H + (expected - 2 * tokens * H) / 2, rel=1e-9)


def test_the_runtime_trait_changes_selective_only(graph):
    cluster = make_cluster(load_gpu("h100"), 1)
    op = Runtime(selective_policy=sac.OP_SAC)
    sel_megatron, sel_op = (estimate(graph, _config(), cluster, runtime=r) for r in (Runtime(), op))
    assert sel_op.memory_breakdown_gib["activations"] != sel_megatron.memory_breakdown_gib["activations"]
    assert sel_op.time_breakdown_s["recompute"] > sel_megatron.time_breakdown_s["recompute"]
    full_default, full_op = (estimate(graph, _config(recompute="full"), cluster, runtime=r) for r in (Runtime(), op))
    assert full_op.memory_gib_per_gpu == full_default.memory_gib_per_gpu
    assert full_op.step_time_s == full_default.step_time_s


def test_allocator_reserve_is_added_to_memory_and_feasibility(graph):
    cluster = make_cluster(load_gpu("h100"), 1)
    plain = estimate(graph, _config(), cluster)
    reserved = estimate(graph, _config(), cluster, runtime=Runtime(allocator_reserve_fraction=0.1))
    assert "allocator_reserve" not in plain.memory_breakdown_gib
    assert reserved.memory_gib_per_gpu == pytest.approx(plain.memory_gib_per_gpu * 1.1, rel=1e-12)
    assert reserved.memory_breakdown_gib["allocator_reserve"] == pytest.approx(plain.memory_gib_per_gpu * 0.1)
