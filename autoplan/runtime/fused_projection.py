"""Tensor parallelism for a fused projection whose output is [all q | all k | all v] (Phi-3's
qkv_proj) or [gate | up] (Phi-3's gate_up_proj).

A contiguous row slice of such a weight would give rank 0 the q heads and rank 1 the k and
v heads. Each rank must instead hold its share of every part: [its q heads | its k heads |
its v heads], [its gate rows | its up rows] (Megatron-LM and torchtitan re-order a fused
weight per rank the same way). The forward then splits the rank's output into its parts
exactly as the model's code splits the whole one, once the module reads the rank's head
counts.

How the rank's rows are held: the weight's rows are permuted once, before ColwiseParallel,
into rank-major order (rank 0's rows of every part, then rank 1's, ...), so the parameter
is an ordinary Shard(0) DTensor of the permuted weight. FSDP2 composes with it as with any
TP weight (its 2-D placement becomes (_StridedShard(0, sf=tp), Shard(0))), and norms,
clipping and AdamW are blind to a row order. DTensor's own `_StridedShard(0, split_factor=
parts)` placement on the tp mesh describes [gate_r | up_r] without a permutation, and a
linear over it runs without communication (torch 2.13, measured), but it is not used here:
(1) it splits every part into equal shares in one pattern, so it cannot describe GQA's
q part being larger than k and v; (2) with FSDP2 on top (fully_shard on the dp mesh) the
parameter becomes (_StridedShard(0, sf=2), _StridedShard(0, sf=2)) and its full_tensor()
is not the original weight (measured on a 2x2 gloo mesh), so the checkpoint would be wrong.

GPT-2's c_attn is a transformers Conv1D (transposed_linear.py): its output rows are its
weight's columns, so there the weight's columns are permuted (dim 1, the bias dim 0) and it
becomes an ordinary Shard(1) DTensor; every order below goes with the dim it permutes.

The price of the permutation is that torch's state-dict functions see the permuted weight.
Everything that leaves the runtime (DCP checkpoints, the optimizer states saved with them,
full-state gathers) goes through `in_model_layout`, and what comes back through
`into_runtime_layout`, so a checkpoint holds the model's own layout and loads at any tp.

The model's code reads head counts when it splits and reshapes (transformers 5's
Phi3Attention: `self.config.num_attention_heads * self.head_dim` is where q ends,
`self.num_key_value_heads * self.head_dim` the length of k; GPT2Attention cuts at
`self.split_size`, the width of q). The module gets the rank's counts (and widths)
instead, as torchtitan's parallelize_llama and PyTorch's fsdp_tp_example.py set
`attention.n_heads = n_heads // tp_mesh.size()` (and n_kv_heads): its own head-count
attributes, and a shallow copy of its `config` (shared by the whole model) with the rank's
counts. The model's source is untouched. A count the runtime cannot see (a constant in the
forward, an attribute not named for heads) makes the forward fail, or run other heads than
the rank's, which the capability probe checks at each attention; either way tp is refused
with that reason.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from autoplan.errors import UserError
from autoplan.runtime.transposed_linear import (TransposedColwiseParallel, is_transposed_linear,
                                                output_dim, output_features)
from autoplan.runtime.tying import model_fqn

# the attribute a parallelised fused projection keeps its row order in (rank-major order of
# its output rows: runtime row i is the model's row order[i])
ROW_ORDER = "_autoplan_fused_row_order"


def rank_major_order(rows: int, parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """Row permutation taking a weight laid out [part 0 | part 1 | ...] (each part `parts[i]`
    units of rows) to [rank 0's share of each part | rank 1's | ...]."""
    unit = rows // sum(parts)
    starts = [sum(parts[:i]) * unit for i in range(len(parts))]
    order = [start + r * (count * unit // tp) + j
             for r in range(tp) for start, count in zip(starts, parts)
             for j in range(count * unit // tp)]
    return torch.tensor(order, dtype=torch.long)


def head_counts_of(style: str, *forms: str) -> tuple[int, int] | None:
    """(heads, kv_heads) of a "<form>:<heads>,<kv_heads>" style with one of `forms`
    (colwise_qkv, colwise_kv, colwise_heads); None for other styles."""
    name, _, args = style.partition(":")
    if name not in forms:
        return None
    heads, kv_heads = (int(x) for x in args.split(","))
    return heads, kv_heads


def fused_parts(style: str, rows: int) -> tuple[tuple[int, ...], int]:
    """(parts in their units, (q, k, v) heads or (gate, up) rows; number of q heads (0 for
    gate/up)) of a fused style over `rows` output rows: "colwise_qkv:H,KV" (or
    "colwise_qkv_global:H,H", global_attention.py) or "colwise_gate_up"."""
    counts = head_counts_of(style, "colwise_qkv", "colwise_qkv_global")
    if counts:
        heads, kv_heads = counts
        return (heads, kv_heads, kv_heads), heads
    return (rows // 2, rows // 2), 0


def fused_split_problem(style: str, rows: int, tp: int) -> str | None:
    """Why a fused projection of `rows` output rows cannot be split over `tp` ranks, or None."""
    parts, heads = fused_parts(style, rows)
    if rows % sum(parts):
        return f"its {rows} output rows are not {' + '.join(map(str, parts))} parts of equal units"
    if heads and parts[1] % tp:
        return (f"tp={tp} does not divide its {parts[1]} key/value heads (each rank must hold "
                "whole k and v heads of its own q heads)")
    if any(count % tp for count in parts):  # whole heads, or rows of gate and up
        return f"tp={tp} does not divide each of its parts {parts}"
    return None


class FusedColwiseParallel(ParallelStyle):
    """ColwiseParallel over a fused projection's rows in rank-major order (module docstring)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        transposed = is_transposed_linear(module)
        if not isinstance(module, nn.Linear) and not transposed:
            raise UserError(f"the fused style {self.style} applies to an nn.Linear or a Conv1D, "
                            f"not {type(module).__name__}")
        rows, tp = output_features(module), device_mesh.size()
        problem = fused_split_problem(self.style, rows, tp)
        if problem:
            raise UserError(f"tensor parallelism cannot split the fused projection: {problem}.")
        parts, _ = fused_parts(self.style, rows)
        order = rank_major_order(rows, parts, tp)
        with torch.no_grad():  # every rank holds the same full weight before ColwiseParallel
            for name, param in list(module.named_parameters(recurse=False)):
                moved = param.index_select(output_dim(module, name), order.to(param.device))
                module.register_parameter(name, nn.Parameter(moved, requires_grad=param.requires_grad))
        setattr(module, ROW_ORDER, order)
        colwise = TransposedColwiseParallel() if transposed else ColwiseParallel()
        return colwise._apply(module, device_mesh)


