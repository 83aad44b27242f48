"""What the cost model reads from a traced block: its GEMMs, attention core and memory-bound bytes.

A BlockProfile is per copy at the traced (batch, seq) in the traced dtype, like BlockInfo.
It is read op by op from `ModelGraph.graph` when the block's ops are there (so attention
is told apart from GEMMs by op kind), else from the BlockInfo sums alone (graphs built by
hand in tests): then `gemm_shapes` minus the attention core, whose FLOPs are
`attention_flops`.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.trace.graph import BlockInfo, ModelGraph

GEMM_KINDS = ("linear", "matmul", "conv")


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    flops: float
    expert: bool = False  # routed-expert GEMM: sharded by EP, M = tokens per expert


@dataclass(frozen=True)
class BlockProfile:
    gemms: tuple[Gemm, ...]
    attention_flops: float  # as counted (non-causal)
    head_dim: int
    memory_bytes: float  # bytes read + written by memory-bound ops, traced dtype
    routed_tokens_per_token: float  # top_k for MoE blocks, else 0
    kernels: int  # ops that launch work (not views)
    norm_saved_excess: float = 0.0  # bytes unfused norms save beyond their input (traced dtype)
    has_loss: bool = False  # the traced forward computes the loss itself


def _block_ops(graph: ModelGraph, block: BlockInfo) -> list:
    return [graph.graph.nodes[n]["op"] for n in graph.segment_nodes(block)]


def block_profile(graph: ModelGraph, block: BlockInfo) -> BlockProfile:
    """GEMMs, attention and memory traffic of one block copy (traced batch/seq/dtype)."""
    ops = _block_ops(graph, block)
    head_dim = block.hidden // block.heads if block.heads else 128
    if not ops:
        return _profile_from_sums(block, head_dim)
    gemms: list[Gemm] = []
    attention = 0.0
    memory = 0.0
    kernels = 0
    norm_excess = 0.0
    for op in ops:
        if op.kind == "view":
            continue
        kernels += 1
        if op.kind == "norm" and op.input_shapes and op.input_shapes[0]:
            # a fused LayerNorm/RMSNorm kernel (Apex, Transformer Engine) saves its input and
            # per-row statistics only; the decomposed reference saves upcast copies as well
            norm_excess += max(0.0, op.saved_bytes - _numel(op.input_shapes[0]) * graph.dtype_bytes)
        if op.kind == "attention":
            attention += op.flops
            if op.output_shape:
                head_dim = int(op.output_shape[-1])
        elif op.kind in GEMM_KINDS and op.gemm_mnk and op.flops > 0:
            gemms.append(Gemm(*op.gemm_mnk, float(op.flops)))
        elif op.kind == "expert" and op.flops > 0:
            gemms.extend(_expert_gemms(op, block))
            memory += op.bytes_read + op.bytes_written + _permutation_bytes(op, block)
        else:
            memory += op.bytes_read + op.bytes_written
    return BlockProfile(tuple(gemms), attention, head_dim, memory,
                        float(block.top_k) if block.experts else 0.0, kernels, norm_excess,
                        any(op.kind == "loss" for op in ops))


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _permutation_bytes(op, block: BlockInfo) -> float:
    """Token permutation around routed experts (Megatron-Core MoE token dispatcher): permute
    reads each token and writes top_k copies; unpermute reads them and writes the weighted
    sum: 2 x (1 + top_k) x tokens x hidden elements."""
    if not block.experts or not op.output_shape:
        return 0.0
    elements = _numel(op.output_shape)
    itemsize = op.bytes_written / elements if elements else 2
    return 2.0 * (1 + block.top_k) * elements * itemsize


def _expert_gemms(op, block: BlockInfo) -> list[Gemm]:
    """A MoE module costed from its structure: routed-expert GEMMs + router/shared experts.

    Routed FLOPs = tokens x top_k x 2 x (parameters of one expert) (fallback.py); the rest of
    the op's FLOPs (router, shared experts) sees every token once, each GEMM at the shape it
    ran with (`OpInfo.inner_gemms`): a 256-expert router is a (tokens, 256, hidden) GEMM and a
    shared expert three (tokens, ffn, hidden) ones (DeepSeek-V3 tech report arXiv:2412.19437
    §2.1.2), not one GEMM of the summed FLOPs.
    """
    m, n, k = op.gemm_mnk if op.gemm_mnk else (1, block.ffn or block.hidden, block.hidden)
    tokens = 1
    for d in op.output_shape[:-1]:
        tokens *= d
    per_expert = block.expert_parameters / block.experts if block.experts else 0.0
    routed = 2.0 * tokens * block.top_k * per_expert
    routed = min(routed, float(op.flops)) if routed else float(op.flops)
    out = [Gemm(m, n, k, routed, expert=True)]
    rest = float(op.flops) - routed
    for gm, gn, gk, flops in op.inner_gemms:
        if 0 < flops <= rest:
            out.append(Gemm(gm, gn, gk, float(flops)))
            rest -= flops
    if rest > 0:
        out.append(Gemm(tokens, max(block.ffn, 1), block.hidden, rest))
    return out


def _profile_from_sums(block: BlockInfo, head_dim: int) -> BlockProfile:
    gemms = []
    attention = float(block.attention_flops)
    remaining_attention = attention
    for m, n, k, flops in block.gemm_shapes:
        if remaining_attention > 0 and abs(flops - remaining_attention) <= 0.01 * attention + 1:
            remaining_attention -= flops
            continue
        gemms.append(Gemm(m, n, k, float(flops)))
    return BlockProfile(tuple(gemms), attention, head_dim, float(block.memory_traffic_bytes),
                        float(block.top_k) if block.experts else 0.0,
                        len(block.gemm_shapes) * 3)
