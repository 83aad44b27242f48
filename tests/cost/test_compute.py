"""Compute time of a block copy: which memory-bound traffic tensor parallelism divides."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import compute
from autoplan.cost.profile import block_profile
from autoplan.hardware import load_gpu


def _op_bytes(graph, block, pick) -> float:
    ops = (graph.graph.nodes[n]["op"] for n in graph.segment_nodes(block))
    return sum(op.bytes_read + op.bytes_written for op in ops if pick(op))


def test_tp_without_sp_replicates_the_residual_stream_only(traced_gpt_block):
    # Korthikanti et al. 2022 §4.2.2: without sequence parallelism the LayerNorms and the
    # dropouts / residual adds after attention and MLP run whole on every TP rank; the GeLU on
    # the 4h columns and the softmax on the heads work on the rank's shard.
    graph, block, h, a, s, b = traced_gpt_block
    profile = block_profile(graph, block)
    norms = _op_bytes(graph, block, lambda op: op.kind == "norm")
    gelu = _op_bytes(graph, block, lambda op: "gelu" in op.target)
    softmax = _op_bytes(graph, block, lambda op: "softmax" in op.target)
    assert norms > 0 and gelu > 0 and softmax > 0
    assert norms <= profile.replicated_memory_bytes <= profile.memory_bytes - gelu - softmax
    for t in (2, 4):
        share = compute.tp_memory_share(profile, t, sequence_parallel=False)
        assert 1 / t < share < 1
        assert compute.tp_memory_share(profile, t, sequence_parallel=True) == 1 / t
    assert compute.tp_memory_share(profile, 1, sequence_parallel=False) == 1


def test_block_memory_time_without_sp_lies_between_sharded_and_replicated(traced_gpt_block):
    graph, block, h, a, s, b = traced_gpt_block
    profile = block_profile(graph, block)
    gpu = load_gpu("h100")

    def memory_s(tp, sp):
        config = ParallelConfig(global_batch=b, seq_len=s, tp=tp, micro_batch=b, sequence_parallel=sp)
        return compute.block_times(profile, h, 0, config, gpu, b, graph.dtype_bytes, a, s).memory_fwd_s

    whole = memory_s(1, False)
    assert memory_s(4, True) == pytest.approx(whole / 4, rel=1e-9)
    assert whole / 4 < memory_s(4, False) < whole
