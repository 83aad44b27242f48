"""Model-state and activation memory against the ZeRO and Korthikanti et al. formulas."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import memory


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    # ZeRO §3: 2 (fp16 weights) + 2 (fp16 grads) + 12 (fp32 master, momentum, variance)
    states = memory.model_state_bytes(1e9, "bf16", zero_stage=0, shard_degree=64)
    assert sum(states.values()) == 16e9
    assert states == {"parameters": 2e9, "gradients": 2e9, "optimizer": 12e9}


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, expected_gb):
    # ZeRO Figure 1: psi = 7.5B, N_d = 64 -> 120 / 31.4 / 16.6 / 1.9 GB per GPU; the paper
    # prints one decimal, so compare at 0.05 GB.
    states = memory.model_state_bytes(7.5e9, "fp16", zero_stage=stage, shard_degree=64)
    assert sum(states.values()) / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_offload_removes_states_from_gpu():
    states = memory.model_state_bytes(1e9, "bf16", 1, 8, offload="both")
    assert states["optimizer"] == 0 and states["parameters"] == 0 and states["gradients"] == 2e9


def _config(tp=1, sp=False, b=2, s=128, cp=1):
    return ParallelConfig(global_batch=b, seq_len=s, tp=tp, cp=cp, micro_batch=b,
                          sequence_parallel=sp, dp=1)


def test_korthikanti_no_parallelism(traced_gpt_block):
    # Eq. 1: sbh(34 + 5as/h) per layer with the attention matrix materialised (no flash).
    # 5% tolerance: the trace also saves LayerNorm mean/rstd, ignored by the formula.
    graph, block, h, a, s, b = traced_gpt_block
    got = memory.block_activation_bytes(graph, block, _config(), "none", flash_attention=False)
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.05)


@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_tensor_parallel_without_sp(traced_gpt_block, t):
    # Eq. 2: sbh(10 + 24/t + 5as/(ht)): LayerNorm/dropout/residual-width tensors replicated
    graph, block, h, a, s, b = traced_gpt_block
    got = memory.block_activation_bytes(graph, block, _config(tp=t), "none", flash_attention=False)
    assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=0.05)


@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_tensor_and_sequence_parallel(traced_gpt_block, t):
    # Eq. 4: sbh(34 + 5as/h)/t
    graph, block, h, a, s, b = traced_gpt_block
    got = memory.block_activation_bytes(graph, block, _config(tp=t, sp=True), "none",
                                        flash_attention=False)
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t, rel=0.05)


@pytest.mark.parametrize("t, sp, factor", [(1, False, 34.0), (4, True, 34.0 / 4), (4, False, 10 + 24 / 4)])
def test_korthikanti_selective_recompute(traced_gpt_block, t, sp, factor):
    # Eq. 6 (TP+SP+selective: 34sbh/t) and TP+selective without SP: sbh(10 + 24/t); Megatron's
    # selective, the Runtime trait published Megatron runs are costed with
    graph, block, h, a, s, b = traced_gpt_block
    got = memory.block_activation_bytes(graph, block, _config(tp=t, sp=sp), "selective",
                                        flash_attention=False, selective_policy="attention_core")
    assert got == pytest.approx(s * b * h * factor, rel=0.05)


def test_full_recompute_keeps_block_input(traced_gpt_block):
    graph, block, h, a, s, b = traced_gpt_block
    got = memory.block_activation_bytes(graph, block, _config(), "full")
    assert got == 2 * s * b * h  # exact: one 16-bit tensor of s x b x h


def test_flash_attention_drops_the_quadratic_term(traced_gpt_block):
    graph, block, h, a, s, b = traced_gpt_block
    flash = memory.block_activation_bytes(graph, block, _config(), "none", flash_attention=True)
    assert flash == pytest.approx(34 * s * b * h, rel=0.05)


def test_context_parallel_divides_tokens(traced_gpt_block):
    graph, block, h, a, s, b = traced_gpt_block
    one = memory.block_activation_bytes(graph, block, _config(), "selective")
    two = memory.block_activation_bytes(graph, block, _config(cp=2), "selective")
    assert two == pytest.approx(one / 2)


@pytest.mark.parametrize("stage, dp, expected", [(0, 8, 16.0), (1, 8, 9.0), (1, 64, 8.125),
                                                 (2, 8, 4.0), (3, 8, 2.0)])
def test_fp32_module_weights_runtime_bytes_per_parameter(stage, dp, expected):
    # autoplan's runtime keeps the fp32 master weights as the module's parameters, with fp32
    # gradients. Below ZeRO-2 it autocasts: 4 (fp32 weights) + 4 (fp32 grads) + 8 (Adam
    # moments, the part ZeRO-1 shards) = 8 + 8/dp with ZeRO-1, where the ZeRO paper's layout
    # gives 4 + 12/dp. FSDP2 shards all three, 16/dp, and at ZeRO-2 keeps the 16-bit gathered
    # weights from forward to backward (2 B); the paper's ZeRO-2 gives 2 + 14/dp. Checked
    # against the runtime's own tensors in tests/runtime/test_collectives.py.
    states = memory.model_state_bytes(1e9, "bf16", zero_stage=stage, shard_degree=dp,
                                      fp32_module_weights=True)
    assert sum(states.values()) / 1e9 == pytest.approx(expected)
    # fp32 training is the same for both layouts
    assert memory.model_state_bytes(1e9, "fp32", 1, dp, fp32_module_weights=True) == \
        memory.model_state_bytes(1e9, "fp32", 1, dp)


def test_fsdp2_cpu_offload_leaves_only_the_gathered_weights_on_the_gpu():
    # FSDP2's CPUOffloadPolicy (the runtime's only offload) keeps the fp32 shards, their
    # gradients and the optimizer step on the CPU; ZeRO-2 still holds the gathered 16-bit weights
    # from forward to backward. The ZeRO-Offload layout (fp32_module_weights=False) is unchanged.
    z2 = memory.model_state_bytes(1e9, "bf16", 2, 8, "both", fp32_module_weights=True)
    z3 = memory.model_state_bytes(1e9, "bf16", 3, 8, "both", fp32_module_weights=True)
    assert z2 == {"parameters": 2e9, "gradients": 0.0, "optimizer": 0.0}
    assert z3 == {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    paper = memory.model_state_bytes(1e9, "bf16", 3, 8, "both")
    assert paper["gradients"] == pytest.approx(2e9 / 8)


def test_dtensor_sequence_parallelism_keeps_the_gathered_linear_inputs():
    # autoplan's runtime (DTensor) saves each column-parallel linear group's all-gathered
    # input for backward, Megatron its 1/tp shard: the difference is one block input per
    # tensor-parallel pair, times (1 - 1/tp)
    from autoplan.cost.memory import block_activation_bytes, sp_gathered_input_bytes
    from autoplan.trace.tracer import graph_for_config

    graph = graph_for_config(dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                  vocab_size=256), 1, 32)
    block = graph.blocks[0]
    config = ParallelConfig(global_batch=4, seq_len=32, dp=1, tp=4, micro_batch=1, sequence_parallel=True)
    dtensor = block_activation_bytes(graph, block, config, "none", sp_saves_gathered_inputs=True)
    megatron = block_activation_bytes(graph, block, config, "none", sp_saves_gathered_inputs=False)
    pairs = sum(1 for pair in graph.tensor_parallel if pair["block"] == block.name)
    assert pairs == 2  # attention (q/k/v -> o) and MLP (gate/up -> down)
    assert sp_gathered_input_bytes(graph, block) == 2 * block.input_bytes
    assert dtensor - megatron == pytest.approx(2 * block.input_bytes * (1 - 1 / 4))


def test_autocast_weight_casts_are_held_once_whatever_the_recomputation():
    # below ZeRO-2 autoplan's runtime autocasts from fp32 weights: the 16-bit casts of every
    # linear's weight stay in autocast's cache for the micro-batch, recomputed or not; FSDP
    # (ZeRO-2/3) casts the parameters themselves, so there are none
    import torch.nn as nn

    from autoplan.cost import layer_cost
    from autoplan.hardware import load_gpu, make_cluster
    from autoplan.models.llama import build_llama
    from autoplan.trace.tracer import graph_for_config

    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                  max_position_embeddings=128)
    graph = graph_for_config(config, 1, 64)
    linears = sum(m.weight.numel() for m in build_llama(config).layers[0].modules()
                  if isinstance(m, nn.Linear))
    cluster = make_cluster(load_gpu("h100"), 8)
    for zero, expected in ((1, 2 * linears / 2), (3, 0.0)):
        parallel = ParallelConfig(global_batch=8, seq_len=64, dp=4, tp=2, zero_stage=zero,
                                  micro_batch=1, precision="bf16")
        for mode in ("none", "selective", "full"):
            cost = layer_cost(graph.blocks[0], graph, parallel, cluster, mode)
            assert cost.cast_weight_bytes == expected, (zero, mode)


def _moe_layer_states(zero: int, dp: int, ep: int, runtime, tp: int = 1, offload: str = "none"):
    """The LayerCost of tiny-moe's MoE block on dp x tp H100s."""
    import json

    from autoplan.cost.layers import layer_cost
    from autoplan.hardware import load_gpu, make_cluster
    from autoplan.trace.tracer import graph_for_config
    from autoplan.paths import cost_models_dir

    raw = json.loads((cost_models_dir() / "models" / "tiny-moe.json").read_text())
    graph = graph_for_config({k: v for k, v in raw.items() if not k.startswith("_")}, 1, 64,
                             probe_runtime=False)
    block = next(b for b in graph.blocks if b.experts)
    config = ParallelConfig(global_batch=8, seq_len=64, dp=dp, tp=tp, ep=ep, micro_batch=1,
                            zero_stage=zero, offload=offload)
    cost = layer_cost(block, graph, config, make_cluster(load_gpu("h100"), dp * tp),
                      runtime=runtime)
    return cost


