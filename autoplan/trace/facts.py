"""Parallelism facts read off a traced graph: TP column/row pairs and styles, CP, EP.

A tensor-parallel pair is found by data flow inside a block (Megatron-LM, Shoeybi et al.
2019, sec. 3: q,k,v -> attention -> o; gate,up -> act*mul -> down). Walking back from a
linear through views, elementwise ops and attention (never through norms, other linears
or the block input) reaches the linears that feed it; they are column-parallel, it is
row-parallel, when the split is legal:

- hidden -> X -> hidden: every column reads the width the row writes (the residual width),
  so a row that widens (an FFN up-projection fed through a hand-written norm) is no row;
- the region between them (ops reachable from a column that reach the row) mixes in no
  full-size, hidden-wide tensor from outside (a residual add: a shard would meet a whole);
- linears inside routed experts are no pairs (expert parallelism shards experts);
- nothing computed in the region, nor a column's output, is used outside the region.

A fused projection (one Linear for q,k,v or gate,up) is split when its layout is known:
laid out head by head (GPT-NeoX's query_key_value), a contiguous row slice holds whole heads
("colwise"); cut along its last dim into [all q | all k | all v] of whole heads or into
[gate | up] halves (Phi-3's qkv_proj and gate_up_proj; GPT-2's c_attn, a transformers Conv1D
that the trace takes for a linear), each rank holds its share of every part
("colwise_qkv:<heads>,<kv_heads>", "colwise_gate_up"; runtime/fused_projection.py), as
Megatron/torchtitan re-order a fused weight per rank; viewed as (..., 3, heads, head_dim)
(timm, whose forward reads the full width from its input) the same split with the attention
run on DTensors ("colwise_qkv_global:<heads>,<heads>"; runtime/global_attention.py).

q and k normalised over all heads before the head view (OLMo-2's q_norm and k_norm): the
pair is seen through the norms, which the runtime runs on each rank's columns with their
statistic summed over the ranks ("sharded_rms_norm", runtime/sharded_norm.py), if each is a
plain RMSNorm (checked on the module's own code); any other such norm is left unsplit.

Left unsplit, with the reason recorded (`ModelGraph.tp_unsplit`), and then no block of the
model is tensor-parallel (the sequence-sharded residual stream needs every block sharded):
other fused layouts (a fused k/v beside a separate q: a ColwiseParallel row slice would mix
the parts), an `nn.MultiheadAttention` the runtime cannot split
(mha_parallel.mha_split_problem), and an attention written out with matmuls whose heads are
not read (an einsum; heads folded into the batch other than by one reshape). One written out
as q @ k^T and @ v on (batch, heads, seq, head_dim) stands for an SDPA
(`_written_out_attention`), and so does one whose bmm/baddbmm operands are reshapes of such
tensors to (batch * heads, ...) (BLOOM; `_unfold_heads`).

An attention its model hands a tensor of every head beside the hidden states (ALiBi's bias,
as old-layout Falcon's mask or MPT's position_bias; recorder.record_module_inputs names it)
takes the rank's heads of that input ("head_inputs:<heads>:<input>", runtime/head_inputs.py)
where it would only gather its input ("prepare_input"). An attention module whose own
parameters, read between its columns and its row, are vectors of one value per head
(attention sinks) holds and reads its heads' values ("head_parameters",
runtime/head_parameters.py).

An `nn.MultiheadAttention` (q, k, v packed in `in_proj_weight`, attention and `out_proj`
inside one call) is a column/row pair by itself: the runtime splits it by heads as one
module ("mha_heads:<heads>,<heads>", runtime/mha_parallel.py).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch.fx as fx
import torch.nn as nn

from autoplan.runtime.expert_parallel import TOKEN_WISE_MOE
from autoplan.runtime.fused_projection import holds_head_count
from autoplan.runtime.head_inputs import HEAD_INPUTS, head_inputs_of, head_inputs_style
from autoplan.runtime.head_parameters import HEAD_PARAMETERS
from autoplan.runtime.mha_parallel import MHA_STYLE, mha_split_problem
from autoplan.runtime.latent_attention import COLWISE_LOCAL, REPLICATED
from autoplan.runtime.sharded_norm import SHARDED_RMS_NORM, is_plain_rms_norm
from autoplan.runtime.tying import tied_groups
from autoplan.trace.fallback import moe_layer_facts
from autoplan.trace.graph import ModelGraph, OpInfo
from autoplan.trace.recorder import func_name
from autoplan.trace.ops import MHA_TARGETS, per_head_matmul

_STOP_KINDS = {"linear", "norm", "embedding", "expert", "other", "conv", "moe_router", "loss"}
_SPLITS = {"split", "chunk", "split_with_sizes", "unbind", "tensor_split"}
_MHA_TARGETS = MHA_TARGETS
_FUSED = ("a fused projection (one Linear computes q, k and v, or gate and up) in a layout "
          "autoplan cannot split per rank (only [all q | all k | all v] or [gate | up] read by "
          "slicing its last dimension, or q, k and v head by head): sharding its output columns "
          "would mix the parts on each rank; left unsplit")
_NORM_ACROSS_HEADS = ("normalises q or k over all heads at once (an OLMo2-style q_norm/k_norm over the "
                      "whole projection): a rank holding some heads would need every head's statistics; "
                      "left unsplit")
_SHARED_ACROSS_HEADS = ("its output is broadcast to every head (as MLA's shared rotary key and low-rank "
                        "latent are), so a head split would need it "
                        "computed whole with its gradient summed over the ranks, which autoplan's "
                        "runtime does not do yet; left unsplit")
_PARAMETER_IN_REGION = ("reads a parameter of its own between a column-parallel linear and its row-parallel "
                        "one, where each rank holds only its columns, and the module also holds other "
                        "modules (or is the linear itself), so it cannot be computed whole on every rank "
                        "with its gradient summed; left unsplit")
_UNREAD_HEADS = ("its attention is written out with matmuls whose heads autoplan does not read "
                 "(an einsum, or heads folded into the batch other than by one reshape from (batch, "
                 "heads, seq, head_dim)), so a rank could run other heads "
                 "than its share and train wrong; left unsplit (F.scaled_dot_product_attention, "
                 "or q @ k^T on (batch, heads, seq, head_dim), is split by heads)")


def _mha_pairs(block: nn.Module, ops: list[OpInfo]) -> tuple[list[dict], list[tuple[str, str]]]:
    """(pairs, unsplit reasons) of the nn.MultiheadAttention calls of one block: each is a
    column/row pair by itself, split by heads whole (runtime/mha_parallel.py), or left
    unsplit with the reason the runtime gives."""
    modules = {name: sub for name, sub in block.named_modules()
               if name and isinstance(sub, nn.MultiheadAttention)}
    pairs, unsplit = [], []
    for op in ops:
        if op.kind != "attention" or op.target not in _MHA_TARGETS:
            continue
        mha = next((sub for name, sub in modules.items()
                    if op.module == name or op.module.endswith("." + name)), None)
        problem = mha_split_problem(mha, 1) if mha is not None else "it is not a module of its block"
        if problem:
            unsplit.append((op.module, f"nn.MultiheadAttention: {problem}; left unsplit"))
            continue
        pairs.append({"column": [op.name], "row": op.name, "kind": "attention", "fused": False,
                      "column_style": f"{MHA_STYLE}:{mha.num_heads},{mha.num_heads}", "mha": mha,
                      "kv_styles": {}, "attention": [op], "norm_across_heads": [], "head_norms": []})
    return pairs, unsplit


def _graph_maps(ops: list[OpInfo], edges: list[tuple[str, str]]):
    by_name = {op.name: op for op in ops}
    inputs: dict[str, list[str]] = defaultdict(list)
    users: dict[str, list[str]] = defaultdict(list)
    for src, dst in edges:
        if src in by_name and dst in by_name and src not in inputs[dst]:
            inputs[dst].append(src)
            users[src].append(dst)
    return by_name, inputs, users


def _per_head_norm(op: OpInfo) -> bool:
    """A norm over each head's features alone (Qwen3's q_norm/k_norm on (batch, seq, heads,
    head_dim)): it reads no other head, so a rank holding some heads computes it exactly."""
    shape = op.input_shapes[0] if op.kind == "norm" and op.input_shapes else ()
    return len(shape) >= 4


def _walk_back(row: str, by_name: dict, inputs: dict,
               pass_modules: frozenset = frozenset()) -> tuple[set[str], set[str], set[str]]:
    """(feeding linears, ops passed through, norms stopped at) walking back from `row` to
    the stop kinds; per-head norms, and the norm modules `pass_modules`, are passed through."""
    feeders, through, norms, stack = set(), set(), set(), list(inputs[row])
    while stack:
        name = stack.pop()
        if name in through or name in feeders:
            continue
        op = by_name[name]
        if op.kind == "linear":
            feeders.add(name)
        elif op.kind not in _STOP_KINDS or _per_head_norm(op) or op.module in pass_modules:
            through.add(name)
            stack.extend(inputs[name])
        elif op.kind == "norm":
            norms.add(name)
    return feeders, through, norms


def _broadcast_to_heads(feeder: str, region: set[str], by_name: dict, users: dict) -> bool:
    """The feeder's output reaches attention through an `expand` (one tensor for every head)."""
    stack, seen = list(users[feeder]), set()
    while stack:
        name = stack.pop()
        if name in seen or name not in region:
            continue
        seen.add(name)
        if by_name[name].target == "expand":
            return True
        stack.extend(users[name])
    return False


