"""What an fp8 step pays beyond its float8 GEMMs: the casts of each linear's operands (torchao's
float8 roofline, Transformer Engine's fused kernels) and a head that stays in 16 bits."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import Runtime, compute, estimate, hw, layer_cost
from autoplan.cost.layers import float8_cast_times
from autoplan.cost.profile import block_profile
from autoplan.validate.published import float8_scaling, tp_comm_overlap_options

H, FFN, SEQ = 2048, 8192, 2048


def _fp8(**over) -> ParallelConfig:
    base = dict(global_batch=8, seq_len=SEQ, dp=1, micro_batch=1, precision="fp8")
    return ParallelConfig(**{**base, **over})


def test_tensorwise_casts_move_torchaos_roofline_bytes(make_gpt_graph, h100_cluster):
    # the textbook block's four linears over SEQ tokens: qkv (h -> 3h), proj (h -> h),
    # fc1 (h -> ffn), fc2 (ffn -> h). Per element, torchao's roofline: an input or output
    # gradient 2 (amax) + 2 + 1 + 1 (cast, both layouts); a weight 2 + 2 x (2 + 1).
    graph = make_gpt_graph(layers=2, hidden=H, heads=16, seq=SEQ)
    block, gpu = graph.blocks[0], h100_cluster(1).gpu
    inputs = SEQ * (H + H + H + FFN)
    grads = SEQ * (3 * H + H + FFN + H)
    weights = 3 * H * H + H * H + 2 * H * FFN
    fwd, bwd = float8_cast_times(block, graph, _fp8(), gpu, Runtime(), block_profile(graph, block))
    bw = hw.hbm_bytes_per_s(gpu)
    assert fwd == pytest.approx((6 * inputs + 8 * weights / 2) / bw, rel=1e-9)
    assert bwd == pytest.approx((6 * grads + 8 * weights / 2) / bw, rel=1e-9)


def test_casts_shrink_where_they_fuse_or_the_weights_are_kept(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=2, hidden=H, heads=16, seq=SEQ)
    block, gpu = graph.blocks[0], h100_cluster(1).gpu
    profile = block_profile(graph, block)

    def total(config, runtime=Runtime()):
        return sum(float8_cast_times(block, graph, config, gpu, runtime, profile))

    eager = total(_fp8())
    assert total(_fp8(compile=True)) < eager  # torch.compile fuses the amax into the op before
    assert total(_fp8(float8_recipe="rowwise")) > eager  # a 16-bit transpose, cast twice
    # Transformer Engine's kept weights: 1 cast per step of 8 micro-batches, not 8
    kept = total(_fp8(), Runtime(float8_scaling="delayed", float8_weights_per_step=True))
    every = total(_fp8(), Runtime(float8_scaling="delayed"))
    assert kept < every
    # no casts outside fp8 plans, nor in the embedding and head
    assert total(_fp8(precision="bf16")) == 0.0
    head = graph.segments[-1]
    assert head.kind == "post"
    assert sum(float8_cast_times(head, graph, _fp8(), gpu, Runtime(),
                                 block_profile(graph, head))) == 0.0


def test_an_fp8_plans_head_runs_its_gemm_in_16_bits(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=2, hidden=H, heads=16, seq=SEQ, vocab=128_000)
    head, gpu = graph.segments[-1], h100_cluster(1).gpu
    profile = block_profile(graph, head)
    args = (profile, head.hidden, head.experts)
    tail = (gpu, graph.batch_size, graph.dtype_bytes)
    as_fp8 = compute.block_times(*args, _fp8(), *tail, float8_linears=False)
    as_bf16 = compute.block_times(*args, _fp8(precision="bf16"), *tail)
    assert as_fp8.gemm_fwd_s == pytest.approx(as_bf16.gemm_fwd_s)
    assert as_fp8.gemm_fwd_s > compute.block_times(*args, _fp8(), *tail).gemm_fwd_s
    # and the whole step: the casts and the 16-bit head make fp8 slower than its GEMMs alone
    cluster = h100_cluster(1)
    block_cost = layer_cost(graph.blocks[0], graph, _fp8(), cluster)
    assert block_cost.fwd_s > compute.block_times(block_profile(graph, graph.blocks[0]), H, 0, _fp8(),
                                                  *tail).fwd_s
    assert estimate(graph, _fp8(), cluster).step_time_s < estimate(graph, _fp8(precision="bf16"),
                                                                   cluster).step_time_s


@pytest.mark.parametrize("precision,scaling", [
    ("FP8-CS", "tensorwise"), ("FP8-MX", "mxfp8"),
    ("FP8 (Transformer Engine; 'pre-training performance ... at FP8 precision')", "delayed"),
    ("FP8 mixed precision (fine-grained block-wise quantization; BF16/FP32 for sensitive ops)", "rowwise"),
    ("BF16 + Float8 linears", ""),  # torchao: the plan's recipe
])
def test_published_fp8_runs_name_their_scaling(precision, scaling):
    assert float8_scaling({"precision_key": "fp8", "precision": precision}) == scaling
    assert float8_scaling({"precision_key": "bf16", "precision": precision}) == ""


def test_asynctp_rows_overlap_tp_with_their_gemms():
    run = {"parallel": {"tp": 8}, "source": "pytorch/torchtitan docs/performance.md",
           "precision": "BF16 + Float8 linears (torch.compile, AsyncTP)"}
    assert tp_comm_overlap_options(run) == [True]
    assert tp_comm_overlap_options({**run, "precision": "BF16"}) == [False]
