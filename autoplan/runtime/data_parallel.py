"""Data parallelism: DDP (ZeRO-0), ZeRO-1, ZeRO-2/3 (FSDP2), HSDP, CPU offload.

Gradients are averaged over dp x cp: CP ranks hold the same weights and see different
tokens of the same sequences, so for the optimizer they are data-parallel ranks too.
  zero 0: DistributedDataParallel over the dp_cp group.
  zero 1: DDP + ZeroRedundancyOptimizer (optimizer states sharded over dp_cp).
  zero 2: fully_shard(reshard_after_forward=False) per block and per root: grads and
          optimizer states sharded, parameters kept gathered between forward and backward.
  zero 3: fully_shard(reshard_after_forward=True): parameters sharded too.
  HSDP:   FSDP on the 2-D (dp_replicate, dp_shard_cp) mesh: shard inside, replicate across.
With TP (DTensor parameters) or PP (several forwards before a backward) DDP cannot wrap the
module; ZeRO-0/1 then all-reduce the (local shards of the) gradients in one flat buffer
after the last micro-batch's backward (`allreduce_grads`). ZeRO-1 with TP is refused.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from autoplan.runtime.mesh import ParallelMesh


def has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_fsdp(module: nn.Module, blocks: list[str], mesh: ParallelMesh, *, reshard: bool,
               param_dtype: torch.dtype | None, offload_params: bool,
               ignored: set[nn.Parameter]) -> nn.Module:
    """fully_shard each block, then the (stage) root, on the dp mesh."""
    plan = mesh.plan
    if plan.dp_replicate > 1:
        # HSDP: a 2-D (replicate, shard) mesh; dp_shard_cp is a flattened view, so build
        # the 2-D view by unflattening dp_cp.
        dp_mesh = mesh.axis("dp_cp")._unflatten(0, (plan.dp_replicate, plan.dp_shard * plan.cp),
                                                ("dp_replicate_h", "dp_shard_cp_h"))
    else:
        dp_mesh = mesh.axis("dp_shard_cp")
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None,
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    if offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    modules = dict(module.named_modules())
    for path in blocks:
        if path in modules:
            fully_shard(modules[path], **kwargs)
    # The root's parameters (embedding, head) are used last in backward: no reshard needed.
    kwargs["reshard_after_forward"] = False
    return fully_shard(module, **kwargs)


def apply_ddp(module: nn.Module, mesh: ParallelMesh, ignored: set[nn.Parameter]) -> nn.Module:
    if ignored:
        names = [n for n, p in module.named_parameters() if p in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    # No buffer sync at all: CP ranks hold different RoPE rows (their zig-zag positions),
    # and every other buffer is identical already (initialised once from the seed).
    # torch 2.13 deprecates broadcast_buffers, but its replacement still syncs at init.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(module, process_group=mesh.group("dp_cp"),
                                       broadcast_buffers=False)


def allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup, divisor: int) -> None:
    """Sum (local shards of) gradients over `group`, then divide by `divisor`
    (the group size to average: DDP for DTensor-parallel modules)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in params if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat.div_(divisor)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()