def _fed_by_linear(name: str, by_name: dict, inputs: dict) -> bool:
    """Norm op `name` reads a linear's output through views, element-wise ops and the norm's
    own other ops (a norm traced op by op) only."""
    module = by_name[name].module
    stack, seen = list(inputs[name]), set()
    while stack:
        src = stack.pop()
        if src in seen:
            continue
        seen.add(src)
        op = by_name[src]
        if op.kind == "linear":
            return True
        if op.kind not in _STOP_KINDS or (op.kind == "norm" and op.module == module):
            stack.extend(inputs[src])
    return False


def _region(feeders: set[str], through: set[str], users: dict) -> set[str]:
    """The ops of `through` reachable from a feeder: what carries sharded values."""
    region, stack = set(), [u for f in feeders for u in users[f]]
    while stack:
        name = stack.pop()
        if name in through and name not in region:
            region.add(name)
            stack.extend(users[name])
    return region


def _query_shapes(region: set[str], by_name: dict) -> list[tuple]:
    """The (batch, heads, seq, head_dim) query shapes of the attention ops in `region`, or of
    the q @ k^T of an attention written out with matmuls."""
    shapes = [tuple(by_name[n].input_shapes[0]) for n in region if by_name[n].kind == "attention"
              and by_name[n].input_shapes and len(by_name[n].input_shapes[0]) == 4]
    if shapes:
        return shapes
    written = _written_out_attention(region, by_name, list(by_name))
    return [tuple(written[0].input_shapes[0])] if written else []


def _unfold_heads(by_name: dict, inputs: dict) -> dict:
    """`by_name` with each batched matmul of an attention whose heads are folded into the
    batch (BLOOM: q, k and v reshaped from (batch, heads, seq, head_dim) to (batch * heads,
    seq, head_dim) for bmm, and baddbmm adding its ALiBi bias) recorded on the unfolded
    shapes, operands only: it then reads as the per-head matmul it is (ops.per_head_matmul).
    A matmul whose operands are not both such reshapes of the same (batch, heads) is kept."""
    unfolded = dict(by_name)
    for name, op in by_name.items():
        if op.kind != "matmul" or op.target not in ("bmm", "baddbmm") or len(inputs[name]) < 2:
            continue
        # the last two inputs: a baddbmm's bias made in the block comes first
        shapes = [_unfolded_shape(src, by_name, inputs) for src in inputs[name][-2:]]
        if all(shapes) and shapes[0][:2] == shapes[1][:2] and shapes[0][-1] == shapes[1][-2]:
            unfolded[name] = dataclasses.replace(op, input_shapes=tuple(shapes))
    return unfolded


def _unfolded_shape(name: str, by_name: dict, inputs: dict) -> tuple | None:
    """The (batch, heads, rows, cols) shape a 3-dim operand was folded from: through at most
    a transpose of its last two dims and one view from 4 dims whose first two multiply to its
    first; None otherwise."""
    op, transposed = by_name[name], False
    if op.kind == "view" and op.target == "transpose" and len(op.output_shape) == 3 and inputs[name]:
        transposed, op = True, by_name[inputs[name][0]]
    source = op.input_shapes[0] if op.kind == "view" and op.input_shapes else ()
    out = op.output_shape
    if len(out) != 3 or len(source) != 4 or source[0] * source[1] != out[0] or tuple(source[2:]) != tuple(out[1:]):
        return None
    return tuple(source[:2]) + ((source[3], source[2]) if transposed else tuple(source[2:]))


def _illegal(row: str, feeders: set[str], region: set[str], by_name: dict, inputs: dict,
             users: dict, sharded_norms: frozenset = frozenset()) -> str | None:
    """Why `feeders` -> `row` is not a column/row pair, or None when it is one; the ops of
    the norm modules `sharded_norms` (over a column's whole output) may normalise across heads."""
    hidden = {by_name[f].input_shapes[0][-1] for f in feeders if by_name[f].input_shapes}
    out = by_name[row].output_shape
    if len(hidden) != 1 or not out or out[-1] not in hidden:
        return "the linears do not map hidden -> X -> hidden"
    inside = region | feeders
    widths = {by_name[f].output_shape[-1] for f in feeders if by_name[f].output_shape}
    head_dims = {shape[-1] for shape in _query_shapes(region, by_name)}
    for name in region:
        op = by_name[name]
        if op.kind == "norm" and op.module not in sharded_norms and not _one_head_each(op, widths, head_dims):
            return f"{name} normalises a tensor that is not one head's features of a column's output"
        # a residual is hidden wide; head-layout tensors (RoPE tables beside one KV head) are not
        if op.kind == "elementwise" and op.output_shape and op.output_shape[-1] in hidden:
            full = sum(1 for shape in op.input_shapes if shape == op.output_shape)
            tensors = sum(1 for src in inputs[name] if src in inside and by_name[src].output_shape)
            if full > tensors:
                return f"{name} mixes in a full-size tensor from outside (a residual)"
    for name in inside:
        if not by_name[name].output_shape:
            continue  # a size or shape read: a plain int, not a sharded value
        # a read nothing uses (a KV cache keeping its last window: transformers' sliding-window
        # layer slices the concatenated keys and values and stores them) carries no value on
        escaped = [u for u in users[name] if u not in region and u != row and users[u]]
        if escaped:
            return f"{name} is also used by {escaped[0]}"
    return None


