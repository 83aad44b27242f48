"""A sequence loop a library runs as one fused GPU kernel (transformers' Mamba: mamba-ssm's
selective scan) is costed by the tensors it moves across its boundary, on GPUs; op by op,
as traced, on the CPU device, where transformers runs the loop."""

from __future__ import annotations

import pytest
import torch

from autoplan.cost import compute
from autoplan.cost.profile import block_profile
from autoplan.hardware import resolve_cluster
from autoplan.trace.tracer import trace_model

HIDDEN, EXPAND, STATE, SEQ = 64, 2, 8, 32
INNER = HIDDEN * EXPAND


@pytest.fixture(scope="module")
def mamba_graph():
    pytest.importorskip("transformers")
    from autoplan.models.hf import build_transformers_model

    config = dict(model_type="mamba", hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=256,
                  state_size=STATE, expand=EXPAND, conv_kernel=4, time_step_rank=8,
                  tie_word_embeddings=False)
    with torch.device("meta"):
        model = build_transformers_model(config, "config.json")
    return trace_model(model, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),))


def test_the_fused_scan_moves_its_inputs_and_output_once(mamba_graph):
    (block,) = mamba_graph.blocks
    profile = block_profile(mamba_graph, block)
    # the selective scan's own tensors (Gu & Dao 2023 §3.3.2), 2 bytes each as traced: it reads
    # u, delta and the gate z (L x inner each), B and C (L x state each), writes y (L x inner)
    least = (4 * SEQ * INNER + 2 * SEQ * STATE) * 2
    # the region also reads the conv's padded output and writes the activated input x_proj
    # reads: at most twice the scan's own tensors
    assert least <= profile.scan_fused_bytes <= 2 * least, profile.scan_fused_bytes
    # op by op, the loop reads and writes the discretised (inner x state) tensors every token
    assert profile.scan_memory_bytes > 5 * profile.scan_fused_bytes
    assert profile.scan_kernels > 2 * SEQ and profile.scan_gemms  # the per-token state @ C


def test_gpus_cost_the_fused_kernel_and_the_cpu_device_the_loop(mamba_graph):
    (block,) = mamba_graph.blocks
    profile = block_profile(mamba_graph, block)
    loop = compute.block_memory_bytes(profile, 2, 2)
    fused = compute.block_memory_bytes(profile, 2, 2, fused_scan=True)
    assert loop - fused == pytest.approx(profile.scan_memory_bytes - profile.scan_fused_bytes)
    assert compute.block_kernels(profile, fused_scan=True) == profile.kernels - profile.scan_kernels + 1
    assert resolve_cluster("h100", None, 8, None).gpu.fused_library_kernels
    assert not resolve_cluster("cpu", None, 4, None).gpu.fused_library_kernels


def test_a_model_without_a_sequence_loop_costs_the_same_either_way():
    from autoplan.trace.tracer import graph_for_config

    graph = graph_for_config(dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                  vocab_size=256), 1, 32, probe_runtime=False)
    profile = block_profile(graph, graph.blocks[0])
    assert graph.sequence_loops == [] and profile.scan_kernels == 0
    assert compute.block_memory_bytes(profile, 2, 2, fused_scan=True) == compute.block_memory_bytes(profile, 2, 2)