def names_a_head_count(name: str) -> bool:
    """An attribute name that counts heads (`num_heads`, `n_head`), not a head's size
    (`head_dim`, `attention_head_size`)."""
    return "head" in name and not any(w in name for w in ("dim", "size"))


def holds_head_count(module: nn.Module, heads: int) -> bool:
    """`module` has an integer attribute named for heads holding `heads` (OPT's and
    Persimmon's `num_heads`), which its forward may view q, k and v by."""
    return any(type(value) is int and value == heads and names_a_head_count(name)
               for name, value in vars(module).items())


def localise_head_counts(attention: nn.Module, heads: int, kv_heads: int, tp: int,
                         local_kv: int | None = None, q_width: int = 0) -> None:
    """Give `attention` (and a shallow copy of its `config`) the rank's head counts: every
    integer attribute named for heads (not a head's size) that holds the model's q or k/v
    head count becomes the rank's (heads/tp; kv_heads/tp, or `local_kv` where K/V heads are
    replicated, kv_replication.py), one named for groups holding q heads per K/V head
    (transformers' `num_key_value_groups`) the rank's ratio, and one named for a split or
    for all heads holding the q projection's width (`q_width`; GPT-2's `split_size`,
    RemBERT's `all_head_size`, which its forward views the attention's output by) the rank's
    width (module docstring)."""
    local_kv = kv_heads // tp if local_kv is None else local_kv
    local = {heads: heads // tp, kv_heads: local_kv}
    groups = {heads // kv_heads: heads // tp // local_kv}

    def localise(owner) -> None:
        for name, value in list(vars(owner).items()):
            if type(value) is not int:
                continue
            if ("split" in name or "all_head" in name) and q_width and value == q_width:
                setattr(owner, name, q_width // tp)
            elif names_a_head_count(name) and value in local:
                setattr(owner, name, local[value])
            elif any(w in name for w in ("dim", "size")):
                continue
            elif "group" in name and value in groups:
                setattr(owner, name, groups[value])

    localise(attention)
    config = getattr(attention, "config", None)
    if config is not None and not isinstance(config, (nn.Module, torch.Tensor)):
        config = copy.copy(config)
        localise(config)
        attention.config = config


def fused_row_orders(part: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Parameter FQN (as torch's state-dict functions name it: no DDP or checkpoint-wrapper
    prefix) -> (its rank-major row order, the dim it permutes), for each fused projection of
    this part."""
    orders = {}
    for path, module in part.named_modules():
        order = getattr(module, ROW_ORDER, None)
        if order is None:
            continue
        path = model_fqn(path)
        for name, _ in module.named_parameters(recurse=False):
            orders[f"{path}.{name}" if path else name] = (order, output_dim(module, name))
    return orders


def _order_of(key: str, orders: dict) -> tuple[torch.Tensor, int] | None:
    """The row order of a state-dict key: a parameter FQN or a flattened optimizer state
    ("state.<fqn>.exp_avg")."""
    if key in orders:
        return orders[key]
    if key.startswith("state."):
        return orders.get(key[len("state."):].rpartition(".")[0])
    return None


def _reorder(value: torch.Tensor, order: tuple[torch.Tensor, int], to_model: bool) -> torch.Tensor:
    """`value` (runtime layout when `to_model`, else model layout) in the other layout; a
    DTensor keeps its mesh and placements (its full rows are gathered to move them)."""
    if isinstance(value, DTensor):
        moved = _reorder(value.full_tensor(), order, to_model)
        return distribute_tensor(moved, value.device_mesh, value.placements, src_data_rank=None)
    rows, dim = order
    rows = rows.to(value.device)
    if not to_model:
        return value.index_select(dim, rows)
    return torch.empty_like(value).index_copy_(dim, rows, value)


def _is_row_state(value, order: tuple[torch.Tensor, int]) -> bool:
    rows, dim = order
    return isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == rows.numel()


def in_model_layout(state: dict, orders: dict[str, tuple[torch.Tensor, int]]) -> dict:
    """`state` (a model or flattened optimizer state dict) with every fused projection's
    tensors in the model's own row order: new tensors for those, the others as they are."""
    out = dict(state)
    for key, value in state.items():
        order = _order_of(key, orders)
        if order is not None and _is_row_state(value, order):
            out[key] = _reorder(value, order, to_model=True)
    return out


def into_runtime_layout(loaded: dict, state: dict, orders: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Copy the fused projections' tensors of `loaded` (model layout, as `in_model_layout`
    gave them and DCP filled them) into the tensors of `state` (runtime layout), in place."""
    for key, value in loaded.items():
        order = _order_of(key, orders)
        if order is None or value is state[key] or not _is_row_state(value, order):
            continue
        moved = _reorder(value, order, to_model=False)
        target = state[key]
        with torch.no_grad():
            if isinstance(target, DTensor):
                target.to_local().copy_(moved.to_local())
            else:
                target.copy_(moved)
