"""Tensor parallelism for an attention whose forward reads the full width from its input:
timm's Attention and Swin's WindowAttention (`b, n, c = x.shape`, one fused qkv Linear
viewed as `reshape(b, n, 3, self.num_heads, c // self.num_heads)`, and the heads merged
back with `reshape(b, n, c)`).

Giving the module the rank's head count (as fused_projection.py does for Phi-3) is not
enough here: `c` is read from the input, which every rank holds whole, so the rank's
`reshape(b, n, c)` asks for all heads and `c // num_heads` is no longer the head size. So
the attention runs on DTensors with the model's own shapes instead, and each op keeps the
rank's heads local:

- the fused projection's rows are permuted rank-major as in fused_projection.py, so the
  rank's output is [its q heads | its k heads | its v heads]: that is DTensor's
  `_StridedShard(-1, split_factor=3)` of the model's [all q | all k | all v], and it is
  handed on as such (no communication, only the description);
- `reshape(b, n, 3, heads, head_dim)` of it is Shard on the heads dim (DTensor's view
  rules), and q, k, v after the permute and unbind are Shard(1);
- scaled_dot_product_attention runs per head; the merge `reshape(b, n, c)` is Shard(-1),
  the layout the row-parallel output projection takes.

A per-head table the attention adds to its scores (Swin's relative_position_bias_table,
(positions, heads): a Parameter of the attention module whose last dim is the head count)
is sharded on that dim, so a rank looks up and differentiates its heads' columns (as T5's
head_embedding); the attention's integer buffers (the index into the table) become
replicated DTensors, since DTensor ops do not mix DTensors with plain tensors.

DTensor shards the CUDA SDPA kernels by heads; the CPU flash kernel (the one used on CPU)
has no DTensor rule in torch 2.13 (DTensor all-gathers q, k, v for it), so
`shard_cpu_attention_by_heads` registers one: every head is computed alone, so a rank's
heads need only its own heads of q, k, v and of a per-head mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.runtime.fused_projection import FusedColwiseParallel

GLOBAL_QKV = "colwise_qkv_global"  # the plan's style: "colwise_qkv_global:<heads>,<heads>"
_REGISTERED = []  # the CPU SDPA rules are registered once per process


def shard_cpu_attention_by_heads() -> None:
    """DTensor rules for the CPU flash attention kernel and its backward: q, k, v (and a
    mask with a heads dim) sharded on the heads dim (1) give outputs sharded on it."""
    if _REGISTERED:
        return
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten
    heads = Shard(1)

    def mask_layout(attn_mask):  # a mask of one slice per head is cut like q; others are whole
        if attn_mask is None:
            return None
        return heads if attn_mask.ndim == 4 and attn_mask.shape[1] > 1 else Replicate()

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return [([heads, heads], [heads, heads, heads, None, None, mask_layout(attn_mask), None])]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                 attn_mask=None, scale=None):
        return [([heads] * 3, [heads] * 6 + [None, None, mask_layout(attn_mask), None])]

    _REGISTERED.append(True)


class GlobalFusedColwiseParallel(FusedColwiseParallel):
    """A fused [q | k | v] projection whose output is handed on as the DTensor of the
    model's whole output (module docstring), so that its attention runs with the model's
    shapes."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        shard_cpu_attention_by_heads()
        tp = device_mesh.size()

        def as_whole(mod, args, out):
            shape = (*out.shape[:-1], out.shape[-1] * tp)
            stride = tuple(torch.empty(shape, device="meta").stride())
            return DTensor.from_local(out, device_mesh, [_StridedShard(out.dim() - 1, split_factor=3)],
                                      run_check=False, shape=torch.Size(shape), stride=stride)

        module.register_forward_hook(as_whole)
        return module


def shard_head_tables(attention: nn.Module, heads: int, mesh: DeviceMesh) -> None:
    """The per-head tables of `attention` sharded by heads, its integer buffers replicated
    DTensors (module docstring)."""
    for name, param in list(attention.named_parameters(recurse=False)):
        if param.dim() >= 1 and param.shape[-1] == heads and not isinstance(param, DTensor):
            table = distribute_tensor(param.detach(), mesh, [Shard(param.dim() - 1)])
            attention.register_parameter(name, nn.Parameter(table, requires_grad=param.requires_grad))
    for name, buffer in list(attention.named_buffers(recurse=False)):
        if not buffer.is_floating_point() and not isinstance(buffer, DTensor):
            setattr(attention, name, DTensor.from_local(buffer, mesh, [Replicate()], run_check=False))
