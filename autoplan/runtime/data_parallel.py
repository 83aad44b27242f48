"""Data parallelism: DDP (ZeRO-0), ZeRO-1, ZeRO-2/3 (FSDP2), HSDP, CPU offload.

Gradients are averaged over dp x cp: CP ranks hold the same weights and see different
tokens of the same sequences, so for the optimizer they are data-parallel ranks too.
  zero 0: DistributedDataParallel over the dp_cp group.
  zero 1: DDP + ZeroRedundancyOptimizer (optimizer states sharded over dp_cp).
  zero 2: fully_shard(reshard_after_forward=False) per block and per root: grads and
          optimizer states sharded, parameters kept gathered between forward and backward.
  zero 3: fully_shard(reshard_after_forward=True): parameters sharded too.
  HSDP:   FSDP on the 2-D (dp_replicate, dp_shard_cp) mesh: shard inside, replicate across.
Expert-parallel experts: their own FSDP units at ZeRO-2/3 (on the ranks holding the same
experts), outside DDP below it (runtime/expert_parallel.py).
With TP (DTensor parameters) or PP (several forwards before a backward) DDP cannot wrap the
module; ZeRO-0/1 then all-reduce the (local shards of the) gradients in one flat buffer
after the last micro-batch's backward (`allreduce_grads`). ZeRO-1 steps the local shards of
DTensor (TP/EP) parameters (`Zero1`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from autoplan.runtime.expert_parallel import expert_fsdp_placement
from autoplan.runtime.mesh import ParallelMesh, local_part
from autoplan.runtime.tying import shares_outside, tied_groups


def has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_fsdp(module: nn.Module, blocks: list[str], mesh: ParallelMesh, *, reshard: bool,
               param_dtype: torch.dtype | None, offload_params: bool,
               experts: list[nn.Module] = ()) -> nn.Module:
    """fully_shard each MoE layer's expert-parallel experts on the expert-replica mesh, then
    each block and the (stage) root on the dp mesh."""
    plan = mesh.plan
    if plan.dp_replicate > 1:
        # HSDP: a 2-D (replicate, shard) mesh; dp_shard_cp is a flattened view, so build
        # the 2-D view by unflattening dp_cp.
        dp_mesh = mesh.axis("dp_cp")._unflatten(0, (plan.dp_replicate, plan.dp_shard * plan.cp),
                                                ("dp_replicate_h", "dp_shard_cp_h"))
    else:
        dp_mesh = mesh.axis("dp_shard_cp")
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard,
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    if offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if experts:
        expert_mesh = mesh.expert_dp_mesh()
        shard_ranks = expert_mesh.size(expert_mesh.ndim - 1)
        for unit in experts:
            fully_shard(unit, **{**kwargs, "mesh": expert_mesh},
                        shard_placement_fn=expert_fsdp_placement(unit, shard_ranks))
            # the experts' replicas are dp*cp/ep ranks, but the gradient is the average over
            # all dp*cp ranks' tokens (each replica's already sums its ep group's), as torchtitan
            unit.set_gradient_divide_factor(float(plan.dp * plan.cp))
            # gloo has no PREMUL_SUM: sum, then divide. Not on a one-rank shard mesh, where
            # FSDP issues no reduce-scatter and divides while copying (torch 2.13 foreach_reduce;
            # forced, it would divide again after)
            unit.set_force_sum_reduction_for_comms(mesh.world.device_type == "cpu" and shard_ranks > 1)
    modules = dict(module.named_modules())
    groups = tied_groups(module)
    for path in blocks:
        # FSDP2 keeps a tie inside one unit only: a block sharing a parameter with a module
        # outside it stays in the enclosing (root) unit
        if path in modules and shares_outside(groups, path) is None:
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
        # find_unused_parameters: a parameter the forward never uses (a head's bias a config
        # leaves untied, a pooler a masked LM skips) is marked ready each step instead of failing
        # the second ("Expected to have finished reduction in the prior iteration"), at the cost
        # of one walk of the autograd graph per step. static_graph finds it once, but fails
        # torch 2.13's reducer under no_sync (gradient accumulation): expect_autograd_hooks_.
        return DistributedDataParallel(module, process_group=mesh.group("dp_cp"),
                                       broadcast_buffers=False, find_unused_parameters=True)


def allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup, divisor: int) -> None:
    """Sum (local shards of) gradients over `group`, then divide by `divisor`
    (the group size to average: DDP for DTensor-parallel modules)."""
    grads = [local_part(p.grad) for p in params if p.grad is not None]
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


class Zero1(torch.optim.Optimizer):
    """ZeRO-1: AdamW states sharded by parameter (ZeroRedundancyOptimizer) over the ranks
    that hold the same values of those parameters.

    ZeroRedundancyOptimizer broadcasts plain tensors, so DTensor (TP/EP) parameters are
    handed to it as their local shards: a leaf tensor sharing the shard's storage, whose
    `.grad` is pointed at the local shard of the DTensor gradient just before each step.
    Ranks of one dp x cp group hold the same TP shard, so ZeRO over dp_cp on local shards
    updates exactly what a plain AdamW on the DTensors would. Experts differ across the ep
    axis, so their states are sharded over the ranks holding the same experts
    (`expert_group`, dp_replicate x ep_rest), or kept whole when there is only one such rank.
    Gradient sync and clipping still see the DTensor parameters (loop.py), before `step`.
    It is an Optimizer (without Optimizer's own bookkeeping) so that tools tracking
    optimizers, such as torch's MemTracker in the dry run, accept it and see `state`.
    """

    def __init__(self, groups: list[dict], group: dist.ProcessGroup, expert_ids: set[int],
                 expert_group: dist.ProcessGroup | None, **kwargs) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []  # (parameter, what is stepped)
        self.param_of: dict[int, nn.Parameter] = {}  # id(stepped tensor) -> parameter
        dense: list[dict] = []
        experts: list[dict] = []
        for spec in groups:
            for target, wanted in ((dense, False), (experts, True)):
                params = [self._local(p) for p in spec["params"] if (id(p) in expert_ids) == wanted]
                if params:
                    target.append({**spec, "params": params})
        self.optimizers: list[torch.optim.Optimizer] = []
        for specs, pg in ((dense, group), (experts, expert_group)):
            if not specs:
                continue
            if pg is None or dist.get_world_size(pg) == 1:
                self.optimizers.append(torch.optim.AdamW(specs, **kwargs))
                continue
            # ZeroRedundancyOptimizer takes one group at construction; the rest are added.
            first = {k: v for k, v in specs[0].items() if k != "params"}
            opt = ZeroRedundancyOptimizer(specs[0]["params"], optimizer_class=torch.optim.AdamW,
                                          process_group=pg, **first, **kwargs)
            for spec in specs[1:]:
                opt.add_param_group(spec)
            self.optimizers.append(opt)

    def _local(self, param: nn.Parameter) -> torch.Tensor:
        if isinstance(param, DTensor):
            with torch.no_grad():
                local = param.to_local().detach().requires_grad_(param.requires_grad)
        else:
            local = param
        self.pairs.append((param, local))
        self.param_of[id(local)] = param
        return local

    @property
    def state(self) -> dict:
        """The states this rank holds (its ZeRO partitions), keyed by stepped tensor."""
        return {k: v for inner, _ in self.owned() for k, v in inner.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def owned(self):
        """(local AdamW, this rank's stepped tensors) for each inner optimizer: the states
        this rank holds."""
        for opt in self.optimizers:
            inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local AdamW
            yield inner, [p for group in inner.param_groups for p in group["params"]]

    def step(self) -> None:
        with torch.no_grad():
            for param, local in self.pairs:
                if local is param:
                    continue
                grad = param.grad
                if grad is not None and tuple(grad.placements) != tuple(param.placements):
                    # e.g. a replicated gradient of a sharded embedding: keep this rank's part
                    grad = grad.redistribute(param.device_mesh, param.placements)
                local.grad = None if grad is None else grad.to_local()
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients (set to None whatever `set_to_none` says)."""
        for param, local in self.pairs:
            param.grad = None
            local.grad = None
