"""Cost a module that torch.fx cannot trace (data-dependent MoE routing) from its structure.

The module becomes one op of kind "expert" (or "other" without experts). Routed experts
are recognised as a ModuleList of identical modules or as 3-D parameters whose first dim
is the expert count. With T tokens, E experts and top-k routing, each expert matrix of
shape (a, b) costs 2*a*b FLOPs per routed token and T*k tokens are routed in total;
the total does not depend on how balanced the routing is. Everything else (router,
shared experts) sees all T tokens. Output shape = input shape (a residual-stream layer).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.trace.graph import OpInfo
from autoplan.trace.ops import tensor_bytes

_EXPERT_COUNT_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts", "n_experts")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k", "n_activated_experts")


def _attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def expert_matrices(module: nn.Module, num_experts: int | None) -> tuple[list[tuple[int, int]], set[int]]:
    """Per-expert weight matrices (out, in) and the ids of parameters inside routed experts."""
    matrices: list[tuple[int, int]] = []
    ids: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) >= 2:
            first = [tuple(p.shape) for p in sub[0].parameters()]
            if first and all([tuple(p.shape) for p in m.parameters()] == first for m in sub):
                matrices += [s for s in first if len(s) == 2]
                ids |= {id(p) for p in sub.parameters()}
    for param in module.parameters():
        if param.dim() == 3 and id(param) not in ids and (num_experts is None or param.shape[0] == num_experts):
            matrices.append((int(param.shape[1]), int(param.shape[2])))
            ids.add(id(param))
    return matrices, ids


def moe_facts(module: nn.Module) -> tuple[int, int]:
    """(experts, top_k) of a MoE-like module, (0, 0) when it has no routed experts."""
    experts = _attr(module, _EXPERT_COUNT_ATTRS)
    matrices, ids = expert_matrices(module, experts)
    if not matrices:
        return 0, 0
    if experts is None:
        experts = max((len(m) for m in module.modules() if isinstance(m, nn.ModuleList)), default=1)
    return experts, _attr(module, _TOP_K_ATTRS) or 1


def fallback_op(name: str, path: str, module: nn.Module, inputs: list[torch.Tensor],
                seq_len: int) -> tuple[OpInfo, torch.Tensor]:
    x = inputs[0]
    hidden = int(x.shape[-1])
    tokens = x.numel() // hidden
    experts, top_k = moe_facts(module)
    matrices, expert_ids = expert_matrices(module, experts or None)
    routed = tokens * top_k if experts else 0
    # `matrices` are one expert's weights: every routed token passes through one expert.
    expert_flops = sum(2 * a * b for a, b in matrices) * routed if experts else 0
    dense_flops = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and id(sub.weight) not in expert_ids:
            dense_flops += 2 * tokens * sub.in_features * sub.out_features
    elem = x.element_size()
    # saved per routed token: the token (one copy, shared by every matrix that reads the hidden
    # width: gate and up), each matrix's output, and the inputs of the others (down's input)
    saved_per_routed_token = hidden + sum(a + (b if b != hidden else 0) for a, b in matrices)
    saved = tokens * hidden * elem + tokens * max(experts, 1) * 4 + routed * saved_per_routed_token * elem
    params = sum(p.numel() for p in module.parameters())
    out = torch.empty(x.shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
    gemm = None
    if experts and matrices:
        out_dim, in_dim = matrices[0]
        gemm = (max(1, routed // experts), out_dim, in_dim)
    op = OpInfo(
        name=name, module=path, kind="expert" if experts else "other",
        target=type(module).__name__, input_shapes=tuple(tuple(t.shape) for t in inputs),
        output_shape=tuple(x.shape), dtype=str(x.dtype).replace("torch.", ""),
        parameters=params, flops=expert_flops + dense_flops, bytes_read=tensor_bytes(x),
        bytes_written=tensor_bytes(out), saved_bytes=saved, gemm_mnk=gemm, fallback=True,
    )
    return op, out
