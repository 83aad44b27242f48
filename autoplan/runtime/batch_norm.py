"""BatchNorm over the data-parallel micro-batch, so that a plan does not change the model.

A BatchNorm layer normalises with the statistics of the batch one forward sees. Split over
DP ranks, each rank would see only its share (PyTorch's default without SyncBatchNorm), and
a 4-rank plan would train a different model from the 1-rank plan of the same global batch.
Here each training-mode BatchNorm takes its mean and variance over the micro-batch of every
DP rank together (the global micro-batch, dp x micro_batch samples), as SyncBatchNorm does;
torch's SyncBatchNorm runs on GPUs only, this runs on gloo too. Two all-reduces per layer
(the sum, then the squared deviations: the variance of the 1-rank layer's two-pass form);
their autograd backward sums every rank's gradient of the statistics.

What remains plan-dependent, and is said once at start-up: the statistics are those of one
global micro-batch, so plans whose dp x micro_batch differ normalise over different groups.
"""

from __future__ import annotations

import types

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def sync_batch_norms(parts: list[nn.Module], group, size: int) -> int:
    """Make every BatchNorm of `parts` normalise over the `group` of `size` DP ranks;
    returns how many layers changed."""
    layers = [m for part in parts for m in batch_norms(part)]
    if size > 1:
        for layer in layers:
            layer.forward = types.MethodType(lambda mod, x: _forward(mod, x, group, size), layer)
    return len(layers) if size > 1 else 0


def _forward(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, group, size: int) -> torch.Tensor:
    if not (module.training or module.running_mean is None):
        return type(module).forward(module, x)
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    count = x.numel() // x.shape[1] * size  # every DP rank's micro-batch has one size
    wide = x.float()  # statistics in fp32 whatever the compute dtype, as torch's CPU BatchNorm
    mean = dist_nn.all_reduce(wide.sum(dims), group=group) / count
    centred = wide - mean.view(shape)
    var = dist_nn.all_reduce(centred.square().sum(dims), group=group) / count
    if module.training and module.track_running_stats:
        _update_running(module, mean.detach(), var.detach() * count / max(count - 1, 1))
    out = centred * torch.rsqrt(var + module.eps).view(shape)
    if module.affine:
        out = out * module.weight.view(shape) + module.bias.view(shape)
    return out.to(x.dtype)


def _update_running(module, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
    with torch.no_grad():
        module.num_batches_tracked.add_(1)
        momentum = module.momentum
        if momentum is None:  # a cumulative average
            momentum = 1.0 / float(module.num_batches_tracked)
        module.running_mean.lerp_(mean.to(module.running_mean.dtype), momentum)
        module.running_var.lerp_(unbiased_var.to(module.running_var.dtype), momentum)

