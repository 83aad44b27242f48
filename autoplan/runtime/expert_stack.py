"""Expert parallelism for experts stacked by expert in a layout of the model's own: an
`experts` module whose parameters are all (E, ...), E its `num_experts`, called as
experts(hidden_states, indices, weights) (GPT-OSS: biases, [gate, up] interleaved, a clamped
SwiGLU). Each ep rank runs the module's own forward on the tokens dispatched to it, with its
local experts and their count in place of the whole stack's, so no layout's math is written
out here.

That holds when the forward is what transformers' experts modules are: each token's output the
sum over its k routed experts of weight x expert(token), every expert on its own. A forward
that couples experts or weights (weights renormalised inside it, a capacity by expert count)
would train wrong, so the layout is accepted only once a copy of the module, cut to two
experts with random values, gives the same output run on each expert alone as run whole
(`stacked_layout_problem`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autoplan.models.moe import compute_weight

# the cut copy's size: two experts and a few tokens; its parameters at most this many elements
_CHECK_EXPERTS, _CHECK_TOKENS, _CHECK_MAX_ELEMENTS = 2, 6, 128 * 2**20


def stacked_layout_problem(experts: nn.Module) -> str | None:
    """None when `experts` holds only parameters stacked by expert and its own forward runs
    any subset of its experts (checked on a cut copy), else why not."""
    params = dict(experts.named_parameters(recurse=False))
    stacks = {p.shape[0] if p.ndim else 0 for p in params.values()}
    if not params or next(experts.children(), None) is not None or len(stacks) != 1 \
            or getattr(experts, "num_experts", None) not in stacks:
        return (f"its experts hold parameters {sorted(params)} and modules "
                f"{[n for n, _ in experts.named_children()]}: neither transformers' fused layout "
                "(gate_up_proj, down_proj) nor parameters stacked by expert alone, their first "
                "dimension its num_experts")
    try:
        inputs = list(inspect.signature(experts.forward).parameters)
    except (TypeError, ValueError):
        inputs = []
    if len(inputs) != 3:
        return f"its experts' forward takes {inputs}, not (hidden_states, indices, weights)"
    key = (type(experts), tuple((n, tuple(p.shape[1:])) for n, p in params.items()), _plain_attributes(experts))
    if key not in _CHECKED:
        _CHECKED[key] = _split_run_problem(experts)
    return _CHECKED[key]


_CHECKED: dict[tuple, str | None] = {}  # (class, shapes, attributes) -> the check's answer


def _plain_attributes(module: nn.Module) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                        if not k.startswith("_") and isinstance(v, (bool, int, float, str))))


def _split_run_problem(experts: nn.Module) -> str | None:
    """None when a copy of `experts` (its attributes, two experts of its shapes with random
    values, on the CPU in fp32) gives, run on each expert alone with weight 1 and weighed after,
    the output it gives run whole; else what differs."""
    shapes = [(name, p.shape[1:]) for name, p in experts.named_parameters(recurse=False)]
    if sum(_CHECK_EXPERTS * shape.numel() for _, shape in shapes) > _CHECK_MAX_ELEMENTS:
        return (f"its experts are too large to check on a copy of {_CHECK_EXPERTS} (more than "
                f"{_CHECK_MAX_ELEMENTS:,} elements), and their own forward is run per rank only "
                "once checked")
    # real values on the CPU, also where the caller runs on fake tensors (the plan-time probe,
    # `autoplan check`'s dry run) or under a meta device
    with unset_fake_temporarily(), torch.device("cpu"), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = _copy_holding(experts, {name: torch.randn(_CHECK_EXPERTS, *shape, device="cpu") * 0.1
                                    for name, shape in shapes})
        for width in sorted({size for _, shape in shapes for size in shape}):
            # the hidden size: one of the stack's dimensions, the one its forward runs on
            tokens = torch.randn(_CHECK_TOKENS, width)
            index = torch.stack([torch.randperm(_CHECK_EXPERTS)[:2] for _ in range(_CHECK_TOKENS)])
            weights = torch.rand(_CHECK_TOKENS, 2)
            try:
                with torch.no_grad():
                    whole = type(module).forward(module, tokens, index, weights)
                    split = _run_each_expert_alone(module, tokens, index, weights)
            except Exception:  # not the width it runs on
                continue
            if whole.shape != tokens.shape:
                continue
            if torch.allclose(whole, split, rtol=1e-5, atol=1e-6):
                return None
            return ("its experts' own forward, run on each expert alone, does not give what it "
                    "gives run whole (it couples the experts or their weights), so expert "
                    "parallelism cannot run it rank by rank")
    return "its experts' own forward could not be run on a copy of two experts"


def _run_each_expert_alone(module: nn.Module, tokens: torch.Tensor, index: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:
    """What expert parallelism computes: each expert's tokens through `own_forward_on` a copy
    holding that expert alone, weighed, summed per token."""
    out = torch.zeros_like(tokens)
    for expert in range(module.num_experts):
        rows, slots = torch.nonzero(index == expert, as_tuple=True)
        alone = _copy_holding(module, {n: p[expert:expert + 1] for n, p in module._parameters.items()})
        result = own_forward_on(alone)(tokens[rows], [len(rows)])
        out.index_add_(0, rows, result * weights[rows, slots, None])
    return out


def _copy_holding(experts: nn.Module, stacks: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `experts` (its attributes, its code) holding `stacks` as its
    parameters and their count as its `num_experts`."""
    module = copy.copy(experts)
    module.__dict__ = dict(vars(experts))
    module._parameters = {name: nn.Parameter(stack) for name, stack in stacks.items()}
    module.num_experts = next(iter(stacks.values())).shape[0]
    return module


def own_forward_on(experts: nn.Module):
    """run_local(tokens, counts) of stacked experts: the module's own forward, each received
    token routed to its local expert with weight 1 (the caller weighs the outputs)."""
    own = type(experts).forward

    def run_local(tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = torch.arange(len(counts), device=tokens.device)
        index = torch.repeat_interleave(local, torch.tensor(counts, device=tokens.device))[:, None]
        with _holding_local_experts(experts, tokens, len(counts)):
            return own(experts, tokens, index, torch.ones(index.shape, dtype=tokens.dtype, device=tokens.device))

    return run_local


@contextlib.contextmanager
def _holding_local_experts(experts: nn.Module, tokens: torch.Tensor, count: int):
    """While the module's own forward runs: its parameters are this rank's experts as plain
    tensors (the gradient flows back to the sharded parameters), and its expert count theirs."""
    params, total = dict(experts._parameters), experts.num_experts
    experts._parameters.update({name: compute_weight(p, tokens) for name, p in params.items()})
    experts.num_experts = count
    try:
        yield
    finally:
        experts._parameters.update(params)
        experts.num_experts = total
