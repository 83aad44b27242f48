"""Expert parallelism: each ep rank keeps num_experts/ep experts of every MoE layer.

The stacked expert weights become DTensors sharded on dim 0 over the ep axis, so DCP saves
them by expert index (reshardable to another EP degree) and grad-norm clipping counts each
expert once. They are kept out of DDP/FSDP: their gradient already sums the contributions
of the whole ep group (the all-to-all backward brings them home), so `sync_expert_grads`
only sums over the ranks that hold the same experts (dp_replicate x ep_rest) and divides
by dp*cp, which gives the same average the DP wrappers give every other parameter.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoplan.errors import UserError
from autoplan.models.moe import MoE


def check_ep_modules(model: nn.Module, ep_modules: list[str], ep: int) -> None:
    modules = dict(model.named_modules())
    if not ep_modules:
        raise UserError(f"the plan asks for ep={ep} but lists no MoE modules (plan.ep_modules); "
                        "expert parallelism needs a model with MoE layers. Use ep=1.")
    for path in ep_modules:
        module = modules.get(path)
        if not isinstance(module, MoE):
            raise UserError(f"plan.ep_modules names {path!r}, which is "
                            f"{type(module).__name__ if module is not None else 'not in the model'}, "
                            "not an autoplan.models.moe.MoE layer; expert parallelism needs MoE "
                            "layers. Use ep=1 for this model.")
        if module.num_experts % ep:
            raise UserError(f"{path} has {module.num_experts} experts, not divisible by ep={ep}; "
                            "choose an ep that divides the expert count.")


def apply_expert_parallel(model: nn.Module, ep_modules: list[str], ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Shard the experts of this (stage) module; returns the expert parameters."""
    axis = ep_mesh["ep"]
    rank, size = axis.get_local_rank(), axis.size()
    modules = dict(model.named_modules())
    params = []
    for path in ep_modules:
        moe = modules.get(path)
        if moe is None:
            continue  # on another pipeline stage
        moe.ep_group = axis.get_group()
        experts = moe.experts
        for name in ("w_gate", "w_up", "w_down"):
            full = getattr(experts, name).detach()
            local = full.chunk(size, dim=0)[rank].clone()
            param = nn.Parameter(DTensor.from_local(local, axis, [Shard(0)], run_check=False))
            setattr(experts, name, param)
            params.append(param)
    return params


def sync_expert_grads(params: list[nn.Parameter], ep_mesh: DeviceMesh, dp_cp: int) -> None:
    """Sum expert grads over the ranks holding the same experts; divide by dp*cp."""
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad.to_local()
        for axis in ("dp_replicate", "ep_rest"):
            if ep_mesh[axis].size() > 1:
                dist.all_reduce(grad, group=ep_mesh[axis].get_group())
        grad.div_(dp_cp)