@pytest.mark.parametrize("zero", [2, 3])
def test_autoplan_shards_expert_parallel_experts_with_fsdp_over_their_replicas(zero):
    # ZeRO-2/3: each MoE layer's experts are an FSDP unit on the ranks holding the same
    # experts (runtime/data_parallel.py apply_fsdp on runtime/mesh.py expert_dp_mesh): fp32
    # weight, gradient and Adam-moment shards, 4 + 4 + 8 B / 4 for dp8 ep2 (four replicas),
    # and at ZeRO-2 the 16-bit weights FSDP gathers and keeps from forward to backward (2 B),
    # as the dense parameters over their 8. Exact: bytes per parameter times parameters.
    from autoplan.cost.layers import Runtime

    cost = _moe_layer_states(zero, dp=8, ep=2, runtime=Runtime())
    experts, n, replicas = cost.expert_params, 8, 4
    assert experts > 0
    gathered = 2 if zero == 2 else 0
    assert cost.weight_bytes == pytest.approx(cost.dense_params * (4 / n + gathered)
                                              + experts * (4 / replicas + gathered))
    assert cost.grad_bytes == pytest.approx(cost.dense_params * 4 / n + experts * 4 / replicas)
    assert cost.optimizer_bytes == pytest.approx(cost.dense_params * 8 / n + experts * 8 / replicas)
    assert cost.zero3_gather_params == (cost.dense_params + experts if zero == 3 else 0.0)
    # CPU offload moves the experts' fp32 shards, gradients and moments to the host too
    offloaded = _moe_layer_states(zero, dp=8, ep=2, runtime=Runtime(), offload="both")
    assert offloaded.host_bytes == pytest.approx(cost.dense_params * 16 / n + experts * 16 / replicas)


