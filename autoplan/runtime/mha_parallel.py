"""Tensor parallelism for `nn.MultiheadAttention`: each rank runs its share of the heads.

The module holds q, k and v in one `in_proj_weight` laid out [all q | all k | all v]
(3E x E) and runs projection, attention and `out_proj` inside one call. Its rows are split
as a fused projection's (fused_projection.py): permuted rank-major and sharded Shard(0), so
each rank holds [its q heads | its k heads | its v heads], with the row order recorded
(ROW_ORDER) so that checkpoints keep the model's own layout. `out_proj` is row-parallel:
weight Shard(1), bias replicated and added once after the reduction.

The forward is replaced on the instance (the class and the user's code are untouched) by
one that runs the same arithmetic on the local shards with the rank's head count (the
module's `num_heads` is set to it, as torchtitan sets its attention's local head counts).
`F.multi_head_attention_forward` itself cannot take the shards: it derives the head size
and the [q | k | v] split from the full width of its input. The parameters stay DTensors,
which is what FSDP2 composes with (dp x tp): it shards a TP DTensor over dp and all-gathers
it back to the tp DTensor before forward; the `to_local` here hands the gradient back as a
DTensor of the parameter's placement, which FSDP reduce-scatters over dp; and DCP sees the
whole weight. Plain local tensors would look to FSDP and DCP like whole weights of 1/tp
the size.

Inputs arrive as plain tensors, sequence-sharded under sequence parallelism (or whole):
each distinct one of query, key and value (a decoder's cross-attention reads the encoder's
output) is all-gathered along its sequence dim, its gradient left partial (each rank's
heads contribute) and reduce-scattered back by the gather's backward. The output, a partial
sum over the ranks' heads, is reduce-scattered to the sequence shards (or all-reduced).
Masks (attn_mask, key_padding_mask, is_causal) keep their meaning; a 3-D attn_mask of one
(L, S) slice per (batch, head) gives each rank its heads' slices.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from autoplan.errors import UserError
from autoplan.runtime.fused_projection import ROW_ORDER, rank_major_order
from autoplan.runtime.mesh import local_part

MHA_STYLE = "mha_heads"


def mha_split_problem(module: nn.Module, tp: int) -> str | None:
    """Why this nn.MultiheadAttention's heads cannot be split over `tp` ranks, or None."""
    if not module._qkv_same_embed_dim:
        return ("its keys and values have their own widths (kdim/vdim), held in separate "
                "q/k/v weights the runtime does not split")
    if module.bias_k is not None or module.add_zero_attn:
        return "it adds a learned key/value bias or a zero attention row (add_bias_kv, add_zero_attn)"
    if module.num_heads % tp:
        return f"tp={tp} does not divide its {module.num_heads} heads"
    return None


