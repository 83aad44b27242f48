"""Run data-dependent code (MoE routing) on meta/fake tensors: values are unknown there, so
every op whose output *shape* or a Python value depends on tensor values is answered with
the balanced-routing value.

With T tokens, E experts and top-k routing, T*k (token, expert) pairs exist whatever the
router picks, so an expert sees T*k/E tokens on average and the total expert FLOPs and saved
bytes do not depend on the balance. `nonzero` (torch.where(mask), boolean indexing) returns
min(numel, ceil(T*k/E)) rows; `bincount` returns E counts; `.item()` / `.tolist()` give
T*k/E for integers, False for booleans and 0.0 for floats. A per-expert vector (E entries,
or E + 1 with the "no expert" slot of `one_hot(index, E + 1)`) has every expert hit: its
`nonzero` returns E rows, and a position read from them (`for idx in hit: mask[idx]`, DBRX's
and transformers' expert loops) is 0: every expert costs the same under balanced routing, and
T*k/E would index past the experts. Outside a MoE module (no expert count known) a mask counts
as all true, an upper bound, and reading a Python value is an error (there is no honest value
to give a branch).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose output is a view of their first argument: a position nonzero returned stays one
# (reshape is not among them: it reaches a dispatch mode as view or _unsafe_view)
_VIEWS = (aten.select, aten.unbind, aten.slice, aten.squeeze, aten.unsqueeze, aten.view,
          aten._unsafe_view, aten.alias)


@dataclass
class RoutingContext:
    """Where data-dependent ops happened, and the routing numbers of the innermost MoE."""

    tokens: int = 0
    experts: int = 0
    top_k: int = 0
    module: str = ""  # the MoE (or innermost) module running now
    modules: list[str] = field(default_factory=list)  # modules costed by balanced routing
    expert_ids: frozenset = frozenset()  # ids of the running MoE's routed-expert parameters

    def routed_per_expert(self) -> int:
        if not self.experts:
            return 0
        return math.ceil(self.tokens * self.top_k / self.experts)

    def note(self) -> None:
        if self.module not in self.modules:
            self.modules.append(self.module)


def _balanced_rows(ctx: RoutingContext, numel: int, vector: bool = False) -> int:
    if vector and ctx.experts and numel in (ctx.experts, ctx.experts + 1):
        return ctx.experts  # which experts are hit: all of them
    per_expert = ctx.routed_per_expert()
    return min(numel, per_expert) if per_expert else numel


class ValueDependent(RuntimeError):
    """Control flow on a tensor value where no routing assumption applies."""


class BalancedRouting(TorchDispatchMode):
    """Answers data-dependent ops with balanced-routing shapes and values (see module doc)."""

    def __init__(self, ctx: RoutingContext) -> None:
        super().__init__()
        self.ctx = ctx
        # nonzero's outputs and their views, by id (a tensor's == is elementwise)
        self.positions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def _position(self, x) -> bool:
        return isinstance(x, torch.Tensor) and self.positions.get(id(x)) is x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.nonzero.default:
            self.ctx.note()
            x = args[0]
            rows = _balanced_rows(self.ctx, x.numel(), vector=x.dim() == 1)
            out = torch.zeros((rows, x.dim()), dtype=torch.long, device=x.device)
            self.positions[id(out)] = out
            return out
        if func.overloadpacket in _VIEWS and args and self._position(args[0]):
            out = func(*args, **kwargs)
            for view in out if isinstance(out, (list, tuple)) else (out,):
                self.positions[id(view)] = view
            return out
        if func is aten.bincount.default:
            self.ctx.note()
            x = args[0]
            length = max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0) or 0),
                         self.ctx.experts, 1)
            return torch.zeros((length,), dtype=torch.long, device=x.device)
        if func is aten._local_scalar_dense.default:
            if not self.ctx.experts:
                raise ValueDependent("a Python value (.item(), .tolist(), `if tensor`) is read "
                                     "from a tensor outside a routing (MoE) module")
            self.ctx.note()
            x = args[0]
            if x.dtype == torch.bool:
                return False
            if x.is_floating_point():
                return 0.0
            if self._position(x):  # an expert's position: the first, as each costs the same
                return 0
            return self.ctx.routed_per_expert()
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and \
                any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            indices = list(args[1])
            for n, index in enumerate(indices):
                if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                    self.ctx.note()
                    rows = _balanced_rows(self.ctx, index.numel())
                    # a k-dim mask selects along k dims: one long index per masked dim
                    picked = [torch.zeros((rows,), dtype=torch.long, device=index.device)
                              for _ in range(index.dim())]
                    indices[n:n + 1] = picked
                    break
            return func(args[0], indices, *args[2:], **kwargs)
        if func is aten.masked_select.default:
            self.ctx.note()
            x, mask = args[0], args[1]
            rows = _balanced_rows(self.ctx, torch.broadcast_shapes(x.shape, mask.shape).numel())
            return torch.zeros((rows,), dtype=x.dtype, device=x.device)
        return func(*args, **kwargs)