def test_autoplan_zero1_shards_expert_moments_over_the_ranks_holding_the_same_experts():
    # ZeRO-1: ZeroRedundancyOptimizer over dp_replicate x ep_rest = dp x cp / ep ranks
    # (runtime/mesh.py ep_replica, runtime/data_parallel.py Zero1), not over the TP ranks,
    # which hold the same experts too (expert-TP 1); weights and gradients whole. dp4 tp2 ep2:
    # over 2 ranks, not the 4 replicas
    from autoplan.cost.layers import Runtime

    cost = _moe_layer_states(1, dp=4, ep=2, tp=2, runtime=Runtime())
    experts = cost.expert_params
    assert cost.optimizer_bytes == pytest.approx(cost.dense_params * 8 / 4 + experts * 8 / 2)
    assert cost.weight_bytes == pytest.approx((cost.dense_params + experts) * 4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_runtimes_that_shard_experts_over_tp_ranks_too(zero):
    # Megatron's distributed optimizer (expert-DP group tp x dp / ep) and torchtitan's FSDP on
    # its expert mesh (efsdp = dp_shard x tp / ep) shard the experts' states over the TP ranks
    # as well; autoplan's runtime over dp x cp / ep (its TP ranks hold the experts whole).
    # dp4 tp2 ep2: 4 shards against 2, so half the optimizer bytes; the same without TP
    from autoplan.cost.layers import Runtime

    theirs = _moe_layer_states(zero, dp=4, ep=2, tp=2, runtime=Runtime(experts_replicated_over_tp=False))
    ours = _moe_layer_states(zero, dp=4, ep=2, tp=2, runtime=Runtime())
    experts = ours.expert_params
    assert ours.optimizer_bytes - theirs.optimizer_bytes == pytest.approx(experts * (8 / 2 - 8 / 4))
    assert _moe_layer_states(zero, dp=8, ep=2, runtime=Runtime(experts_replicated_over_tp=False)) \
        == _moe_layer_states(zero, dp=8, ep=2, runtime=Runtime())
