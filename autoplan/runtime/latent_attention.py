"""Tensor parallelism of a low-rank (latent) attention, DeepSeek-V2/V3's MLA: heads split
after the down-projections.

  "replicated"     the down-projections and their norms (q_a_proj, q_a_layernorm,
                   kv_a_proj_with_mqa, kv_a_layernorm): every rank computes them whole from
                   the gathered input, as plain modules; the rotary key they make is shared by
                   all heads. A DTensor input (the attention's gathered hidden states) is taken
                   as its local value with a Partial gradient.
  "colwise_local"  the up-projections reading a latent (q_b_proj, kv_b_proj): each rank its
                   heads' rows (weight Shard(0)), computed on the plain latent with the local
                   weight, so the latent's gradient is this rank's share. Its own F.linear:
                   an FP8 plan leaves these two in 16 bits (tensor_parallel.local_input_linears).

Every value between these modules is the same on every rank, and every gradient flowing back
into it is the rank's part of the sum over heads: the parameters of the replicated modules
get their gradients summed over the TP group after backward (as a token-wise MoE layer's,
`apply_tensor_parallel` returns them), and the hidden states' gradient is Partial, reduced
by the attention's input gather. The output projection is the usual row-parallel one.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

REPLICATED, COLWISE_LOCAL = "replicated", "colwise_local"


def _local_input(module, args, kwargs):
    """A DTensor input as its local value whose gradient is this rank's part."""
    local = lambda x: x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x  # noqa: E731
    return tuple(map(local, args)), {k: local(v) for k, v in kwargs.items()}


def replicate_module(module: nn.Module) -> None:
    """The module computes whole on every rank from plain inputs (its gradients are summed
    over the TP group by the caller)."""
    module.register_forward_pre_hook(_local_input, with_kwargs=True)


class ColwiseLocalInput(ParallelStyle):
    """A column-parallel linear on a plain input every rank holds whole: its output is this
    rank's columns, its input's gradient this rank's part of the sum."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        distribute_module(module, device_mesh, shard)

        def forward(mod, x: torch.Tensor) -> torch.Tensor:
            bias = mod.bias.to_local() if mod.bias is not None else None
            return F.linear(x, mod.weight.to_local(), bias)

        module.forward = types.MethodType(forward, module)
        return module
