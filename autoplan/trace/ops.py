"""Op kinds and per-op arithmetic for the tracer: what an fx node is and its GEMM shape."""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autoplan.runtime.transposed_linear import is_transposed_linear

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_VIEW_FUNCS = {"view", "reshape", "transpose", "permute", "contiguous", "size", "flatten",
               "unflatten", "squeeze", "unsqueeze", "expand", "chunk", "split", "getitem",
               "getattr", "type_as", "to", "float", "half", "bfloat16", "dim", "t"}
_MATMUL_FUNCS = {"matmul", "bmm", "mm", "baddbmm", "addmm", "einsum"}


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors of a value that may nest them in tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def shape_of(value) -> tuple[int, ...]:
    """A tensor's shape as plain ints (symbolic sizes are concrete here); () for anything else."""
    return tuple(int(d) for d in value.shape) if isinstance(value, torch.Tensor) else ()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _name(target) -> str:
    if target is operator.matmul:
        return "matmul"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def classify(node: fx.Node, target: str, module: nn.Module | None) -> str:
    """Kind of one fx node: linear, matmul, conv, attention, embedding, norm, elementwise, loss, view."""
    if node.op == "call_module":
        sub = module.get_submodule(str(node.target)) if module is not None else None
        if isinstance(sub, nn.Linear) or is_transposed_linear(sub):
            return "linear"
        if isinstance(sub, nn.Embedding):
            return "embedding"
        if isinstance(sub, _NORMS):
            return "norm"
        if isinstance(sub, _CONVS):
            return "conv"
        if isinstance(sub, nn.MultiheadAttention):
            return "attention"
        return "elementwise"
    name = _name(node.target)
    if node.target is F.scaled_dot_product_attention or name == "scaled_dot_product_attention":
        return "attention"
    if node.target is F.linear:
        return "linear"
    if node.target is F.embedding:
        return "embedding"
    if name in ("layer_norm", "rms_norm", "group_norm", "batch_norm"):
        return "norm"
    if name in ("cross_entropy", "nll_loss", "mse_loss"):
        return "loss"
    if name in _MATMUL_FUNCS:
        return "matmul"
    if name in _VIEW_FUNCS:
        return "view"
    return "elementwise"


_FUNCTION_KINDS = {
    "linear": "linear", "embedding": "embedding", "scaled_dot_product_attention": "attention",
    "multi_head_attention_forward": "attention", "layer_norm": "norm", "rms_norm": "norm",
    "group_norm": "norm", "batch_norm": "norm", "conv1d": "conv", "conv2d": "conv",
    "conv3d": "conv", "cross_entropy": "loss", "nll_loss": "loss", "mse_loss": "loss",
    "_grouped_mm": "expert", "grouped_mm": "expert",
}


def function_kind(name: str, module_type: str = "") -> str:
    """Kind of one torch call seen while running a forward (`recorder.py`): by the function,
    then elementwise work inside a normalisation module (HF RMSNorm) counts as norm."""
    if name in _FUNCTION_KINDS:
        return _FUNCTION_KINDS[name]
    if name in _MATMUL_FUNCS:
        return "matmul"
    if name in _VIEW_FUNCS or name in ("select", "slice", "unbind", "expand_as", "view_as"):
        return "view"
    return "norm" if is_norm_type(module_type) else "elementwise"


def is_norm_type(module_type: str) -> bool:
    """A normalisation module by its class name (HF's RMSNorm classes, a hand-written LayerNorm,
    Nemotron's LayerNorm1P, a gated RMSNorm, LayerNorm2d): its elementwise work counts as norm.
    The name must end in the norm: a family named for one (RoBERTa-PreLayerNorm's Embeddings,
    SelfOutput, Layer, LMHead) holds modules, whose own ops are the residual adds."""
    return _NORM_CLASS.search(module_type) is not None


# "...Norm", optionally followed by what the classes add to it (a gate, an activation, per head,
# "1P", "2d")
_NORM_CLASS = re.compile(r"Norm(alization)?(Gated|Activation|PerHead|\d\w*)?$")


def gemm_mnk(kind: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
             flops: int) -> tuple[int, int, int] | None:
    """(M, N, K) of a matmul-like op: M = rows of the output, N = its columns, K from the FLOPs."""
    if kind not in ("linear", "matmul", "attention", "conv", "expert") or not outputs or flops <= 0:
        return None
    out = outputs[0]
    if out.dim() == 0:
        return None
    n = int(out.shape[-1])
    m = max(1, out.numel() // max(n, 1))
    k = max(1, flops // max(2 * m * n, 1))
    return m, n, k


# an nn.MultiheadAttention recorded as one op: its module call, or the functional call inside
MHA_TARGETS = frozenset({"MultiheadAttention", "multi_head_attention_forward"})


def per_head_matmul(a: tuple, b: tuple) -> bool:
    """Whether a matmul of shapes `a` by `b` is one of an attention written out with matmuls,
    batched over (batch, heads): q @ k^T, (batch, heads, seq, head size) by (batch, heads,
    head size, keys), or the scores' product with the values, (..., seq, keys) by (...,
    keys, head size). Its heads are dim 1; q @ k^T, the first, has the head size last."""
    return len(a) == 4 and len(b) == 4 and tuple(a[:2]) == tuple(b[:2]) and a[-1] == b[-2]


def folded_scores(a: tuple, b: tuple, seq: int) -> bool:
    """Whether a bmm of `a` by `b` is the q @ k^T of a self-attention whose heads are folded
    into the batch (BLOOM): (batch * heads, seq, head size) by (batch * heads, head size, seq)."""
    return len(a) == 3 and len(b) == 3 and a[0] == b[0] and a[2] == b[1] and a[1] == b[2] == seq


def bmm_operands(target: str, shapes: tuple) -> tuple:
    """The two batched operands' shapes of a recorded bmm, or of a baddbmm (after its bias)."""
    return tuple(shapes[1:3]) if target == "baddbmm" else tuple(shapes[:2])


def mha_parts(op) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
    """(attention-core FLOPs, (M, N, K, FLOPs) of its projection GEMMs) of one recorded
    nn.MultiheadAttention op (`op.flops` counts both): q, k and v projections (one [q | k | v]
    GEMM for self-attention) and out_proj around QK^T and AV, each 2 * tokens * E * E."""
    shapes = [s for s in op.input_shapes if s] or [op.output_shape]
    width = int(shapes[0][-1])
    tokens = [_numel(s[:-1]) for s in shapes[:3]] + [_numel(shapes[0][:-1])] * (3 - len(shapes[:3]))
    query, key, value = tokens
    if query == key == value:
        gemms = [(query, 3 * width, width, 6 * query * width * width)]
    else:
        gemms = [(t, width, width, 2 * t * width * width) for t in (query, key, value)]
    gemms.append((query, width, width, 2 * query * width * width))
    core = max(0, int(op.flops) - sum(g[-1] for g in gemms))
    return core, tuple(gemms)


def _numel(shape) -> int:
    out = 1
    for dim in shape:
        out *= int(dim)
    return out