class MultiheadAttentionParallel(ParallelStyle):
    """Head-parallel nn.MultiheadAttention (module docstring); `sequence_parallel`: its
    inputs come and its output goes sequence-sharded."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.MultiheadAttention):
            raise UserError(f"the TP style {MHA_STYLE} applies to an nn.MultiheadAttention, not "
                            f"{type(module).__name__}")
        tp = device_mesh.size()
        problem = mha_split_problem(module, tp)
        if problem:
            raise UserError(f"tensor parallelism cannot split the nn.MultiheadAttention by heads: {problem}.")
        _shard_parameters(module, device_mesh)
        module.num_heads //= tp
        module.forward = _HeadParallelForward(module, device_mesh, self.sequence_parallel)
        # its fast path (inference) reads the whole weights; off for every module, as it is
        # a global switch: TransformerEncoderLayer's fast path reads its self_attn too
        torch.backends.mha.set_fastpath_enabled(False)
        return module


def _shard_parameters(module: nn.MultiheadAttention, mesh: DeviceMesh) -> None:
    """in_proj rows rank-major, Shard(0); out_proj Shard(1) and its bias replicated."""
    rows, heads, tp = module.in_proj_weight.shape[0], module.num_heads, mesh.size()
    order = rank_major_order(rows, (heads, heads, heads), tp)
    for name in ("in_proj_weight", "in_proj_bias"):
        param = getattr(module, name)
        if param is not None:
            with torch.no_grad():  # every rank holds the same full weight here
                moved = param[order.to(param.device)]
            module.register_parameter(name, nn.Parameter(distribute_tensor(moved, mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
    setattr(module, ROW_ORDER, order)
    out = module.out_proj
    out.register_parameter("weight", nn.Parameter(distribute_tensor(out.weight, mesh, [Shard(1)]),
                                                  requires_grad=out.weight.requires_grad))
    if out.bias is not None:
        out.register_parameter("bias", nn.Parameter(distribute_tensor(out.bias, mesh, [Replicate()]),
                                                    requires_grad=out.bias.requires_grad))


class _HeadParallelForward:
    """nn.MultiheadAttention.forward's signature and results, on the rank's heads. A class
    rather than a closure so that deepcopy (the plan-time probe copies models) copies it."""

    def __init__(self, module: nn.MultiheadAttention, mesh: DeviceMesh, sequence_parallel: bool) -> None:
        self.module, self.mesh, self.sequence_parallel = module, mesh, sequence_parallel

    def __call__(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                 average_attn_weights=True, is_causal=False):
        mha, mesh = self.module, self.mesh
        if query.dim() != 3:
            raise UserError("tensor parallelism runs nn.MultiheadAttention on batched inputs "
                            "(3-D query, key and value) only.")
        seq_dim = 1 if mha.batch_first else 0
        gathered: dict[int, torch.Tensor] = {}  # self-attention gathers its one input once
        for t in (query, key, value):
            if id(t) not in gathered:
                gathered[id(t)] = self._whole(t, seq_dim)
        q, k, v = (gathered[id(t)] for t in (query, key, value))
        if not mha.batch_first:  # (L, B, E) -> (B, L, E), as the attention below reads it
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out, weights = _local_attention(mha, q, k, v, key_padding_mask, need_weights,
                                        attn_mask, is_causal, mesh)
        out = F.linear(out, local_part(mha.out_proj.weight))  # a partial sum over the ranks' heads
        layout = Shard(1) if self.sequence_parallel else Replicate()
        out = DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [layout])
        if mha.out_proj.bias is not None:
            out = out + _as_replicated(mha.out_proj.bias, mesh)
        out = out.to_local()
        if not mha.batch_first:
            out = out.transpose(0, 1)
        if weights is not None:
            weights = _whole_weights(weights, average_attn_weights, mesh)
        return out, weights

    def _whole(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """The whole input on every rank; its gradient, partial over the ranks' heads, is
        summed (and cut to this rank's sequence shard) by the backward."""
        if not isinstance(tensor, DTensor):
            layout = Shard(seq_dim) if self.sequence_parallel else Replicate()
            tensor = DTensor.from_local(tensor, self.mesh, [layout], run_check=False)
        return tensor.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _as_replicated(param: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return param if isinstance(param, DTensor) else DTensor.from_local(param, mesh, [Replicate()],
                                                                       run_check=False)


def _local_attention(mha: nn.MultiheadAttention, q, k, v, key_padding_mask, need_weights: bool,
                     attn_mask, is_causal: bool, mesh: DeviceMesh):
    """(output (B, L, heads*head_dim) of this rank's heads, their attention weights or None),
    for batch-first whole inputs; the arithmetic of F.multi_head_attention_forward."""
    heads, head_dim = mha.num_heads, mha.head_dim
    weight = local_part(mha.in_proj_weight)
    bias = local_part(mha.in_proj_bias) if mha.in_proj_bias is not None else None
    if q is k and k is v:  # one GEMM, as the model's packed projection
        q, k, v = F.linear(q, weight, bias).chunk(3, dim=-1)
    else:
        weights, biases = weight.chunk(3), bias.chunk(3) if bias is not None else (None,) * 3
        q, k, v = (F.linear(x, w, b) for x, w, b in zip((q, k, v), weights, biases))
    batch, length, source = q.shape[0], q.shape[1], k.shape[1]
    q, k, v = (t.unflatten(-1, (heads, head_dim)).transpose(1, 2) for t in (q, k, v))
    mask, is_causal = _merged_mask(attn_mask, key_padding_mask, is_causal, need_weights, q.dtype,
                                   batch, heads, length, source, mesh)
    dropout = mha.dropout if mha.training else 0.0
    if need_weights:
        scores = torch.matmul(q * (1.0 / math.sqrt(head_dim)), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        probs = scores.softmax(dim=-1)
        if dropout > 0.0:
            probs = F.dropout(probs, p=dropout)
        out = torch.matmul(probs, v)
    else:
        probs = None
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    return out.transpose(1, 2).flatten(2), probs


def _merged_mask(attn_mask, key_padding_mask, is_causal: bool, need_weights: bool, dtype,
                 batch: int, heads: int, length: int, source: int, mesh: DeviceMesh):
    """(float mask broadcasting to (B, heads, L, S) or None, is_causal for SDPA), as
    F.multi_head_attention_forward merges them: a causal hint with no padding mask and no
    weights wanted runs SDPA's causal kernel; otherwise the masks are added, each bool mask
    marking with True what may not be attended."""
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to create "
                           "this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        return None, True
    mask = None
    if attn_mask is not None:
        mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                 other_name="", target_type=dtype, check_other=False)
        if mask.dim() == 3:  # (B * all heads, L, S): this rank's heads' slices
            rank = mesh.get_local_rank()
            mask = mask.view(batch, -1, length, source)[:, rank * heads:(rank + 1) * heads]
    if key_padding_mask is not None:
        padding = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                    other_type=None, other_name="", target_type=dtype,
                                    check_other=False).view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return mask, False


def _whole_weights(weights: torch.Tensor, average: bool, mesh: DeviceMesh) -> torch.Tensor:
    """The attention weights of every head, from this rank's (B, heads, L, S): their mean
    over all heads when `average`, as the module returns them."""
    if average:
        share = weights.mean(dim=1) / mesh.size()  # equal head counts per rank
        return DTensor.from_local(share, mesh, [Partial()], run_check=False) \
            .redistribute(mesh, [Replicate()]).to_local()
    return DTensor.from_local(weights, mesh, [Shard(1)], run_check=False) \
        .redistribute(mesh, [Replicate()]).to_local()
