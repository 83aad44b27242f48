"""Compute time of one block copy on one rank, per micro-batch.

- GEMMs: FLOPs / (peak(dtype) x efficiency(FLOPs, smallest dim, dtype)); the efficiency
  curve is measured data of the GPU file (hardware.md B.4: cuBLASLt GEMM sweeps, MAMF).
- Attention core: causal FlashAttention computes half of the non-causal FLOPs the graph
  counts (Dao 2023, FlashAttention-2 §3.1.1 skips masked blocks) at the GPU file's
  measured FlashAttention fraction of peak (hardware.md B.4); it stays in 16-bit under
  fp8 training (Transformer Engine runs FP8 GEMMs only).
- Memory-bound ops (norms, elementwise, embedding, loss, MoE permutation): bytes / (HBM
  bandwidth x the GPU file's STREAM fraction) (roofline; hardware.md B.4). Eager PyTorch runs
  one kernel per op, each reading its inputs from HBM and writing its output; torch.compile
  fuses the ops between two GEMMs into one kernel (profile.inductor_fused_traffic); an
  RMSNorm written as torch ops runs op by op in fp32 when eager (block_memory_bytes).
- Backward: 2x the forward GEMM FLOPs (input and weight gradients, Narayanan et al. 2021
  §5.1), 2.5x for FlashAttention (5 matmuls in backward vs 2 forward, Dao 2023 §3.1.2),
  2x the memory traffic (reads the output gradient and the saved input, writes one grad).
- TP divides GEMM FLOPs (column-parallel splits N, row-parallel splits K: Shoeybi et al.
  2019 §3) and attention heads; CP divides the tokens of a rank; routed experts keep their
  per-rank FLOPs under EP but see ep x more tokens per expert (dropless, balanced).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.config import ParallelConfig
from autoplan.cost import hw
from autoplan.cost.kv_heads import kv_gemm_ways
from autoplan.cost.profile import BlockProfile

BACKWARD_GEMM_FACTOR = 2.0  # Narayanan et al. 2021 §5.1
BACKWARD_ATTENTION_FACTOR = 2.5  # Dao 2023 (FlashAttention-2) §3.1.2
BACKWARD_MEMORY_FACTOR = 2.0  # roofline: grad in + saved input read, one grad written
CAUSAL_FRACTION = 0.5  # causal mask: half of the score matrix is computed
# (forward, backward) time of a FlashAttention kernel over FlashAttention-2's, whose speed the
# GPU file measures. "triton": the 2022 FlashAttention Triton kernel (flash_attn_triton.py, on
# pre-MLIR Triton): "FlashAttention-2 is around 1.3-1.5x faster than FlashAttention in Triton in
# the forward pass and around 2x faster in the backward pass" (Dao 2023 §4.1, A100).
FLASH_KERNEL_SLOWDOWN = {"flash2": (1.0, 1.0), "triton": (1.4, 2.0)}
# Cross-entropy over the vocabulary in fp32 (Megatron-Core tensor_parallel/cross_entropy.py,
# VocabParallelCrossEntropy; Korthikanti et al. 2022 App. B keep fp32 logits), bytes per logit.
# Forward: `.float()` reads the 16-bit logits and writes fp32 (2 + 4), `max` reads (4), the
# in-place max-subtract, `exp` and softmax `div_` each read and write (3 x 8), `sum` reads (4).
# Backward: the in-place `grad_input.mul_(grad_output)` reads and writes the saved fp32 softmax
# (8), then the `.float()` cast's backward reads it and writes the 16-bit gradient (4 + 2).
LOSS_FWD_BYTES_PER_LOGIT = (2 + 4) + 4 + 3 * (4 + 4) + 4
LOSS_BWD_BYTES_PER_LOGIT = (4 + 4) + (4 + 2)
# An RMSNorm module written as torch ops, run eagerly: torchtitan's `RMSNorm` (norm_type
# "rmsnorm", torchtitan/models/norms.py @9dec370a: `self._norm(x.float()).type_as(x) *
# self.weight`, `_norm(x) = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)`) issues
# `float`, `pow`, `mean`, `add`, `rsqrt`, `mul`, `type_as` and the weight `mul`, 8 kernels.
DECOMPOSED_RMSNORM_KERNELS = 8
RMSNORM_KERNELS = ("fused", "decomposed")
FP32_BYTES = 4


@dataclass(frozen=True)
class BlockTimes:
    """Seconds per micro-batch on one rank, and FLOPs it executes."""

    gemm_fwd_s: float
    attention_fwd_s: float
    memory_fwd_s: float
    fwd_s: float
    bwd_s: float
    fwd_flops: float  # graph-counted forward FLOPs on this rank (for MFU)


def activation_dtype_bytes(precision: str) -> int:
    """Bytes per activation element: fp8 training keeps 16-bit activations (TE)."""
    return 4 if precision == "fp32" else 2


def decomposed_rmsnorm_bytes_per_element(act_bytes: int) -> int:
    """HBM bytes per input element of an RMSNorm run op by op in fp32 (the kernels of
    DECOMPOSED_RMSNORM_KERNELS): the upcast reads the activation and writes fp32 (act + 4),
    `pow` reads and writes fp32 (8), `mean` reads it (4; its per-row output, the `add` and
    `rsqrt` on it are 1/hidden of this), the scaling `mul` reads and writes fp32 (8), the
    downcast reads fp32 and writes the activation (4 + act), the weight `mul` reads and writes
    it (2 act). A fused kernel (torch's aten::_fused_rms_norm, which F.rms_norm runs when
    input and weight share a dtype: aten/src/ATen/native/layer_norm.cpp rms_norm_symint;
    Apex, Transformer Engine, torchtitan's Triton fused_rmsnorm) reads and writes the
    activation once, 2 act: 36 B against 4 in 16-bit training."""
    return (act_bytes + FP32_BYTES) + 2 * FP32_BYTES + FP32_BYTES + 2 * FP32_BYTES \
        + (FP32_BYTES + act_bytes) + 2 * act_bytes


def block_memory_bytes(profile: BlockProfile, act_bytes: int, traced_dtype_bytes: int,
                       compiled: bool = False, rmsnorm_kernel: str = "fused",
                       scale: float = 1.0, fused_scan: bool = False) -> float:
    """HBM bytes of the block copy's memory-bound ops in the forward, in the run's activation
    dtype, for `scale` times the traced tokens. `compiled`: torch.compile fuses them per region
    (profile.inductor_fused_traffic; the norms' decomposition fuses with the rest, as
    torchtitan's "compiled_rmsnorm" did, pytorch/torchtitan#442). Eager: op by op, with each
    RMSNorm one kernel ("fused") or op by op in fp32 ("decomposed",
    decomposed_rmsnorm_bytes_per_element). `fused_scan`: a sequence loop a library runs as one
    kernel (profile.FUSED_SCAN_CLASSES) moves its boundary tensors only."""
    if compiled and profile.fused_memory_bytes is not None:
        return profile.fused_memory_bytes * scale * act_bytes / traced_dtype_bytes
    memory = profile.memory_bytes
    if fused_scan:
        memory += profile.scan_fused_bytes - profile.scan_memory_bytes
    bytes_ = memory * scale * act_bytes / traced_dtype_bytes
    if rmsnorm_kernel == "decomposed":
        bytes_ += profile.rmsnorm_elements * scale * (decomposed_rmsnorm_bytes_per_element(act_bytes)
                                                      - 2 * act_bytes)
    return bytes_


def block_kernels(profile: BlockProfile, compiled: bool = False, rmsnorm_kernel: str = "fused",
                  fused_scan: bool = False) -> int:
    """Kernels one forward of the block copy launches (host.block_host_s): one per fused region
    and extern kernel when compiled, else one per op, a decomposed RMSNorm's eight, and a
    fused sequence loop's one."""
    if compiled and profile.fused_kernels is not None:
        return profile.fused_kernels
    extra = DECOMPOSED_RMSNORM_KERNELS - 1 if rmsnorm_kernel == "decomposed" else 0
    scan = 1 - profile.scan_kernels if fused_scan and profile.scan_kernels else 0
    return profile.kernels + extra * profile.rmsnorm_ops + scan


def gemm_precision(precision: str, float8_linears: bool = True) -> str:
    """The GEMMs' precision; a block whose linears stay 16-bit under fp8 (the embedding and
    the head: torchao's module filter in torchtitan and autoplan's runtime, Megatron's
    output layer outside Transformer Engine) runs them in bf16."""
    if precision == "fp8" and not float8_linears:
        return "bf16"
    return "fp16" if precision == "fp16" else precision


# HBM bytes per element that casting one operand of a linear to float8 moves over the linear's
# forward and backward, by scaling recipe: (input or grad_output, the same with the amax fused
# into the op before it, weight). From torchao's float8 roofline
# (torchao/testing/float8/roofline_utils.py get_tensor_memory_traffic_ovhd_s @042170ff):
# - tensorwise: an amax pass reads the 16-bit tensor (2; none when fused), the cast reads it
#   again and writes float8 row- and column-major (2 + 1 + 1); a weight is cast for the forward
#   and again for the backward after its amax pass (2 + 2 x (2 + 1)). Transformer Engine's
#   current scaling ("FP8-CS") runs the same amax and cast-transpose kernels.
# - rowwise: the row-major cast also writes a 16-bit transpose, cast again column-major
#   (2 + 1 + 2, then 2 + 1); a weight: cast (2 + 1), transpose (2 + 2), cast (2 + 1).
# - mxfp8: one kernel reads 16 bits and writes both block-scaled layouts (2 + 1 + 1); a weight
#   is cast once per layout (2 x (2 + 1)).
# - delayed (Transformer Engine's DelayedScaling, NeMo's default FP8 recipe): the scale comes
#   from past amaxes, which the cast kernel records as it runs: one fused cast-transpose
#   (transformer_engine fp8_cast_transpose_fused) reads 16 bits and writes both layouts
#   (2 + 1 + 1), for weights too; fused with the op before it (TE's LayerNormLinear and
#   LayerNormMLP write their norm and activation outputs in float8, its dact kernels
#   fp8_cast_transpose_bgrad_dgelu_fused the gradients) only the column-major copy is
#   extra (1 + 1).
FLOAT8_CAST_BYTES = {"tensorwise": (6, 4, 8), "rowwise": (8, 6, 10), "mxfp8": (4, 2, 6),
                     "delayed": (4, 2, 4)}


def float8_cast_s(profile: BlockProfile, hidden: int, experts: int, config: ParallelConfig, gpu,
                  traced_batch: int, scaling: str, fused: bool,
                  weight_casts: float) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of casting the block's GEMM operands to float8
    (FLOAT8_CAST_BYTES), memory-bound at the GPU's HBM rate: the inputs and half the weight
    casts in the forward, the output gradients and the other half in the backward. `fused`:
    the activations' amax runs in the op before the linear (torch.compile fuses it, torchao's
    roofline "fuse_with_prev"); `weight_casts`: weight casts per micro-batch (1 for torchao,
    1/micro-batches where Transformer Engine keeps the step's float8 weights, 1/dp where the
    float8 all-gather casts a shard). Elements from FLOPs: a GEMM of F FLOPs over (M, N, K)
    reads F/2N input and F/2K gradient elements and F/2M weight elements (every expert's)."""
    unfused, amax_fused, weight = FLOAT8_CAST_BYTES[scaling]
    activation = amax_fused if fused else unfused
    scale = config.micro_batch / traced_batch / config.cp
    ep = config.ep if experts else 1
    fwd = bwd = 0.0
    for g in profile.gemms:
        m, n, k, f = _sharded_gemm(g, scale, config.tp, ep, hidden, profile.routed_tokens_per_token,
                                   experts)
        weight_bytes = f / (2 * m) * weight * weight_casts / 2
        fwd += f / (2 * n) * activation + weight_bytes
        bwd += f / (2 * k) * activation + weight_bytes
    bw = hw.hbm_bytes_per_s(gpu)
    return fwd / bw, bwd / bw


def _sharded_gemm(g, scale_tokens: float, tp: int, ep: int, hidden: int,
                  routed: float, experts: int) -> tuple[float, float, float, float]:
    """(M, N, K, FLOPs) on one rank."""
    m = g.m * scale_tokens
    flops = g.flops * scale_tokens
    n, k = float(g.n), float(g.k)
    if g.expert:
        m = m * ep  # a local expert receives tokens of every EP rank (balanced)
        if tp > 1:
            flops /= tp
            if ep == 1:
                n = n / tp  # expert weights TP-sharded
            else:
                m = m / tp  # expert-TP 1: the TP ranks' tokens are split before dispatch
        return m, n, k, flops
    if tp > 1:
        ways = kv_gemm_ways(g.kv_heads, tp) if g.kv_heads else tp
        flops /= ways
        if g.n == hidden and not g.kv_heads:
            k = k / tp  # row-parallel: output is the residual width
        else:
            n = n / ways
    return m, n, k, flops


def materialized_attention_s(attention_flops: float, head_dim: int, heads: int, seq_len: int,
                             batch: float, gpu, precision: str, act_bytes: int) -> tuple[float, float]:
    """(GEMM seconds, memory seconds) of an unfused attention core: QK^T and AV as batched
    GEMMs over the full (non-causal) score matrix, then scale/mask/softmax and dropout over
    its b*a*s^2 elements: 5 bytes per element kept (Korthikanti et al. 2022 Eq. 1: softmax
    output 2, dropout mask 1, dropout output 2) plus the score matrix written and read
    (2 + 2), i.e. 9 bytes per element per forward."""
    per_gemm = 2.0 * seq_len * seq_len * head_dim
    peak = hw.peak_flops_per_s(gpu, "fp32" if precision == "fp32" else "bf16")
    gemm = attention_flops / (peak * hw.matmul_fraction(gpu, per_gemm, head_dim, "bf16"))
    elements = batch * heads * seq_len * seq_len
    return gemm, elements * (4 + 5) * act_bytes / 2 / hw.hbm_bytes_per_s(gpu)


def block_times(profile: BlockProfile, hidden: int, experts: int, config: ParallelConfig,
                gpu, traced_batch: int, traced_dtype_bytes: int, heads: int = 0,
                seq_len: int = 0, flash_attention: bool = True,
                flash_kernel: str = "flash2", compiled: bool = False,
                rmsnorm_kernel: str = "fused", fused_scan: bool = False,
                float8_linears: bool = True) -> BlockTimes:
    """Forward and backward seconds of one block copy per micro-batch on one rank.

    `flash_attention=False` costs the attention core unfused (materialized s x s scores,
    as Megatron-LM before FlashAttention, Dao et al. 2022); otherwise `flash_kernel` names the
    FlashAttention kernel (FLASH_KERNEL_SLOWDOWN). `compiled` and `rmsnorm_kernel` say how the
    memory-bound ops run (block_memory_bytes); `fused_scan` whether a sequence loop runs as its
    library's fused kernel (its GEMMs then are part of that memory-bound kernel);
    `float8_linears` whether an fp8 plan runs this block's GEMMs in float8 (gemm_precision)."""
    tp, cp = config.tp, config.cp
    ep = config.ep if experts else 1
    scale = config.micro_batch / traced_batch / cp  # tokens on this rank vs traced
    precision = gemm_precision(config.precision, float8_linears)
    peak = hw.peak_flops_per_s(gpu, precision)
    gemm_s = 0.0
    flops = 0.0
    scan_fused = fused_scan and not compiled
    for g in profile.gemms + (() if scan_fused else profile.scan_gemms):
        m, n, k, f = _sharded_gemm(g, scale, tp, ep, hidden, profile.routed_tokens_per_token,
                                   experts)
        flops += f
        # efficiency of one kernel call: one expert's GEMM for routed experts
        call_flops = 2.0 * m * n * k if g.expert else f
        gemm_s += f / (peak * hw.matmul_fraction(gpu, call_flops, min(m, n, k), precision))
    attention = profile.attention_flops * scale / tp
    flops += attention
    attention_s = 0.0
    attention_bwd_s = 0.0
    attention_memory_s = 0.0
    if attention and not flash_attention and heads and seq_len:
        attention_s, attention_memory_s = materialized_attention_s(
            attention, profile.head_dim, heads / tp, seq_len, config.micro_batch / cp, gpu,
            config.precision, activation_dtype_bytes(config.precision))
        attention_bwd_s = BACKWARD_GEMM_FACTOR * attention_s
    elif attention:
        peak16 = hw.peak_flops_per_s(gpu, "fp32" if config.precision == "fp32" else "bf16")
        flash2_s = attention * CAUSAL_FRACTION / (
            peak16 * hw.attention_fraction(gpu, attention * CAUSAL_FRACTION, profile.head_dim))
        slow_fwd, slow_bwd = FLASH_KERNEL_SLOWDOWN[flash_kernel]
        attention_s = flash2_s * slow_fwd
        attention_bwd_s = BACKWARD_ATTENTION_FACTOR * flash2_s * slow_bwd
    memory = block_memory_bytes(profile, activation_dtype_bytes(config.precision), traced_dtype_bytes,
                                compiled, rmsnorm_kernel, scale, scan_fused)
    memory *= tp_memory_share(profile, tp, config.sequence_parallel)
    memory_s = memory / hw.hbm_bytes_per_s(gpu) + attention_memory_s
    fwd = gemm_s + attention_s + memory_s
    bwd = BACKWARD_GEMM_FACTOR * gemm_s + attention_bwd_s + BACKWARD_MEMORY_FACTOR * memory_s
    return BlockTimes(gemm_s, attention_s + attention_memory_s, memory_s, fwd, bwd, flops)


def tp_memory_share(profile: BlockProfile, tp: int, sequence_parallel: bool) -> float:
    """Share of a block's memory-bound traffic one TP rank runs: 1/tp with sequence parallelism
    (Korthikanti et al. 2022 §4.2.2); without, the residual-stream ops run whole on every rank
    (profile.replicated_memory_op) and the ops on sharded heads and ffn columns 1/tp."""
    if sequence_parallel or tp == 1:
        return 1.0 / tp
    total = profile.memory_bytes
    replicated = total if profile.replicated_memory_bytes is None else profile.replicated_memory_bytes
    share = replicated / total if total else 1.0
    return share + (1.0 - share) / tp


def loss_times_s(tokens: float, vocab: int, tp: int, gpu) -> tuple[float, float]:
    """(forward, backward) seconds of the fp32 cross-entropy over `tokens` x vocab/tp logits."""
    logits = tokens * vocab / tp
    bw = hw.hbm_bytes_per_s(gpu)
    return logits * LOSS_FWD_BYTES_PER_LOGIT / bw, logits * LOSS_BWD_BYTES_PER_LOGIT / bw


def fsdp_copy_out_s(gathered_params: float, weight_bytes: int, gpu) -> float:
    """Seconds to copy one all-gather's parameters out of the gather buffer into their own
    tensors: FSDP2 fully_shard runs `FSDP::all_gather_copy_out` (split_with_sizes_copy, one
    read and one write of each gathered parameter) on the compute stream before the block may
    run (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py wait_for_unshard)."""
    return gathered_params * 2 * weight_bytes / hw.hbm_bytes_per_s(gpu)


def fsdp_copy_in_s(params: float, grad_bytes: int, reduce_bytes: int, gpu) -> float:
    """Seconds to copy one reduce-scatter's gradients into its send buffer: FSDP2 fully_shard
    runs `foreach_reduce_scatter_copy_in` (torch.ops.fsdp.chunk_cat into a buffer of the
    reduce dtype, one read of each unsharded gradient and one write in the reduce dtype) on
    the compute stream, which the reduce-scatter stream then waits for
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce)."""
    return params * (grad_bytes + reduce_bytes) / hw.hbm_bytes_per_s(gpu)


def recompute_time_s(times: BlockTimes, recompute: str, selective_policy: str = "op") -> float:
    """Extra forward work per micro-batch. full: all of it. selective: what the policy does
    not save (trace/activations.py) -- under the "op" policy every op but the GEMMs and the
    attention kernel, i.e. the memory-bound element-wise and norm ops; under Megatron's
    "attention_core" policy the attention core."""
    if recompute == "full":
        return times.fwd_s
    if recompute == "selective":
        return times.memory_fwd_s if selective_policy == "op" else times.attention_fwd_s
    return 0.0


def recompute_flops(times: BlockTimes, profile: BlockProfile, config: ParallelConfig,
                    traced_batch: int, recompute: str, selective_policy: str = "op") -> float:
    """Recomputed FLOPs counted as hardware FLOPs: element-wise recomputation counts none
    (FLOPs here are matmul/attention FLOPs, as FlopCounterMode counts them)."""
    if recompute == "full":
        return times.fwd_flops
    if recompute == "selective" and selective_policy == "attention_core":
        return profile.attention_flops * config.micro_batch / traced_batch / config.cp / config.tp
    return 0.0
