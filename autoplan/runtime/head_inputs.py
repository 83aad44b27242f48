"""Tensor parallelism for an attention its model hands a tensor of every head: ALiBi's bias
(BLOOM's `alibi`, MPT's `position_bias`), or a mask with that bias folded in (Falcon's
`attention_mask` of (batch, heads, q, k), which SDPA takes as attn_mask).

The model builds such a tensor once for all H heads, outside the attention. Under TP a rank
runs H/tp heads, rank r the r-th contiguous block of them (every column style lays the heads
out so), and would add all H heads' bias to its share: a shape error at best. This style
("head_inputs:<heads>:<name>+<name>", on the attention module) gathers the first input as
"prepare_input" does and hands the forward the rank's heads of each named input: dim 1 of a
4-dim one, or the leading dim of a 3-dim one read as (n, heads), n-major (BLOOM's (batch *
heads, 1, keys); MPT's (heads, 1, keys)). A named input without the model's head count there
(a mask broadcast over heads, (batch, 1, q, k)) passes as it is.

The trace names the inputs (trace/facts.py, `head_inputs_of`): tensors beside the hidden
states that hold the head count where these layouts do and carry no gradient. A learned
table handed in whole would need its gradient summed over the ranks' heads; its value sliced
here would leave each rank its own heads' share, so one that requires grad is refused.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.errors import UserError

HEAD_INPUTS = "head_inputs"


def head_inputs_style(heads: int, names: list[str]) -> str:
    return f"{HEAD_INPUTS}:{heads}:{'+'.join(names)}"


def head_dim_of(shape: tuple, heads: int, batch: int) -> int | None:
    """Where a per-head input of this shape holds `heads` heads (module docstring): 1 for
    (batch, heads, ...) of 4 dims, 0 for (n * heads, ...) of 3 with n 1 or `batch`; else None."""
    if len(shape) == 4 and shape[1] == heads:
        return 1
    if len(shape) == 3 and shape[0] in (heads, batch * heads):
        return 0
    return None


def rank_heads(value: torch.Tensor, heads: int, batch: int, rank: int, tp: int) -> torch.Tensor:
    """The rank's contiguous block of heads of a per-head input of a `batch`-sequence call,
    or the input as it is where it holds no head count (broadcast over heads; already the
    rank's own)."""
    local = heads // tp
    at = head_dim_of(tuple(value.shape), heads, batch)
    if at == 1:
        return value.narrow(1, rank * local, local)
    if at == 0:
        grouped = value.unflatten(0, (value.shape[0] // heads, heads))
        return grouped.narrow(1, rank * local, local).flatten(0, 1)
    return value


def head_inputs_of(inputs: list[tuple], heads: int, batch: int) -> list[str]:
    """The names of the inputs (recorder.record_module_inputs: name, shape, requires grad; the
    hidden states left out) that hold `heads` heads where a per-head bias does and carry no
    gradient, for a call of `batch` sequences."""
    return [name for name, shape, grad in inputs
            if not grad and head_dim_of(tuple(shape), heads, batch) is not None]


def forward_arg_names(module: nn.Module) -> list[str]:
    """`module.forward`'s argument names in order: what a positional input is called, in the
    trace's record of the inputs and here alike (none where Python cannot read the signature)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def slice_head_inputs(module: nn.Module, heads: int, names: list[str], mesh: DeviceMesh) -> None:
    """Register the pre-hook handing `module` the rank's heads of its inputs `names`."""
    rank, tp = mesh.get_local_rank(), mesh.size()
    params = forward_arg_names(module)
    if not params:  # a positional input could not be found, and would reach forward whole
        raise UserError(f"tensor parallelism cannot hand {type(module).__name__} its heads of "
                        f"{', '.join(names)}: Python cannot read its forward's signature to find "
                        "them among the inputs; use tp=1 for this model.")

    def hook(module, args, kwargs):
        first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        batch, args = int(first.shape[0]), list(args)
        for name in names:
            position = params.index(name) if name in params else -1
            if name in kwargs:
                kwargs[name] = _own_heads(module, name, kwargs[name], heads, batch, rank, tp)
            elif 0 <= position < len(args):
                args[position] = _own_heads(module, name, args[position], heads, batch, rank, tp)
        return tuple(args), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _own_heads(module: nn.Module, name: str, value, heads: int, batch: int, rank: int, tp: int):
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad and head_dim_of(tuple(value.shape), heads, batch) is not None:
        raise UserError(f"tensor parallelism cannot split {type(module).__name__}'s input {name!r} "
                        "by heads: it carries a gradient (a learned per-head table computed "
                        "outside the attention), which each rank would get only its heads' share "
                        "of; use tp=1 for this model.")
    return rank_heads(value, heads, batch, rank, tp)
