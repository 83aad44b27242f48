"""MoE routing in the dry run: balanced, as the cost model assumes.

An MoE layer sizes the tokens each expert takes from the router's choices: `torch.bincount`
of the chosen experts, `.tolist()` of the counts to split the tokens, and under expert
parallelism an all-to-all of the counts so that every rank knows what it receives
(autoplan.models.moe.MoE.forward and dispatch_to_owners, and the same dispatch for
transformers' fused experts in autoplan.runtime.expert_parallel). Fake tensors have no
values, so none of that can run on them (DynamicOutputShapeException).

The dry run assumes what the cost model assumes: balanced routing, every expert takes
tokens * top_k / experts of the layer's routed slots (the first `remainder` experts one more
when it does not divide). `bincount` of a fake tensor with `minlength` bins returns those
counts as a real tensor; every op whose tensor arguments are all such real counts runs for
real (views, sums, `empty_like`), so `.tolist()` works. The all-to-all of counts still
reaches the fake process group (so the collectives log records it) and its output is the
input: with every rank routing the same balanced counts, what a rank receives for its
experts is what it sends to each rank's experts when all experts take the same count, which
they do whenever tokens * top_k divides by the expert count. The tokens themselves stay fake
(their sort order has static shapes), and their all-to-alls are logged with their bytes.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

_MARK = "_autoplan_balanced_counts"


def balanced_counts(slots: int, experts: int) -> list[int]:
    """Routed slots per expert when every expert takes the same share (the first experts
    one more when `slots` does not divide by `experts`)."""
    base, extra = divmod(slots, experts)
    return [base + 1] * extra + [base] * (experts - extra)


def _concrete(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) \
        and getattr(value, _MARK, False)


def _mark(value):
    def mark(t: torch.Tensor) -> torch.Tensor:
        setattr(t, _MARK, True)
        return t

    return tree_map_only(torch.Tensor, mark, value)


def _is_all_to_all(func) -> bool:
    return getattr(func, "namespace", "") == "c10d" and "alltoall" in func._schema.name


class BalancedRouting(TorchDispatchMode):
    """Inside a FakeTensorMode: `bincount` of fake expert ids -> real balanced counts, and
    ops on those counts run for real (see the module docstring). `routed`: how many times a
    layer's routing was made balanced."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            return self._bincount(func, *args, **kwargs)
        if not self.routed:  # no counts made yet, so none to run for real: skip the search
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or not all(_concrete(t) for t in tensors):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            out = func(*args, **kwargs)
            if _is_all_to_all(func):  # (output, input, group, ...): receive what is sent
                args[0].copy_(args[1])
        return _mark(out)

    def _bincount(self, func, values, weights=None, minlength=0):
        if not isinstance(values, FakeTensor) or weights is not None or minlength <= 0:
            return func(values, weights, minlength)  # the bins need values: fake mode refuses
        with unset_fake_temporarily():
            counts = torch.tensor(balanced_counts(values.numel(), minlength), dtype=torch.long)
        self.routed += 1
        return _mark(counts)


@contextlib.contextmanager
def balanced_routing():
    """Enter inside the dry run's FakeTensorMode, before modes that should see the routing's
    ops (the collectives log, the memory tracker)."""
    with BalancedRouting() as mode:
        yield mode
