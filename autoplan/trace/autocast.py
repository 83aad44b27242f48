"""torch.autocast's casts for the trace's meta tensors.

The job runs a bf16/fp16 plan under torch.autocast (runtime/precision.py), which casts the
inputs of matrix products and attention to 16 bits: a model may keep its rotary tables and
so q and k in fp32 and rely on that cast before SDPA (SDPA itself refuses mixed dtypes).
torch.autocast has no meta-device kernels, so the trace, which runs on meta tensors in bf16,
would fail on such a model where the job trains it. `MetaAutocast` applies the same casts
as a TorchFunctionMode, below the recorder: the recorder sees the model's own call, the
FLOP counter and the saved-tensor hooks see what autocast runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

# autocast's lower-precision list for CUDA, where the jobs train (aten/src/ATen/autocast_mode.cpp,
# `TORCH_LIBRARY_IMPL(aten, Autocast, m)`, "lower_precision_fp"), as the Python calls that
# reach those ops
_LOWER_PRECISION = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.prelu, F.scaled_dot_product_attention,
    torch.matmul, torch.mm, torch.bmm, torch.mv, torch.addmm, torch.addmv, torch.addr, torch.baddbmm,
    torch.addbmm, torch.einsum, torch.chain_matmul, torch.linalg.multi_dot, torch.linalg.vecdot,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm,
    torch.Tensor.bmm, torch.Tensor.mv, torch.Tensor.addmm, torch.Tensor.baddbmm,
}


class MetaAutocast(TorchFunctionMode):
    """Casts the fp32 tensors read by autocast's lower-precision ops to `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LOWER_PRECISION:
            args, kwargs = tree_map(self._cast, (args, kwargs))
        return func(*args, **kwargs)

    def _cast(self, value):
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            return value.to(self.dtype)
        return value
