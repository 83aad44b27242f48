"""The dry run keeps what torch's CUDA kernels save, where the CPU build decomposes them.

RMSNorm: `torch.rms_norm` on a CUDA tensor whose weight has the input's dtype calls
`aten::_fused_rms_norm` (ATen/native/layer_norm.cpp, rms_norm_symint), whose autograd formula
(tools/autograd/derivatives.yaml, `_fused_rms_norm`: `_fused_rms_norm_backward(grads[0],
input, normalized_shape, result1, weight, ...)`) saves the input, the weight and `result1`,
the fp32 reciprocal RMS of each row. A CPU build has no kernel for `_fused_rms_norm` (its
CompositeImplicitAutograd entry decomposes it: `rms_norm_composite`), so on fake CPU tensors
autograd saves the fp32 upcast input and the fp32 normalised result instead: four times the
16-bit input, where the GPU keeps it once. The dry run measures the GPU's job, so it runs the
norm as the fused kernel keeps it: output computed the composite way, saved tensors those
of `_fused_rms_norm`. A weight of another dtype stays on the composite path, as in ATen.

Matmul dtypes: the fake (meta) kernels of mm/addmm/bmm/baddbmm promote mixed dtypes where
the real CPU and CUDA kernels refuse them ("expected m1 and m2 to have the same dtype"), so
the dry run checks them as the real kernels do: a plan whose runtime would stop at its
first step stops the dry run too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def _reduced_dims(x: torch.Tensor, normalized_shape) -> list[int]:
    return list(range(x.dim() - len(normalized_shape), x.dim()))


class FusedRMSNorm(torch.autograd.Function):
    """`_fused_rms_norm` as autograd sees it on CUDA: saves (input, weight, fp32 rstd)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, composite):
        with torch.no_grad():
            out = composite(x, normalized_shape, weight, eps)
            dims = _reduced_dims(x, normalized_shape)
            eps_value = torch.finfo(torch.float32).eps if eps is None else eps
            rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps_value)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape, ctx.eps, ctx.composite = normalized_shape, eps, composite
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, _rstd = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(ctx.needs_input_grad[0])]
        if weight is not None:
            inputs.append(weight.detach().requires_grad_(ctx.needs_input_grad[2]))
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.composite(inputs[0], ctx.normalized_shape,
                                inputs[1] if weight is not None else None, ctx.eps)
            grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else [])
        grad_x = next(grads) if inputs[0].requires_grad else None
        grad_w = next(grads) if weight is not None and inputs[1].requires_grad else None
        return grad_x, None, grad_w, None, None


def fused_rms_norm(composite):
    """`F.rms_norm` that saves what the CUDA kernel saves, when ATen would call it."""

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
        if not grad or (weight is not None and weight.dtype != x.dtype):
            return composite(x, normalized_shape, weight, eps)
        return FusedRMSNorm.apply(x, tuple(normalized_shape), weight, eps, composite)

    return rms_norm


@contextlib.contextmanager
def cuda_saved_tensors():
    """Run `F.rms_norm` (nn.RMSNorm) keeping the fused CUDA kernel's saved tensors."""
    composite = F.rms_norm
    F.rms_norm = fused_rms_norm(composite)
    try:
        yield
    finally:
        F.rms_norm = composite


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


def refuse_mixed_matmul(func, args) -> None:
    """Raise as ATen's real kernels do when `func` is a matmul of tensors of different dtypes."""
    if func in _MATMULS:
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
        if len(dtypes) > 1:
            names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise RuntimeError(f"{func} of {names} tensors: the real kernel refuses mixed "
                               "dtypes (expected m1 and m2 to have the same dtype)")


class MatmulDtypes(TorchDispatchMode):
    """Refuse a matmul of tensors of different dtypes, as ATen's real kernels do."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        refuse_mixed_matmul(func, args)
        return func(*args, **(kwargs or {}))
