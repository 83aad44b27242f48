"""What a MoE module looks like from its structure: its routed experts (a ModuleList of
identical modules, 3-D parameters whose first dim is the expert count, or 2-D parameters of
the experts' matrices stacked along dim 0 by a module that states the count), their count
and top-k. Its cost is never derived from this: routing modules are run on meta under balanced
routing (`routing.py`) and measured like every other op.
"""

from __future__ import annotations

import torch.nn as nn


_EXPERT_COUNT_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts", "n_experts",
                       "moe_num_experts")
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
    # a convolution's kernel is 3-D too (a state-space mixer's depthwise conv1d is
    # channels x 1 x width), as is any stack with a width-1 side: neither is E experts' matrices
    kernels = {id(p) for m in module.modules() if isinstance(m, nn.modules.conv._ConvNd)
               for p in m.parameters(recurse=False)}
    for param in module.parameters():
        if (param.dim() == 3 and id(param) not in ids | kernels and min(param.shape[1:]) > 1
                and (num_experts is None or param.shape[0] == num_experts)):
            matrices.append((int(param.shape[1]), int(param.shape[2])))
            ids.add(id(param))
    for param, experts in flattened_experts(module):
        if id(param) not in ids:
            matrices.append((int(param.shape[0]) // experts, int(param.shape[1])))
            ids.add(id(param))
    return matrices, ids


def flattened_experts(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """(parameter, expert count) of the experts' matrices stacked along dim 0 in one 2-D
    parameter (DBRX's w1/v1/w2: (experts x ffn, hidden)): a parameter held directly (not a
    Linear's weight: a router's or a shared expert's) by a module that states its expert count,
    at least two rows per expert (a router's (experts, hidden) weight has one)."""
    found = []
    for sub in module.modules():
        experts = _attr(sub, _EXPERT_COUNT_ATTRS)
        if experts is None or isinstance(sub, nn.Linear):
            continue
        for param in sub.parameters(recurse=False):
            if param.dim() == 2 and param.shape[0] % experts == 0 and param.shape[0] // experts > 1:
                found.append((param, experts))
    return found


def moe_facts(module: nn.Module) -> tuple[int, int]:
    """(experts, top_k) of a MoE-like module, (0, 0) when it has no routed experts."""
    experts = _attr(module, _EXPERT_COUNT_ATTRS)
    matrices, ids = expert_matrices(module, experts)
    if not matrices:
        return 0, 0
    if experts is None:
        stacked = [int(p.shape[0]) for p in module.parameters() if p.dim() == 3 and id(p) in ids]
        flat = [e for _, e in flattened_experts(module)]
        lists = [len(m) for m in module.modules() if isinstance(m, nn.ModuleList)]
        experts = max(stacked + flat + lists, default=1)
    # the router may hold top-k (HF Qwen2-MoE's gate) rather than the MoE module itself
    top_k = _attr(module, _TOP_K_ATTRS) or next(
        (k for sub in module.children() if (k := _attr(sub, _TOP_K_ATTRS))), None)
    return experts, top_k or 1


def moe_layer_facts(module: nn.Module) -> tuple[int, int]:
    """`moe_facts` of a module that routes tokens to its experts: it, or its router among its
    children (GPT-OSS's MLP, Qwen2-MoE's block), states an expert count or top-k. Stacked 3-D
    weights alone are not experts: RecurrentGemma's recurrence holds (heads, d, d) blocks and
    mixes the sequence; taken for a token-wise MoE it would run on a rank's share of the tokens."""
    stated = _states_routing(module) or any(_states_routing(child) for child in module.children())
    return moe_facts(module) if stated else (0, 0)


def _states_routing(module: nn.Module) -> bool:
    """Whether `module` states an expert count or top-k."""
    return _attr(module, _EXPERT_COUNT_ATTRS + _TOP_K_ATTRS) is not None


def routes_tokens(module: nn.Module) -> bool:
    """A module that states a routing attribute (expert count or top-k) and has experts, and
    is not the model around its MoE layers: Hugging Face's MixtralForCausalLM states the
    expert count (for its load-balancing loss), and its stack of identical decoder layers
    would pass for a list of experts."""
    if not _states_routing(module):
        return False
    return moe_facts(module)[0] > 0 and not _holds_moe_layers(module)


def _holds_moe_layers(module: nn.Module) -> bool:
    """Whether a list (ModuleList, Sequential) inside `module` has an item holding a module
    that routes tokens: a stack of transformer layers with MoE layers, not a list of experts."""
    return any(isinstance(sub, (nn.ModuleList, nn.Sequential)) and
               any(routes_tokens(inner) for item in sub for inner in item.modules())
               for sub in module.modules())
