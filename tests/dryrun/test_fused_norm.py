"""The dry run's RMSNorm keeps what torch's fused CUDA kernel saves (input, weight, fp32
rstd), not the CPU decomposition's fp32 copies, and computes the same values and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoplan.dryrun.kernels import cuda_saved_tensors


def _saved_bytes(fn) -> int:
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return sum(t.numel() * t.element_size() for t in saved)


def test_norm_saves_its_16_bit_input_weight_and_fp32_rstd_only():
    rows, width = 64, 256
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(width, dtype=torch.bfloat16, requires_grad=True)
    composite = _saved_bytes(lambda: F.rms_norm(x, (width,), w, 1e-5))
    with cuda_saved_tensors():
        fused = _saved_bytes(lambda: F.rms_norm(x, (width,), w, 1e-5))
    assert fused == rows * width * 2 + width * 2 + rows * 4
    assert composite > 3 * rows * width * 2  # fp32 upcast input and fp32 normalised result


def test_values_and_gradients_match_the_composite_norm():
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    ref = F.rms_norm(x, (32,), w, 1e-6)
    gx, gw = torch.autograd.grad(ref.square().sum(), (x, w))
    with cuda_saved_tensors():
        out = F.rms_norm(x, (32,), w, 1e-6)
        fx, fw = torch.autograd.grad(out.square().sum(), (x, w))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(fx, gx)
    torch.testing.assert_close(fw, gw)


def test_mismatched_weight_dtype_stays_on_the_composite_path():
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    composite = _saved_bytes(lambda: F.rms_norm(x, (16,), w))
    with cuda_saved_tensors():
        patched = _saved_bytes(lambda: F.rms_norm(x, (16,), w))
    assert patched == composite
