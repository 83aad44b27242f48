"""Mixed precision helpers, gradient-norm clipping for sharded grads, dynamic loss scaling."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.runtime.mesh import local_part

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # the rest of an fp8 plan: its blocks' linears are float8.py's


def compute_dtype(precision: str) -> torch.dtype | None:
    return DTYPES[precision]


def autocast(device_type: str, precision: str, fsdp_casts: bool):
    """Autocast unless FSDP's MixedPrecisionPolicy already casts parameters (fp16 always
    autocasts: FSDP's bf16/fp16 param cast alone keeps fp16 softmax/norm unsafe)."""
    dtype = DTYPES[precision]
    if dtype is None or (fsdp_casts and precision != "fp16"):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None,
              one_rank: tuple[set[int], dist.ProcessGroup] | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients, correct for DTensor (TP/FSDP/EP) and plain grads.

    DTensor grads are grouped by (mesh, placements); each group's norm is reduced by
    DTensor (`full_tensor`), which counts replicated shards once. Plain grads are either
    replicated (DDP) or already whole. Pipeline stages hold disjoint parameters (a shared
    one's copies on later stages are left out of `params` by the caller), so their squared
    norms are summed over the pp group. `one_rank`: (ids, group) of parameters each rank of
    `group` holds different ones of (an nn.ModuleList's experts under expert parallelism,
    plain or FSDP-sharded on their replicas), whose squared norms are summed over `group`.
    """
    ids, group = one_rank or (set(), None)
    total_sq = _squared_norm([p for p in params if id(p) not in ids])
    if ids:
        own_sq = _squared_norm([p for p in params if id(p) in ids]).to(total_sq.device)
        dist.all_reduce(own_sq, group=group)
        total_sq = total_sq + own_sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def _squared_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else ("plain",)
        groups.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32)
    for key, grads in groups.items():
        if key[0] == "plain":
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        else:
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False).full_tensor()
        total_sq = total_sq.to(norm.device) + norm.float() ** 2
    return total_sq


def clip_grads(params: list[torch.nn.Parameter], max_norm: float,
               pp_group: dist.ProcessGroup | None,
               counted: list[torch.nn.Parameter] | None = None,
               one_rank: tuple[set[int], dist.ProcessGroup] | None = None) -> float:
    """Scale every gradient of `params` so their global norm is at most `max_norm`; the norm
    is that of `counted` (default `params`): a parameter pipeline stages share is counted
    once, by its first stage's copy, as Megatron-LM's get_grad_norm_fp32 skips the `shared`
    embedding copy, while every copy is scaled."""
    norm = float(grad_norm(params if counted is None else counted, pp_group, one_rank))
    if max_norm and max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    local_part(p.grad).mul_(coef)
    return norm


class DynamicLossScaler:
    """fp16 loss scaling that agrees across every rank (works for any grad sharding):
    an inf/nan anywhere skips the step everywhere and halves the scale; the scale doubles
    after `growth_interval` clean steps (the torch.amp.GradScaler policy)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def unscale_and_check(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide grads by the scale; True when the step must be skipped."""
        if not self.enabled:
            return False
        bad = torch.zeros(())
        for p in params:
            if p.grad is not None:
                g = local_part(p.grad)
                g.mul_(1.0 / self.scale)
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float().cpu())
        if dist.is_initialized():
            device_bad = bad.to(_any_device(params))
            dist.all_reduce(device_bad, op=dist.ReduceOp.MAX)
            bad = device_bad.cpu()
        if bad.item() > 0:
            self.scale /= 2.0
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]


def _any_device(params) -> torch.device:
    for p in params:
        return local_part(p).device
    return torch.device("cpu")
