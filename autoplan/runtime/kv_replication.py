"""Tensor parallelism over more ranks than a grouped-query attention has K/V heads.

With tp <= kv_heads each rank holds kv_heads/tp whole K/V heads: the k and v projections
are ordinary column-parallel linears. With tp > kv_heads (Gemma-2B: one K/V head; 8 K/V
heads at tp=16) a K/V head cannot be split, so it is replicated, as Megatron-LM does when
`num_query_groups` < tp (megatron/core/transformer/attention.py: each rank computes
`num_query_groups_per_partition` = 1 group, whose projection rows ranks tp/kv_heads apart
hold as copies, their gradients summed over those ranks) and vLLM does
(QKVParallelLinear: `num_kv_head_replicas = tp_size // total_num_kv_heads`). Rank r's q
heads H/tp belong to K/V head r // (tp / kv_heads), the one it computes.

How the head is held: the k and v weights (and biases) stay whole on every rank, as
DTensors with a Replicate placement, and the forward multiplies only this rank's rows of
them. Their gradient is then nonzero in this rank's rows only and is marked Partial (each
rank holds its share of the sum), which the runtime sums over the tp group as it does for
the replicated norms under sequence parallelism (tensor_parallel.reduce_partial_grads below
ZeRO-2; FSDP2 itself before its reduce-scatter). The sum gives every K/V head the sum of
its copies' gradients, Megatron's all-reduce over a head's replicas. A rank holds all
kv_heads heads, not one: kv_heads - 1 heads more than Megatron (none more for one K/V head),
which the cost model counts (cost/memory.py replicated_kv_params). A parameter sharded over
kv_heads groups and replicated within each would need a 2-D (kv_heads, tp/kv_heads) mesh
under the 1-D tp mesh every other TP parameter and FSDP2 share.

Because the parameter is the model's own whole tensor, checkpoints hold the model's layout
with no conversion: DCP reshards it to a plan whose tp divides the K/V heads and back.

The attention module gets the rank's head counts (H/tp query heads, its K/V heads, and
H/tp query heads per K/V head: transformers' `num_key_value_groups`), as for a fused
projection (fused_projection.localise_head_counts).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from autoplan.errors import UserError
from autoplan.runtime.fused_projection import head_counts_of

KV_STYLE = "colwise_kv"


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """K/V heads one rank computes: its share, or the one head its q heads attend with."""
    return kv_heads // tp if kv_heads % tp == 0 else 1


def kv_split_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why an attention of `heads` q and `kv_heads` K/V heads cannot run over `tp` ranks, or None."""
    if heads % tp:
        return f"tp={tp} does not divide its {heads} query heads"
    if kv_heads % tp and tp % kv_heads:
        return (f"tp={tp} neither divides nor is a multiple of its {kv_heads} key/value heads "
                "(each rank needs whole K/V heads, or one K/V head shared by tp/kv_heads ranks)")
    return None


class KVColwiseParallel(ParallelStyle):
    """A k or v projection: ColwiseParallel when tp divides the K/V heads, else each rank
    computes the K/V head its q heads belong to from a replicated weight (module docstring)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads, kv_heads = head_counts_of(self.style, KV_STYLE)
        tp = device_mesh.size()
        problem = kv_split_problem(heads, kv_heads, tp)
        if problem:
            raise UserError(f"tensor parallelism cannot split the key/value projection: {problem}.")
        if kv_heads % tp == 0:
            return ColwiseParallel()._apply(module, device_mesh)
        if not isinstance(module, nn.Linear) or module.out_features % kv_heads:
            raise UserError(f"the style {self.style} replicates K/V heads of an nn.Linear whose "
                            f"output is {kv_heads} heads, not of {module}")
        size = module.out_features // kv_heads
        head = device_mesh.get_local_rank() // (tp // kv_heads)
        rows = slice(head * size, (head + 1) * size)

        def replicate(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))

        distribute_module(module, device_mesh, replicate)
        module.forward = types.MethodType(lambda mod, x: _own_head(mod, x, device_mesh, rows), module)
        return module


def _own_head(module: nn.Linear, x, mesh: DeviceMesh, rows: slice) -> torch.Tensor:
    """This rank's K/V head of (replicated) input `x`: a plain tensor, as ColwiseParallel's
    use_local_output. The input, weight and bias gradients are this rank's share (Partial)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    local = x.to_local(grad_placements=[Partial()])
    weight = _local(module.weight)[rows]
    bias = _local(module.bias)[rows] if module.bias is not None else None
    return F.linear(local, weight, bias)


def _local(param: torch.Tensor) -> torch.Tensor:
    # FSDP hands its gathered parameter, a Replicate DTensor on the tp mesh like the original
    return param.to_local(grad_placements=[Partial()]) if isinstance(param, DTensor) else param
