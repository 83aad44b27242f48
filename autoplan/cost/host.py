"""Host (CPU) time on the critical path: the eager runtime issuing kernels one by one.

An eager PyTorch runtime spends ~5-25 us of CPU per op before its kernel is queued (Python,
autograd, ATen dispatch, allocator, cudaLaunchKernel: jiahuanglin.xyz "From PyTorch op to
kernel launch", lesson 18; meta-pytorch/autoparallel models a 7 us launch floor, prior-art.md).
Normally the host runs ahead of the GPU and this is hidden. A dropless MoE layer cannot: its
all-to-all split sizes and per-expert GEMM sizes come from the routing, so every MoE layer
reads the token counts back to the host (`.tolist()` in autoplan/models/moe.py and torchtitan;
Megatron-Core's all-to-all dispatcher; NVIDIA-NeMo/Automodel PR #3931: the dispatch "drains
the compute stream on every MoE layer, forward and activation-checkpoint recompute"), and the
GPU then waits while the host issues the layer's ops (NeMo/Megatron-Bridge docs recommend
CUDA graphs over `moe_router moe_preprocess` for dropless MoE for this reason). So each MoE
layer's host time is exposed, per micro-batch, in forward, backward and any recomputation.
"""

from __future__ import annotations

# Mid-point of the 5-25 us CPU cost per eager op (lesson 18 above); not fitted.
HOST_S_PER_OP = 15e-6
# Ops one MoE layer forward issues outside the experts, counted in autoplan/models/moe.py
# (MoE.forward + _expert_parallel): router linear, softmax, topk, sum, div, cast (6); flatten,
# argsort, floor-div, bincount, gather, zeros, scale-gather, mul, index_add (9); count
# all-to-all, 2 sums, 2 tolist, 2 token all-to-alls, arange, split, cat, gather, empty,
# index_copy (13); plus the load-balancing loss (Switch Transformer aux loss: mean, mean,
# mul, sum: 4) = 32.
MOE_FIXED_OPS_FWD = 32
# Ops per local expert in forward: GroupedExperts.forward issues 3 GEMMs, silu and mul (5)
# plus the split view (Transformer Engine's GroupedLinear issues a GEMM and 2 torch.empty per
# expert and linear, 6 for fc1 + fc2: TransformerEngine issue #1499).
MOE_OPS_PER_LOCAL_EXPERT_FWD = 6
# Backward issues about two kernels per forward op: a GEMM's input and weight gradients
# (Narayanan et al. 2021 §5.1), an elementwise op's gradient plus its accumulation.
BACKWARD_OPS_PER_FORWARD_OP = 2


def block_host_s(kernels: int) -> tuple[float, float]:
    """(forward, backward) host seconds to issue one block's kernels per micro-batch. Without
    a read-back the host runs ahead of the GPU, so this is a floor under the block's GPU time
    (a launch-bound block: small micro-batches, small models), not an addition to it."""
    fwd = kernels * HOST_S_PER_OP
    return fwd, BACKWARD_OPS_PER_FORWARD_OP * fwd


def moe_layer_host_ops_fwd(local_experts: float) -> float:
    """Kernels one dropless MoE layer's forward issues on one rank."""
    return MOE_FIXED_OPS_FWD + MOE_OPS_PER_LOCAL_EXPERT_FWD * local_experts


def moe_host_s(local_experts: float, recompute: str) -> tuple[float, float, float]:
    """(forward, backward, recompute) exposed host seconds of one MoE layer per micro-batch.

    Full recomputation re-runs the forward and with it the token-count read-back; selective
    recomputation recomputes the attention core only.
    """
    fwd = moe_layer_host_ops_fwd(local_experts) * HOST_S_PER_OP
    bwd = BACKWARD_OPS_PER_FORWARD_OP * fwd
    return fwd, bwd, (fwd if recompute == "full" else 0.0)
