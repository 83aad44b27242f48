"""An RMSNorm over a column-parallel projection's whole output (OLMo-2's q_norm and k_norm
normalise all heads of q or of k at once), run on each rank's columns.

Each rank holds its heads' columns, and the norm's statistic is the mean square over all of
them: the ranks' sums of squares are added (one all-reduce of batch x seq fp32 values, a
Partial DTensor made Replicate; in backward the statistic's gradient is all-reduced, since
every rank's columns depend on every rank's sum), and the weight is sharded as the columns
are (Shard(0)). No rank gathers the activation, so the norm's memory and the projection's
stay 1/tp. The cost model leaves these all-reduces out: batch x seq x 4 bytes beside the
layer's batch x seq x hidden x 2 (a 1/(2 hidden) share).

Only a plain RMSNorm may be split this way, y = weight * x * rsqrt(mean(x^2) + eps) in fp32,
cast back to the input's dtype. `is_plain_rms_norm` checks that on the module's own code (a
copy with random weights, on the CPU) before the planner offers the split, so a variant
(Gemma's 1 + weight, a LayerNorm, a bias) is left unsplit instead of trained wrong.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

SHARDED_RMS_NORM = "sharded_rms_norm"
_EPS_NAMES = ("variance_epsilon", "eps")  # transformers' RMSNorms, nn.RMSNorm


def _eps(module: nn.Module) -> float | None:
    """The module's epsilon; None for nn.RMSNorm's default (the input dtype's own eps)."""
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def is_plain_rms_norm(module: nn.Module) -> bool:
    """The module computes weight * x * rsqrt(mean(x^2) + eps) over the last dim, with one
    weight and nothing else (checked by running a CPU copy of it in fp32)."""
    weight = getattr(module, "weight", None)
    has_eps = any(hasattr(module, name) for name in _EPS_NAMES)
    if not has_eps or not isinstance(weight, nn.Parameter) or weight.dim() != 1 \
            or len(list(module.parameters())) != 1 or list(module.buffers()):
        return False
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=gen)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(weight.shape, generator=gen) + 0.5)
        try:
            got = probe(x)
        except Exception:  # noqa: BLE001 - a norm that cannot run alone is no plain norm
            return False
        eps = _eps(module)
        want = probe.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + (torch.finfo(x.dtype).eps if eps is None else eps))
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _sharded_forward(module: nn.Module, x: torch.Tensor, mesh: DeviceMesh, width: int,
                     eps: float | None) -> torch.Tensor:
    local = x.float()
    squares = DTensor.from_local(local.pow(2).sum(-1, keepdim=True), mesh, [Partial()], run_check=False)
    # the mean square feeds this rank's columns only: its gradient is this rank's share
    mean = squares.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]) / width
    normed = local * torch.rsqrt(mean + (torch.finfo(x.dtype).eps if eps is None else eps))
    weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
    return (weight * normed).to(x.dtype)


class ShardedRMSNorm(ParallelStyle):
    """The plain RMSNorm reading a column-parallel linear's local output (a plain tensor of
    this rank's columns): its weight Shard(0), its statistic summed over the ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        width, eps = module.weight.shape[0], _eps(module)

        def shard_weight(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        distribute_module(module, device_mesh, shard_weight)
        module.forward = types.MethodType(lambda mod, x: _sharded_forward(mod, x, device_mesh, width, eps), module)
        return module