def _one_head_each(op: OpInfo, widths: set[int], head_dims: set[int]) -> bool:
    """A per-head norm op (or a step of one traced op by op: its statistics end in 1) on a
    column's output viewed as (..., heads, head_dim), or on the attention's own layout
    (batch, heads, seq, head_dim) (Gemma-3 normalises q and k after the transpose): every row
    it reduces is one head's."""
    shape = op.input_shapes[0]
    heads, features = shape[-2], shape[-1]
    if len(shape) == 4 and features in head_dims:
        return True
    return heads > 1 and any(w % heads == 0 and features in (1, w // heads) for w in widths)


def _head_major(feeder: str, region: set[str], by_name: dict, inputs: dict) -> bool:
    """A fused q/k/v column laid out head by head (GPT-NeoX's query_key_value) or group by
    group (Falcon's new decoder architecture): _head_groups."""
    return _head_groups(feeder, region, by_name, inputs) > 0


def _head_groups(feeder: str, region: set[str], by_name: dict, inputs: dict) -> int:
    """How many K/V heads a fused q/k/v column laid out head by head or group by group holds,
    else 0. Its output is viewed (directly, or through views of views) as (..., heads,
    3 * head_dim) or (..., heads, 3, head_dim) with the attention's own head count, or as
    (..., groups, q heads per group + 2, head_dim), each K/V head's queries, then its key and
    value (Falcon). A contiguous row slice of the weight then holds whole heads or groups,
    each with its q, k and v, and the forward's -1 head count (or its own, which the runtime
    localises: "colwise_heads") reads the rank's. (timm's (..., 3, heads, head_dim) and
    GPT-2's split by width put q, k and v outermost: a row slice mixes them.)"""
    width = by_name[feeder].output_shape[-1] if by_name[feeder].output_shape else 0
    heads = {int(shape[1]) for shape in _query_shapes(region, by_name)}
    if len(heads) != 1:
        return 0
    found = set()
    for view in (by_name[n] for n in region if feeder in inputs.get(n, ()) and by_name[n].kind == "view"):
        groups = _groups_of_view(view.output_shape, heads, width, grouped=False)
        shape = view.output_shape or ()
        if not groups and len(shape) >= 4 and shape[-2] * shape[-1] == width:
            # (..., all q and k/v heads, head_dim), regrouped by later views (Falcon)
            chain = view
            for _ in range(3):  # a view read by one other view only: the same values, regrouped
                readers = [by_name[n] for n in region if chain.name in inputs.get(n, ())]
                if len(readers) != 1 or readers[0].kind != "view":
                    break
                chain = readers[0]
                groups = groups or _groups_of_view(chain.output_shape, heads, width, grouped=True)
        found.add(groups)
    return found.pop() if len(found) == 1 else 0


def _groups_of_view(shape: tuple, heads: set[int], width: int, grouped: bool) -> int:
    """K/V heads of a whole-heads view (_head_groups) of a `width`-wide column, else 0; with
    `grouped`, also (..., groups, q per group + 2, head_dim)."""
    if len(shape) >= 5 and shape[-2] == 3 and shape[-3] in heads and shape[-3] * 3 * shape[-1] == width:
        return int(shape[-3])  # (..., heads, 3, head_dim)
    if grouped and len(shape) >= 5 and shape[-2] > 3 and shape[-3] * (shape[-2] - 2) in heads \
            and shape[-3] * shape[-2] * shape[-1] == width:
        return int(shape[-3])  # (..., groups, q per group + 2, head_dim)
    if len(shape) >= 4 and shape[-2] in heads and shape[-2] * shape[-1] == width:
        return int(shape[-2])  # (..., heads, 3 * head_dim)
    return 0


def _fused(kind: str, feeders: set[str], region: set[str], by_name: dict, inputs: dict) -> bool:
    """One Linear computing several parts: a lone column feeding attention holds q, k and v
    (GPT-2 c_attn, timm qkv; not when laid out head by head, _head_major); an MLP column
    whose output is split holds gate and up."""
    widths = {by_name[f].output_shape[-1] for f in feeders if by_name[f].output_shape}
    # one head's features split in halves (RoPE's rotate-half) are no parts, also where a
    # column is one head wide (the k and v of a single K/V head)
    head_dims = {shape[-1] for shape in _query_shapes(region, by_name)}
    split_whole = any(by_name[n].target in _SPLITS and by_name[n].input_shapes
                      and by_name[n].input_shapes[0] and by_name[n].input_shapes[0][-1] in widths - head_dims
                      for n in region)  # fused k,v beside a separate q
    if kind == "attention":
        lone = len(feeders) == 1 and not _head_major(next(iter(feeders)), region, by_name, inputs)
        return lone or split_whole
    return split_whole or any(by_name[n].target in _SPLITS or (by_name[n].target == "getitem"
               and by_name[n].input_shapes and by_name[n].output_shape
               and by_name[n].output_shape[-1] != by_name[n].input_shapes[0][-1])
               or _splits_features(by_name[n], widths) for n in region)


def _splits_features(op: OpInfo, widths: set[int]) -> bool:
    """A view of a column's output that cuts its features into parts (Moshi's gate/up MLP
    views (batch, seq, 2 * ffn) as (batch, seq, 2, ffn) and reads [..., 0, :] and [..., 1, :]):
    on a rank holding some columns the view would cut its own columns instead."""
    return (op.target in ("view", "reshape") and bool(op.input_shapes) and bool(op.input_shapes[0])
            and op.input_shapes[0][-1] in widths and bool(op.output_shape)
            and len(op.output_shape) > len(op.input_shapes[0]) and op.output_shape[-1] < op.input_shapes[0][-1])


def _last_dim_parts(feeder: str, region: set[str], by_name: dict, inputs: dict,
                    order: list[str]) -> list[int]:
    """Widths of the parts a column's output is cut into along its last dim by the ops
    reading it (slices `out[..., a:b]`, or one chunk/split into equal parts), in graph
    order; [] when something else reads it (a reshape to (..., 3, heads, head_dim))."""
    def readers(name: str) -> list[str]:
        return sorted((n for n in region if name in inputs.get(n, ())), key=order.index)

    out, cut = by_name[feeder].output_shape, readers(feeder)
    # a view regrouping only the leading dims (GPT-2's Conv1D runs addmm on (tokens, in) and
    # views the result back to (batch, seq, out)) leaves the parts where they were
    while len(cut) == 1 and by_name[cut[0]].target in ("view", "reshape") and out \
            and by_name[cut[0]].output_shape[-1:] == out[-1:] and _numel(by_name[cut[0]].output_shape) == _numel(out):
        out, cut = by_name[cut[0]].output_shape, readers(cut[0])
    if len(cut) == 1 and out and _splits_features(by_name[cut[0]], {out[-1]}):
        return _viewed_parts(by_name[cut[0]], [by_name[n] for n in readers(cut[0])], out)
    cuts = [by_name[n] for n in cut]
    if not out or not cuts or any(tuple(op.output_shape[:-1]) != tuple(out[:-1]) for op in cuts
                                  if op.output_shape):
        return []
    if len(cuts) == 1 and cuts[0].target in _SPLITS and cuts[0].output_shape \
            and out[-1] % cuts[0].output_shape[-1] == 0:
        return [cuts[0].output_shape[-1]] * (out[-1] // cuts[0].output_shape[-1])
    if all(op.target == "getitem" and op.output_shape for op in cuts):
        widths = [op.output_shape[-1] for op in cuts]
        return widths if sum(widths) == out[-1] else []
    return []


def _viewed_parts(view: OpInfo, picks: list[OpInfo], out) -> list[int]:
    """The parts of a column's output `out` that one view to (..., parts, width) cuts it into,
    when every reader picks one part whole ([..., i, :]); [] for another view."""
    shape = tuple(view.output_shape)
    if len(shape) != len(out) + 1 or shape[:-2] != tuple(out[:-1]) or shape[-2] * shape[-1] != out[-1]:
        return []
    part = tuple(out[:-1]) + (shape[-1],)
    if not picks or any(p.target != "getitem" or tuple(p.output_shape or ()) != part for p in picks):
        return []
    return [shape[-1]] * shape[-2]


def _numel(shape) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def _three_by_heads(feeder: str, region: set[str], by_name: dict, inputs: dict,
                    heads: int, head_dim: int) -> bool:
    """timm's layout: the column's output is read by one view to (..., 3, heads, head_dim)
    with the attention's heads, so it is [all q | all k | all v] of whole heads."""
    out = by_name[feeder].output_shape
    readers = [by_name[n] for n in region if feeder in inputs.get(n, ())]
    if not out or len(readers) != 1 or readers[0].kind != "view" or not readers[0].output_shape:
        return False
    shape = tuple(readers[0].output_shape)
    return len(shape) >= 4 and shape[-3:] == (3, heads, head_dim) and tuple(shape[:-3]) == tuple(out[:-1])


def _fused_style(kind: str, feeders: set[str], region: set[str], by_name: dict, inputs: dict,
                 order: list[str]) -> str | None:
    """The runtime's style for a fused column it splits per rank (runtime/fused_projection.py):
    "colwise_qkv:<heads>,<kv_heads>" for one projection cut into [all q | all k | all v]
    whose q is the attention's heads and k, v whole heads each (Phi-3's qkv_proj, GQA
    too); "colwise_gate_up" for an MLP projection cut into two equal halves (Phi-3's
    gate_up_proj); "colwise_qkv_global:<heads>,<heads>" for one viewed as (..., 3, heads,
    head_dim) (timm: its attention runs on DTensors, runtime/global_attention.py). None
    for other layouts (a fused k/v beside a separate q), which stay unsplit."""
    if len(feeders) != 1:
        return None
    feeder = next(iter(feeders))
    parts = _last_dim_parts(feeder, region, by_name, inputs, order)
    if kind == "mlp":
        return "colwise_gate_up" if len(parts) == 2 and parts[0] == parts[1] else None
    sdpa = [by_name[n] for n in region if by_name[n].kind == "attention" and by_name[n].input_shapes
            and len(by_name[n].input_shapes[0]) == 4] or _written_out_attention(region, by_name, order)[:1]
    if len(sdpa) != 1:
        return None
    heads, head_dim = int(sdpa[0].input_shapes[0][1]), int(sdpa[0].input_shapes[0][-1])
    if _three_by_heads(feeder, region, by_name, inputs, heads, head_dim):
        return f"colwise_qkv_global:{heads},{heads}"
    if len(parts) != 3:
        return None
    q, k, v = parts
    if q != heads * head_dim or k != v or k % head_dim or heads % (k // head_dim):
        return None
    return f"colwise_qkv:{heads},{k // head_dim}"


def _kv_styles(columns: list[str], attention: list[OpInfo], by_name: dict) -> dict[str, str]:
    """column -> "colwise_kv:<heads>,<kv_heads>" for the separate k and v projections of a
    grouped-query attention (fewer K/V heads than q heads): the runtime shards their heads,
    or gives each rank the K/V head of its q heads when tp exceeds them
    (runtime/kv_replication.py). {} for other attention."""
    sdpa = [a for a in attention if a.input_shapes and len(a.input_shapes[0]) == 4]
    if len(sdpa) != 1 or len(columns) != 3:
        return {}
    heads, head_dim = int(sdpa[0].input_shapes[0][1]), int(sdpa[0].input_shapes[0][-1])
    widths = {c: by_name[c].output_shape[-1] for c in columns if by_name[c].output_shape}
    kv = [c for c, w in widths.items() if w < heads * head_dim]
    if len(widths) != 3 or len(kv) != 2 or len({widths[c] for c in kv}) != 1 \
            or widths[kv[0]] % head_dim or heads % (widths[kv[0]] // head_dim):
        return {}
    return {c: f"colwise_kv:{heads},{widths[c] // head_dim}" for c in kv}


def _written_out_attention(region: set[str], by_name: dict, order: list[str]) -> list[OpInfo]:
    """The matmuls of an attention written out (q @ k^T, softmax, @ v), q @ k^T first, which
    then stand for its SDPA: the first's query shape (batch, heads, seq, head size) gives the
    heads, so the runtime can hand the module the rank's head count and the probe can check
    each rank runs its share of them. [] when the region's matmuls are not per head."""
    matmuls = [by_name[n] for n in sorted(region, key=order.index) if by_name[n].kind == "matmul"
               and len(by_name[n].input_shapes) >= 2]
    if not matmuls or not all(per_head_matmul(*op.input_shapes[:2]) for op in matmuls):
        return []
    return matmuls


def _batched_matmuls(region: set[str], by_name: dict) -> bool:
    """Whether `region` multiplies two tensors of 3 dims or more (an attention's per-head
    matmuls), not an input by a weight."""
    return any(by_name[n].kind == "matmul" and len(by_name[n].input_shapes) >= 2
               and all(len(shape) >= 3 for shape in by_name[n].input_shapes[:2]) for n in region)


def linear_pairs(ops: list[OpInfo], edges: list[tuple[str, str]]) -> list[dict]:
    """Column/row linear pairs of one block's ops (full op names), each marked "fused" when
    a column computes several parts (a fused qkv / kv / gate_up projection)."""
    by_name, inputs, users = _graph_maps(ops, edges)
    by_name = _unfold_heads(by_name, inputs)
    order = list(by_name)
    pairs = []
    for op in ops:
        if op.kind != "linear":
            continue
        feeders, through, norms = _walk_back(op.name, by_name, inputs)
        region = _region(feeders, through, users)
        kinds = {by_name[n].kind for n in region}
        if not feeders or not kinds & {"attention", "elementwise", "matmul"}:
            continue
        kind = "attention" if kinds & {"attention", "matmul"} else "mlp"
        attention = [by_name[n] for n in sorted(region, key=order.index)
                     if by_name[n].kind == "attention"] or _written_out_attention(region, by_name, order)
        if not attention and _batched_matmuls(region, by_name):
            pairs.append({"column": sorted(feeders, key=order.index), "row": op.name, "kind": kind,
                          "fused": False, "attention": [], "norm_across_heads": [], "head_norms": [],
                          "unread_heads": True})
            continue
        across = sorted(n for n in norms if _fed_by_linear(n, by_name, inputs))
        if kind == "attention" and across:  # q/k normalised over all heads
            pairs.append(_across_heads_pair(op.name, across, by_name, inputs, users, order, attention)
                         or {"column": sorted(feeders, key=order.index), "row": op.name, "kind": kind,
                             "fused": False, "attention": attention, "norm_across_heads": across,
                             "head_norms": []})
            continue
        # MLA: the columns read low-rank latents of different widths, and a projection of the
        # hidden states reaches every head through an expand (a GQA model's K/V repeat is an
        # expand too, but its columns all read the hidden states)
        latents = {by_name[f].input_shapes[0][-1] for f in feeders if by_name[f].input_shapes}
        shared = sorted(f for f in feeders if len(latents) > 1 and _broadcast_to_heads(f, region, by_name, users))
        if kind == "attention" and shared:
            pairs.append(_latent_pair(op.name, feeders, shared, by_name, inputs, order, attention)
                         or {"column": sorted(feeders, key=order.index), "row": op.name, "kind": kind,
                             "fused": False, "attention": attention, "norm_across_heads": [],
                             "shared_across_heads": shared, "head_norms": []})
            continue
        if _illegal(op.name, feeders, region, by_name, inputs, users):
            continue
        fused = _fused(kind, feeders, region, by_name, inputs)
        style = _fused_style(kind, feeders, region, by_name, inputs, order) if fused else None
        columns = sorted(feeders, key=order.index)
        groups = _head_groups(columns[0], region, by_name, inputs) if kind == "attention" and len(columns) == 1 else 0
        pairs.append({"column": columns, "row": op.name, "kind": kind, "head_groups": groups,
                      "fused": fused and style is None, "column_style": style or "colwise",
                      "kv_styles": {} if fused else _kv_styles(columns, attention, by_name),
                      "attention": attention, "norm_across_heads": [],
                      "head_norms": sorted(n for n in region if by_name[n].kind == "norm"),
                      "parameter_owners": _parameter_owners(region, through, by_name, inputs)})
    return pairs


def _parameter_owners(region: set[str], through: set[str], by_name: dict, inputs: dict) -> list[str]:
    """Modules owning the parameters whose values (not only their shapes: an fx size read
    yields no tensor) reach the ops between a column and its row, norms aside."""
    seen, stack = set(), list(region)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(src for src in inputs[name] if src in through and by_name[src].dtype)
    return sorted({path.rpartition(".")[0] for name in seen if by_name[name].kind != "norm"
                   for path in by_name[name].parameter_reads})


def _across_heads_pair(row: str, across: list[str], by_name: dict, inputs: dict, users: dict,
                       order: list[str], attention: list[OpInfo]) -> dict | None:
    """The attention pair seen through its norms over all heads (OLMo-2's q_norm and k_norm
    on q and k before the head view), whose statistic the runtime can sum over the ranks
    (runtime/sharded_norm.py); None when the columns behind them do not form a plain pair
    (block_tp_facts then checks each norm is a plain RMSNorm)."""
    modules = frozenset(by_name[n].module for n in across)
    feeders, through, norms = _walk_back(row, by_name, inputs, modules)
    region = _region(feeders, through, users)
    if norms & set(region) or _illegal(row, feeders, region, by_name, inputs, users, modules) \
            or _fused("attention", feeders, region, by_name, inputs):
        return None
    return {"column": sorted(feeders, key=order.index), "row": row, "kind": "attention", "fused": False,
            "column_style": "colwise", "kv_styles": {}, "attention": attention, "norm_across_heads": [],
            "sharded_norms": sorted(modules), "across": across,
            "head_norms": sorted(n for n in region if by_name[n].kind == "norm" and by_name[n].module not in modules)}


def _latent_pair(row: str, feeders: set[str], shared: list[str], by_name: dict, inputs: dict,
                 order: list[str], attention: list[OpInfo]) -> dict | None:
    """A low-rank attention (MLA) split by heads after its down-projections: the columns are
    the up-projections (and a q projection of the hidden states), the linears and norms
    between the attention's input and them, with the projection whose output every head
    shares, are computed whole on every rank (runtime/latent_attention.py); None when that
    set is not found inside the attention module."""
    columns = sorted((f for f in feeders if f not in shared), key=order.index)
    scope = _common_parent([by_name[n].module for n in [*columns, row]])
    if not columns or not scope:
        return None
    inside = lambda name: f"{by_name[name].module}.".startswith(scope + ".")  # noqa: E731
    replicated, stack, seen = set(), [src for c in columns for src in inputs[c]] + list(shared), set()
    while stack:
        name = stack.pop()
        if name in seen or not inside(name):
            continue
        seen.add(name)
        if by_name[name].kind in ("linear", "norm"):
            replicated.add(by_name[name].module)
        stack.extend(inputs[name])
    read_latent = {c for c in columns if any(src in seen for src in inputs[c])}
    return {"column": columns, "row": row, "kind": "attention", "fused": False,
            "column_styles": {by_name[c].module: COLWISE_LOCAL for c in read_latent},
            "kv_styles": {}, "attention": attention, "norm_across_heads": [],
            "replicated": sorted(replicated), "head_norms": []}


def _unshardable_norms(module: nn.Module, pairs: list[dict]) -> list[dict]:
    """`pairs` with each pair whose norms over all heads are not all plain RMSNorms (checked on
    the block's own modules) turned back into one left unsplit."""
    out = []
    for pair in pairs:
        paths = pair.get("sharded_norms", [])
        if paths and not all(is_plain_rms_norm(_submodule_at(module, p)) for p in paths):
            pair = {**pair, "norm_across_heads": pair["across"], "sharded_norms": []}
        out.append(pair)
    return out


def _with_parameter_readers(module: nn.Module, pairs: list[dict], by_name: dict) -> list[dict]:
    """`pairs` with the modules whose own parameters are read between a column and its row
    (xIELU's learned alphas applied to each rank's columns) computed whole on every rank, their
    gradients, each rank's share of the sum, summed over the ranks ("replicated"); a pair whose
    parameter belongs to a column or row linear, or to a module holding others, is left unsplit."""
    out = []
    for pair in pairs:
        linears = {by_name[n].module for n in [*pair["column"], pair["row"]]}
        owners = [path for path in pair.get("parameter_owners", []) if not _head_tables_on_dtensors(module, pair, path)]
        per_head = [path for path in owners if _holds_head_vectors(module, pair, path, by_name)]
        owners = [path for path in owners if path not in per_head]
        own = [path for path in owners if path not in linears and _holds_only_its_own(module, path)]
        if len(own) < len(owners):
            pair = {**pair, "parameters_in_region": [p for p in owners if p not in own]}
        elif own or per_head:
            pair = {**pair, "replicated": sorted({*pair.get("replicated", []), *own}), "head_parameters": per_head}
        out.append(pair)
    return out


def _holds_head_vectors(block: nn.Module, pair: dict, path: str, by_name: dict) -> bool:
    """`path` is the plain attention module holding the pair's q, k and v columns, and its own
    parameters are vectors of one value per head of its attention (GraniteSWA's sinks): the runtime
    shards them by heads (runtime/head_parameters.py)."""
    attention = pair.get("attention") or []
    if pair["kind"] != "attention" or not attention or pair.get("column_style", "colwise") != "colwise":
        return False
    if not attention[0].input_shapes or len(attention[0].input_shapes[0]) != 4:
        return False
    holder = _columns_holder([by_name[n].module for n in pair["column"]])
    sub = _submodule_at(block, path)
    heads = attention[0].input_shapes[0][1]
    own = list(sub.parameters(recurse=False)) if sub is not None else []
    return path == holder and bool(own) and all(p.dim() == 1 and p.shape[0] == heads for p in own)


def _head_tables_on_dtensors(block: nn.Module, pair: dict, path: str) -> bool:
    """`path` is an attention run on DTensors whose own parameters are all per-head tables,
    which the runtime shards by heads (global_attention.shard_head_tables: Swin's relative
    position bias)."""
    style, _, counts = pair.get("column_style", "").partition(":")
    sub = _submodule_at(block, path) if style == "colwise_qkv_global" else None
    if sub is None:
        return False
    heads = int(counts.split(",")[0])
    own = list(sub.parameters(recurse=False))
    return bool(own) and all(p.dim() >= 1 and p.shape[-1] == heads for p in own)


def _holds_only_its_own(block: nn.Module, path: str) -> bool:
    """The module at `path` (not the block itself) has parameters and none of its submodules does."""
    sub = _submodule_at(block, path)
    return sub is not None and any(True for _ in sub.parameters(recurse=False)) and \
        all(not any(True for _ in child.parameters()) for child in sub.children())


def _submodule_at(block: nn.Module, path: str) -> nn.Module | None:
    """The block's submodule whose path (relative to the block) ends the model path `path`;
    None when none does (`path` is the block itself, or outside it)."""
    found = [(name, sub) for name, sub in block.named_modules() if name and ("." + path).endswith("." + name)]
    return max(found, key=lambda item: len(item[0]))[1] if found else None


def unsplit_reasons(ops: list[OpInfo], pairs: list[dict]) -> list[tuple[str, str]]:
    """(module, reason) for each part of a block that tensor parallelism must leave whole."""
    module_of = {op.name: op.module for op in ops}
    reasons = [(module_of[c], _FUSED) for p in pairs if p["fused"] for c in p["column"]]
    reasons += [(module_of[n], _NORM_ACROSS_HEADS) for p in pairs for n in p.get("norm_across_heads", [])]
    reasons += [(module_of[n], _SHARED_ACROSS_HEADS) for p in pairs for n in p.get("shared_across_heads", [])]
    reasons += [(_common_parent([module_of[n] for n in [*p["column"], p["row"]]]), _UNREAD_HEADS)
                for p in pairs if p.get("unread_heads")]
    reasons += [(path, _PARAMETER_IN_REGION) for p in pairs for path in p.get("parameters_in_region", [])]
    covered = {a.name for p in pairs for a in p["attention"]}
    reasons += [(op.module or op.name, "its attention is not between a column and a row linear "
                 "found in the data flow; left unsplit")
                for op in ops if op.kind == "attention" and op.target not in _MHA_TARGETS
                and op.name not in covered]
    return reasons


def block_tp_facts(module: nn.Module, ops: list[OpInfo], edges: list[tuple[str, str]]) -> dict:
    """heads, kv_heads, ffn, kv_bytes, tp_parameters, tp_flops, kv_modules and kv_parameters
    (the separate k and v projections, colwise_kv) and the pairs of one block copy."""
    by_name = {op.name: op for op in ops}
    facts = {"heads": 0, "kv_heads": 0, "ffn": 0, "kv_bytes": 0, "tp_parameters": 0,
             "tp_flops": 0, "kv_modules": (), "kv_parameters": 0, "pairs": [], "unsplit": []}
    moe = _moe_module(module)
    experts = {op.name for op in ops if moe and f".{moe[0]}." in f".{op.module}."}
    pairs = _unshardable_norms(module, [p for p in linear_pairs(ops, edges) if p["row"] not in experts])
    pairs = _with_parameter_readers(module, pairs, by_name)
    mha_pairs, mha_unsplit = _mha_pairs(module, ops)
    facts["unsplit"] = unsplit_reasons(ops, pairs) + mha_unsplit
    for pair in mha_pairs:
        _add_mha_facts(facts, pair)
    for pair in pairs:
        if pair["fused"] or pair.get("norm_across_heads") or pair.get("shared_across_heads") \
                or pair.get("unread_heads") or pair.get("parameters_in_region"):
            continue
        linears = [by_name[n] for n in pair["column"]] + [by_name[pair["row"]]]
        facts["tp_parameters"] += sum(op.parameters for op in linears)
        facts["tp_flops"] += sum(op.flops for op in linears)
        kv = [by_name[n] for n in pair.get("kv_styles", {})]  # k and v whose heads may be replicated
        facts["kv_modules"] += tuple(op.module for op in kv)
        facts["kv_parameters"] += sum(op.parameters for op in kv)
        if pair["kind"] == "attention":
            sdpa = pair["attention"][0] if pair["attention"] else None
            head_dim = sdpa.input_shapes[0][-1] if sdpa else 0
            if sdpa:
                facts["heads"] = int(sdpa.input_shapes[0][1])
                facts["tp_flops"] += sum(a.flops for a in pair["attention"])
            widths = [by_name[n].output_shape[-1] for n in pair["column"]]
            style = pair.get("column_style", "colwise")
            if head_dim and style.partition(":")[0] in ("colwise_qkv", "colwise_qkv_global"):  # [all q | all k | all v]
                facts["kv_heads"] = int(style.partition(":")[2].split(",")[1])
            elif head_dim:
                # one column holds q, k and v head by head or group by group (_head_groups)
                facts["kv_heads"] = (pair.get("head_groups") or facts["heads"] if len(widths) == 1
                                     else int(min(widths) // head_dim))
            if head_dim:
                tokens = _tokens(by_name[pair["row"]])
                facts["kv_bytes"] = 2 * tokens * facts["kv_heads"] * head_dim * 2
        else:  # a [gate | up] column holds two ffn-wide halves
            halves = 2 if pair.get("column_style") == "colwise_gate_up" else 1
            facts["ffn"] = max(facts["ffn"], max(by_name[n].output_shape[-1] for n in pair["column"]) // halves)
        facts["pairs"].append(pair)
    return facts


def _add_mha_facts(facts: dict, pair: dict) -> None:
    """An nn.MultiheadAttention's share of a block's TP facts: all of its parameters and
    FLOPs (in_proj, attention, out_proj) are split by heads, and its K/V are its heads'."""
    op, mha = pair["attention"][0], pair["mha"]
    facts["heads"] = facts["kv_heads"] = mha.num_heads
    facts["tp_parameters"] += op.parameters
    facts["tp_flops"] += op.flops
    source = op.input_shapes[1] if len(op.input_shapes) > 1 else op.output_shape
    keys = _tokens(OpInfo("", "", "", "", (), tuple(source), ""))  # keys: the key input's tokens
    facts["kv_bytes"] = 2 * keys * mha.embed_dim * 2
    facts["pairs"].append(pair)


def _tokens(op: OpInfo) -> int:
    shape = op.output_shape
    numel = 1
    for dim in shape[:-1]:
        numel *= dim
    return numel


def _columns_holder(columns: list[str]) -> str:
    """The module holding a pair's column linears (the attention module of q, k and v)."""
    return _common_parent([c.rpartition(".")[0] for c in columns])


def _common_parent(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _relative(path: str, block: str) -> str:
    return path[len(block) + 1:] if path.startswith(block + ".") else ""


def block_scopes(model: nn.Module, paths: tuple[str, ...]) -> list[str]:
    """Keys of one block class in the TP style table: "<list>.*" when the class fills its
    ModuleList / Sequential, else each block path (several classes share that list)."""
    parent = paths[0].rpartition(".")[0]
    same_parent = all(p.rpartition(".")[0] == parent for p in paths)
    children = len(list(model.get_submodule(parent).children())) if same_parent else -1
    if same_parent and children == len(paths):
        return [f"{parent}.*" if parent else "*"]
    return list(paths)


def _block_styles(block_ops: list[OpInfo], pairs: list[dict], first: str,
                  written: frozenset = frozenset()) -> dict[str, str]:
    """Relative path -> TP style of one block class; a row linear whose output an in-place op
    of `written` updates gets one of its own ("rowwise_copy")."""
    styles: dict[str, str] = {}
    module_of = {o.name: o.module for o in block_ops}
    for pair in pairs:
        if pair.get("mha") is not None:  # one module, split by heads whole
            styles[_relative(module_of[pair["row"]], first)] = pair["column_style"]
            continue
        columns = [module_of[n] for n in pair["column"]]
        row = module_of[pair["row"]]
        kv_styles = {module_of[n]: style for n, style in pair.get("kv_styles", {}).items()}
        for column in columns:
            styles[_relative(column, first)] = (kv_styles.get(column) or pair.get("column_styles", {}).get(column)
                                                or pair.get("column_style", "colwise"))
        for module in pair.get("replicated", []):
            styles[_relative(module, first)] = REPLICATED
        styles[_relative(row, first)] = "rowwise_copy" if pair["row"] in written else "rowwise"
        # the module holding the column linears gathers their input: not the pair's common
        # parent, which can also add the residual (BERT's attention holds its output's
        # dense + LayerNorm(x + residual)) and would hand on the residual gathered, as a DTensor
        holder = _columns_holder(columns)
        parent = _relative(holder, first)
        if parent:  # a pair written inline in the block: its column linears gather their input,
            # a gather of the block's input would hand the residual stream on as a DTensor
            styles[parent] = HEAD_PARAMETERS if holder in pair.get("head_parameters", ()) else "prepare_input"
    head_norms = {n for pair in pairs for n in pair.get("head_norms", [])}
    sharded = {m for pair in pairs for m in pair.get("sharded_norms", [])}
    replicated = {m for pair in pairs for m in pair.get("replicated", [])}
    for op in block_ops:
        if op.kind == "norm" and op.module and op.module not in replicated:
            styles[_relative(op.module, first)] = (SHARDED_RMS_NORM if op.module in sharded else
                                                   "head_norm" if op.name in head_norms else "sequence_parallel")
    return styles


def add_parallelism_facts(mg: ModelGraph, model: nn.Module, gm: fx.GraphModule, groups: dict,
                          first_path: dict[str, str], edges: list[tuple[str, str]]) -> None:
    """Fill tensor_parallel, tp_unsplit, tp_styles, context_parallel, cp_buffers, expert_parallel."""
    ops = [mg.graph.nodes[n]["op"] for n in mg.graph.nodes]
    table: dict[str, dict[str, str]] = {}
    unstyled: list[str] = []
    mixers: list[tuple[OpInfo, str]] = []  # ops combining tokens outside attention (CP)
    unsharded_mixers: list[tuple[OpInfo, str]] = []  # and outside every TP region (SP)
    aliases = _parameter_aliases(model)
    # T5's attention adds a bias of one column per head (a table in its first block; the
    # others, and a decoder's cross-attention, make zeros of their head count): every
    # attention of such a model gets the rank's head count
    counted_heads = any(_head_tables(model.get_submodule(first), mg.segment(group).heads)
                        for group, first in first_path.items())
    for group, first in first_path.items():
        block_ops = [op for op in ops if op.name.startswith(first + ".")]
        facts = block_tp_facts(model.get_submodule(first), block_ops, edges)
        block = mg.segment(group)
        mg.tp_unsplit += [{"block": group, "module": _relative(m, first) or m, "reason": r}
                          for m, r in facts["unsplit"]]
        if not facts["pairs"]:
            mg.tp_unsplit.append({"block": group, "module": "", "reason": "no column/row linear "
                                  "pair in its data flow"})
        module_of = {o.name: o.module for o in block_ops}
        for pair in facts["pairs"]:
            columns = [module_of[n] for n in pair["column"]]
            row = module_of[pair["row"]]
            divides = ({"heads": block.heads, "kv_heads": block.kv_heads} if pair["kind"] == "attention"
                       else {"ffn": block.ffn})
            mg.tensor_parallel.append({
                "block": group, "kind": pair["kind"],
                "module": _relative(_common_parent(columns + [row]), first),
                "column": [_relative(c, first) for c in columns], "row": _relative(row, first),
                "divides": divides, "kv_replicable": bool(pair.get("kv_styles")),
            })
        in_place = {o.name for o in block_ops if o.writes_input}
        written = frozenset(src for src, dst in edges if dst in in_place)
        styles = _block_styles(block_ops, facts["pairs"], first, written)
        for pair in (p for p in facts["pairs"] if p["kind"] == "attention" and block.heads):
            # its attention builds a tensor of its head count, or views q, k and v by one it
            # holds: the runtime gives it the rank's
            columns = [module_of[c] for c in pair["column"]]
            parent = _columns_holder(columns)
            if not (counted_heads or holds_head_count(model.get_submodule(parent), block.heads)):
                continue
            for path in (_relative(c, first) for c in columns):
                if styles.get(path) == "colwise":
                    styles[path] = f"colwise_heads:{block.heads},{block.kv_heads or block.heads}"
        _own_head_inputs(styles, facts["pairs"], module_of, first, block.heads,
                         getattr(gm, "module_inputs", {}), mg.batch_size)
        if block.heads and counted_heads:
            for path in _head_tables(model.get_submodule(first), block.heads):
                styles[path] = "head_embedding"
        moe = _moe_module(model.get_submodule(first))
        if moe is not None:  # token-wise: the runtime runs it on this rank's sequence shard
            styles[moe[0]] = TOKEN_WISE_MOE
        unstyled += _unstyled_parameters(block_ops, styles, first, moe[0] if moe is not None else None, aliases)
        for scope in block_scopes(model, block.paths):
            table[scope] = dict(styles)
        attention_modules = sorted({op.module for op in block_ops if _attends_over_the_sequence(op, mg)})
        # an image model's convolutions mix pixels, and neither CP nor SP splits its images
        block_mixers = [] if mg.image_size else _sequence_mixers(
            block_ops, attention_modules, {loop["module"] for loop in mg.sequence_loops})
        mixers += block_mixers
        if block_mixers:  # under SP a TP region sees the whole sequence (gathered at its column)
            regions = _tp_regions(mg.graph, facts["pairs"])
            unsharded_mixers += [(op, what) for op, what in block_mixers if op.name not in regions]
        for copy in block.paths:
            mg.context_parallel += [copy + a[len(first):] for a in attention_modules]
            if moe is not None:
                path = ".".join(p for p in (copy, moe[0]) if p)
                mg.expert_parallel.append({"module": path, "experts": moe[1], "top_k": moe[2]})
    if mg.tp_unsplit:
        mg.tensor_parallel = []  # a sequence-sharded residual stream needs every block sharded
    if mg.tensor_parallel:
        mg.tp_styles = {"": _pre_post_styles(mg, model, ops, first_path), **table}
        outside = [op for op in ops if not op.name.startswith(tuple(p + "." for p in first_path.values()))]
        unstyled += _unstyled_parameters(outside, mg.tp_styles[""], "", None, aliases)
        if unsharded_mixers:
            op, what = unsharded_mixers[0]
            mg.sp_problem = (f"{op.module} combines tokens along the sequence ({what}) outside the "
                             "tensor-parallel regions, where sequence parallelism hands it a rank's own "
                             "share of the tokens; tensor parallelism runs without SP")
        elif unstyled:
            mg.sp_problem = (f"{unstyled[0]} is read on the sequence shard by a module sequence "
                             "parallelism does not shard (a hand-written norm, a learned scale on the "
                             "residual stream), so each rank's gradient of it would cover its own tokens "
                             "only; tensor parallelism runs without SP")
    mg.cp_buffers = _sliced_buffers(gm) if mg.context_parallel else {}
    if mg.context_parallel and mixers:
        op, what = mixers[0]
        mg.cp_problem = (f"{op.module} combines tokens along the sequence outside attention ({what}), "
                         "which a context-parallel rank would run on its own share of the tokens "
                         "alone (ring attention is the only part that sees the others), training a "
                         "wrong model; use cp=1 for this model")


# cumulative ops along a dimension: the scan of a state-space or linear-attention mixer
# (Mamba-2's and gated DeltaNet's chunked scans)
_SCAN_TARGETS = frozenset({"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"})


def _sequence_mixers(block_ops: list[OpInfo], attention_modules: list[str],
                     loops: set[str]) -> list[tuple[OpInfo, str]]:
    """(op, what it is) for each op of a block outside its SDPA attention modules that may
    combine tokens: a convolution (a state-space mixer's causal conv1d, LFM2's short
    convolution), a cumulative scan, a Python loop over the tokens (sequence_loops), or an
    attention written out with per-head matmuls (MiniMax's lightning attention). Under CP every
    module but the attention runs on a rank's own tokens, so each of these must be token-wise."""
    def outside(op: OpInfo) -> bool:
        return not any(_inside(op.module, a) for a in attention_modules)

    ops = list(filter(outside, block_ops))
    return ([(op, "a convolution over the sequence") for op in ops if op.kind == "conv"]
            + [(op, f"a running total, {op.target}") for op in ops if op.target in _SCAN_TARGETS]
            + [(op, "an attention written out with matmuls") for op in ops if op.kind == "matmul"
               and len(op.input_shapes) >= 2 and per_head_matmul(*op.input_shapes[:2])]
            + [(op, "a Python loop over the tokens") for op in ops if op.module in loops])


def _own_head_inputs(styles: dict[str, str], pairs: list[dict], module_of: dict[str, str], first: str,
                     heads: int, module_inputs: dict[str, list[tuple]], batch: int) -> None:
    """An attention module its model hands tensors of every head (ALiBi's bias; a mask with
    it folded in) gathers its input and takes the rank's heads of those ("head_inputs",
    runtime/head_inputs.py) instead of "prepare_input"."""
    for pair in (p for p in pairs if p["kind"] == "attention" and heads and p.get("mha") is None):
        parent = _common_parent([module_of[c].rpartition(".")[0] for c in pair["column"]])
        names = head_inputs_of(module_inputs.get(parent, []), heads, batch)
        relative = _relative(parent, first)
        if names and styles.get(relative) == "prepare_input":
            styles[relative] = head_inputs_style(heads, names)


def _tp_regions(graph, pairs: list[dict]) -> set[str]:
    """The ops on a path from a pair's column to its row, the pairs' own included."""
    import networkx as nx

    region: set[str] = set()
    for pair in pairs:
        row = pair["row"]
        before_row = nx.ancestors(graph, row) if row in graph else set()
        for column in (c for c in pair["column"] if c in graph):
            region |= (nx.descendants(graph, column) & before_row) | {column, row}
    return region


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".") or module == ""


def _unstyled_parameters(ops: list[OpInfo], styles: dict[str, str], first: str,
                         token_local: str | None, aliases: dict[str, list[str]]) -> list[str]:
    """The parameters `ops` read none of whose modules (a shared parameter has several) has a
    TP style of its own parameters (paths in `styles` relative to `first`; the token-wise MoE
    module `token_local` has its gradients summed): under SP each rank reads them on its own
    tokens."""
    def styled(name: str) -> bool:
        owner = name.rpartition(".")[0]
        owner = _relative(owner, first) if first else owner
        return styles.get(owner, "prepare_input").partition(":")[0] not in ("prepare_input", HEAD_INPUTS) or (
            token_local is not None and f"{owner}.".startswith(f"{token_local}."))

    return sorted({param for op in ops for param in op.parameter_reads
                   if not any(styled(name) for name in aliases.get(param, [param]))})


def _parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """A shared parameter's name (the first, as named_parameters gives it) -> all its names."""
    return {group[0]: group for group in tied_groups(model)}


def _attends_over_the_sequence(op: OpInfo, mg: ModelGraph) -> bool:
    """An SDPA over the model's token sequence (batch, heads, seq, dim), which ring attention
    can split: not attention within windows (Swin: windows folded into the batch) nor over
    the patches of one image (the sequence of an image model is one sample)."""
    shape = op.output_shape or ()
    if op.kind == "attention" and op.target in _MHA_TARGETS:  # (seq, batch, E), or batch first
        return len(shape) == 3 and mg.seq_len > 1 and (
            shape[:2] == (mg.seq_len, mg.batch_size) or shape[:2] == (mg.batch_size, mg.seq_len))
    return (op.kind == "attention" and op.target == "scaled_dot_product_attention" and len(shape) >= 3
            and shape[0] == mg.batch_size and shape[-2] == mg.seq_len > 1)


def _head_tables(block: nn.Module, heads: int) -> list[str]:
    """The embeddings of a block with one column per attention head (relative position
    biases)."""
    return [path for path, sub in block.named_modules()
            if heads and isinstance(sub, nn.Embedding) and sub.embedding_dim == heads]


def _moe_module(block: nn.Module) -> tuple[str, int, int] | None:
    for path, sub in block.named_modules():
        if path == "":
            continue
        experts, top_k = moe_layer_facts(sub)
        if experts:
            return path, experts, top_k
    return None


def _pre_post_styles(mg: ModelGraph, model: nn.Module, ops: list[OpInfo],
                     first_path: dict[str, str]) -> dict[str, str]:
    styles = {}
    in_block = tuple(p + "." for p in first_path.values())
    block_ops = [i for i, op in enumerate(ops) if op.name.startswith(in_block)]
    after_blocks = block_ops[-1] if block_ops else len(ops)
    for index, op in enumerate(ops):
        if op.name.startswith(in_block) or not op.module:
            continue
        module = model.get_submodule(op.module)
        if op.kind == "embedding" and getattr(module, "num_embeddings", 0) == mg.vocab \
                and len(op.input_shapes[0] if op.input_shapes else ()) >= 2:
            styles[op.module] = "vocab_embedding"
        elif op.kind == "embedding":  # positions, token types: added whole to the token embedding
            # (a table of vocabulary size looked up by `arange(seq)`, too: a (seq, hidden) output
            # that a vocab-parallel lookup would cut along hidden)
            styles[op.module] = "whole_embedding"
        elif op.kind == "norm" and index > after_blocks:  # the model's closing code reads its
            # output's shape (GPT-2's view(-1, seq, hidden)); nothing adds a plain residual to it
            styles[op.module] = "final_norm"
        elif op.kind == "norm":  # its output is (or is added to) the residual stream
            styles[op.module] = "sequence_parallel"
        elif op.kind == "linear" and getattr(module, "out_features", 0) == mg.vocab:
            styles[op.module] = "vocab_head"
        elif op.kind == "linear":  # BERT's head transform: token-wise on the sequence shard,
            # its replicated weight's gradient summed over the ranks' tokens
            styles[op.module] = "sequence_parallel"
    return styles


def _sliced_buffers(gm: fx.GraphModule) -> dict[str, int]:
    """Buffers the root slices along dim 0 (RoPE / position tables indexed by position)."""
    buffers = dict(gm.named_buffers())
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in buffers:
            for user in node.users:
                index = user.args[1] if len(user.args) > 1 else None
                # operator.getitem, or Tensor.__getitem__ where fx records the method itself
                if user.op == "call_function" and func_name(user.target) == "getitem" \
                        and isinstance(index, slice):
                    found[str(node.target)] = 0
    return found
