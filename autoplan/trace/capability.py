"""The capability contract: which parallel axes autoplan's runtime can apply to this model.

Facts read off the graph say where an axis could apply; this probe asks the runtime itself.
For each axis the graph offers (tp, cp, ep, pp; "tp_kv", tp over more ranks than a
grouped-query attention's K/V heads, whose k and v run another code path; and "pp_tp",
pipeline stages split by TP, whose first stage hands on a sequence shard) it builds the
smallest plan using that axis alone (or that pair), applies `autoplan.runtime.apply_plan` to a copy of
the meta model on torch's "fake" process group (one process stands for every rank:
collectives return at once, torch's `torch.testing._internal.distributed.fake_pg`) and runs
one forward and backward on meta tensors. The first exception is the reason the axis is
refused, naming the module where the runtime says so. The same model without any axis runs first: when that fails (a
model whose eager forward cannot run on meta), the probe cannot tell, and the axes stay as
the graph facts give them. Token inputs are cut to a short sequence every probed degree
divides; results are cached per model (fingerprint, class) and call (inputs, shape).
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from autoplan.config import ParallelConfig
from autoplan.errors import UserError
from autoplan.plan import ModelRef, Plan
from autoplan.runtime.mesh import build_mesh
from autoplan.runtime.model_io import logits_of, model_call, numbers_own_positions
from autoplan.runtime.parallelize import apply_plan, validate_plan
from autoplan.runtime.tensor_parallel import uses_loss_parallel
from autoplan.trace.fake_group import fake_process_group
from autoplan.trace.graph import ModelGraph
from autoplan.trace.ops import bmm_operands, folded_scores, per_head_matmul
from autoplan.trace.routing import BalancedRouting, RoutingContext

# probe results by model and call convention: running the runtime on fake tensors takes
# seconds, and a process traces one model many times (validation traces it per published run
# and sequence length); what the runtime can apply depends on the model (its fingerprint and
# class: two files can differ only in forward code) and on how it is called, not on a cost
_CACHE: dict[tuple, dict[str, str | None]] = {}


def _smallest_tp(graph: ModelGraph) -> int:
    sizes = [v for b in graph.blocks for v in (b.heads, b.kv_heads, b.ffn) if v]
    return next((d for d in range(2, 65) if all(v % d == 0 for v in sizes)), 0)


def _smallest_kv_tp(graph: ModelGraph) -> int:
    """The smallest tp at which some block's K/V heads are replicated (tp a multiple of them,
    runtime/kv_replication.py) and the rest of the model splits; 0 when none is offered."""
    if not any(p.get("kv_replicable") for p in graph.tensor_parallel):
        return 0
    sizes = [v for b in graph.blocks for v in (b.heads, b.ffn) if v]
    kvs = [b.kv_heads for b in graph.blocks if b.kv_heads]
    return next((d for d in range(2, 65) if all(v % d == 0 for v in sizes)
                 and all(k % d == 0 or d % k == 0 for k in kvs) and any(k % d for k in kvs)), 0)


def _smallest_ep(graph: ModelGraph) -> int:
    experts = [b.experts for b in graph.blocks if b.experts]
    return next((d for d in range(2, 65) if experts and all(e % d == 0 for e in experts)), 0)


def probe_plans(graph: ModelGraph, seq_len: int, blocks: set[str]) -> dict[str, Plan]:
    """axis -> the smallest plan that uses it alone, for each axis the graph facts offer,
    naming only modules inside `blocks` (the block paths the probed model has)."""
    inside = lambda path: any(path == b or path.startswith(b + ".") for b in blocks)  # noqa: E731
    base = Plan(model=ModelRef("probe", graph.model_name), gpu="cpu", world_size=1, gpus_per_node=1,
                parallel=ParallelConfig(global_batch=1, seq_len=seq_len, precision="fp32",
                                        sequence_parallel=False))
    plans = {}
    tp = _smallest_tp(graph) if graph.tensor_parallel else 0
    if tp:
        # a block class that shares its list with another (T5's first block) is keyed by
        # each block path; keep the keys of the blocks the probed copy still has
        styles = {k: dict(v) for k, v in graph.tp_styles.items() if k == "" or "*" in k or k in blocks}
        plans["tp"] = base.with_(world_size=tp, gpus_per_node=tp, tp=tp,
                                 sequence_parallel=graph.sequence_shardable,
                                 tp_styles=styles)
    kv_tp = _smallest_kv_tp(graph) if graph.tensor_parallel else 0
    if kv_tp:  # K/V heads replicated: another code path of the same styles
        styles = {k: dict(v) for k, v in graph.tp_styles.items() if k == "" or "*" in k or k in blocks}
        plans["tp_kv"] = base.with_(world_size=kv_tp, gpus_per_node=kv_tp, tp=kv_tp,
                                    sequence_parallel=graph.sequence_shardable, tp_styles=styles)
    if graph.context_parallel and seq_len % 4 == 0 and not graph.window_masked:
        plans["cp"] = base.with_(world_size=2, gpus_per_node=2, cp=2,
                                 cp_modules=[m for m in graph.context_parallel if inside(m)],
                                 cp_buffers=dict(graph.cp_buffers))
    ep = _smallest_ep(graph) if graph.expert_parallel else 0
    if ep:
        plans["ep"] = base.with_(world_size=ep, gpus_per_node=ep, dp=ep, ep=ep, global_batch=ep,
                                 ep_modules=[e["module"] for e in graph.expert_parallel if inside(e["module"])])
    paths = [p for p, _ in graph.layer_order if p in blocks]
    if len(paths) >= 2:
        half = len(paths) // 2
        plans["pp"] = base.with_(world_size=2, gpus_per_node=2, pp=2, global_batch=2,
                                 blocks=tuple(paths), stage_layers=(half, len(paths) - half))
        if tp:  # a first stage hands on the residual's sequence shard under SP, which the
            # model's own code past its last block may reshape by the whole sequence (GPT-2)
            plans["pp_tp"] = plans["pp"].with_(world_size=2 * tp, gpus_per_node=2 * tp, tp=tp,
                                               sequence_parallel=plans["tp"].parallel.sequence_parallel,
                                               tp_styles=plans["tp"].tp_styles)
    return plans


def copy_module(model: nn.Module) -> nn.Module:
    """copy.deepcopy of `model`, whose traced forward may have left a state it keeps between
    calls in an attribute (RecurrentGemma's `recurrent_states`): a tensor autograd made, which
    deepcopy refuses. Such a tensor is carried over detached; the next forward replaces it."""
    memo = {id(value): value.detach() for module in model.modules() for value in vars(module).values()
            if isinstance(value, torch.Tensor) and not value.is_leaf}
    return copy.deepcopy(model, memo)


def shallow_copy(model: nn.Module, graph: ModelGraph) -> tuple[nn.Module, set[str]]:
    """A copy of the meta model whose block lists keep only the prefix holding the first two
    copies of each block class (copies are identical, so what applies to two applies to
    all; two so that a pipeline can cut between them), and the block paths kept."""
    keep: dict[str, int] = {}
    seen: dict[str, int] = {}
    for path, group in graph.layer_order:
        parent, _, index = path.rpartition(".")
        seen[group] = seen.get(group, 0) + 1
        if index.isdigit() and seen[group] <= 2:
            keep[parent] = max(keep.get(parent, 0), int(index) + 1)
    small = copy_module(model)
    for parent, length in keep.items():
        blocks = small.get_submodule(parent)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            del blocks[length:]
    kept = {name for name, _ in small.named_modules()}
    return small, {p for p, _ in graph.layer_order if p in kept}


def _probe_seq(graph: ModelGraph) -> int:
    """A short sequence every probed degree divides (tp for SP, 2*cp for zig-zag CP): fake
    tensors cost per op, but sequence-sized index and mask tensors still cost per token."""
    unit = 4 * max(_smallest_tp(graph), _smallest_kv_tp(graph), 1)
    return unit * 4 if graph.seq_len > unit * 4 and graph.seq_len % unit == 0 else graph.seq_len


def _shorter(inputs, seq: int, short: int):
    """Token-id inputs (integer, batch x seq) cut to `short` positions; others unchanged."""
    cut = lambda x: x[:, :short] if isinstance(x, torch.Tensor) and x.dim() == 2 \
        and not x.is_floating_point() and x.shape[1] == seq else x  # noqa: E731
    return {k: cut(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(cut, inputs))


def _routing(graph: ModelGraph) -> RoutingContext | None:
    """The balanced routing of the traced batch, for models with data-dependent routing."""
    if not graph.expert_parallel and not graph.fallback_modules:
        return None
    moe = graph.expert_parallel[0] if graph.expert_parallel else {}
    return RoutingContext(tokens=graph.batch_size * _probe_seq(graph), experts=moe.get("experts", 0),
                          top_k=moe.get("top_k", 0))


def _balanced(routing: RoutingContext | None, plan: Plan):
    """BalancedRouting over the tokens one rank routes (sequence shards under SP and CP)."""
    if routing is None:
        return contextlib.nullcontext()
    shards = (plan.tp if plan.sequence_parallel else 1) * plan.cp
    return BalancedRouting(replace(routing, tokens=routing.tokens // shards))


def _apply(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, run: bool,
           routing: RoutingContext | None, heads: frozenset = frozenset(), folds_heads: bool = False) -> None:
    """apply_plan on the fake process group, then (if `run`) one forward and backward, on
    fake CPU tensors (meta tensors have no process-group backend for point-to-point ops)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    validate_plan(model, plan)
    mesh = build_mesh(plan, "cpu")  # outside FakeTensorMode (torch-cpu-facts.md item 16)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        model.to_empty(device="cpu")
        part = apply_plan(model, plan, mesh, data_parallel=False).parts[0]
        if run:
            to_fake = lambda x: fake.from_tensor(torch.zeros_like(x, device="cpu")) \
                if isinstance(x, torch.Tensor) else x  # noqa: E731
            with _balanced(routing, plan):  # routing on fake values: balanced, as traced
                _step(part, plan, tuple(map(to_fake, args)), {k: to_fake(v) for k, v in kwargs.items()},
                      heads, folds_heads)


class LocalPositions(RuntimeError):
    """Positions derived from a context-parallel rank's own sequence shard."""


class _LocalPositionsGuard(TorchFunctionMode):
    """Under CP each rank holds `local` of the sequence's tokens (a zig-zag share). A
    `torch.arange(local)` inside forward numbers them 0..local-1, the positions of the
    first shard, on every rank, and so does a position table (a buffer) cut to its first
    `local` rows: the job would run with wrong positions and no error (rotary or learned
    positions computed in forward). Models taking `position_ids` get each rank's positions
    from the runtime, and position tables named in the plan's cp_buffers are re-indexed."""

    def __init__(self, local: int, full: int, tables: dict[int, str]) -> None:
        super().__init__()
        self.local, self.full, self.tables = local, full, tables  # id(buffer) -> its name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and id(args[0]) in self.tables and self._first_rows(args[1]):
            raise LocalPositions(
                f"it cuts the buffer {self.tables[id(args[0])]} to its first {self.local} rows, the "
                f"first shard's positions (of {self.full}): under context parallelism every rank would "
                "use them (the trace finds no slice of it to re-index). Take `position_ids` in forward")
        out = func(*args, **(kwargs or {}))
        if func is torch.arange and out.dim() == 1 and out.numel() == self.local \
                and (len(args) < 2 or args[0] == 0) and (len(args) < 3 or args[2] == 1):
            raise LocalPositions(
                f"it computes positions with torch.arange over the {self.local} tokens of this "
                f"rank's shard (of {self.full}): under context parallelism every rank would use the "
                "first shard's positions. Take `position_ids` in forward (the runtime passes each "
                "rank's positions) or keep the position table in a buffer")
        return out

    def _first_rows(self, index) -> bool:
        return isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1) \
            and index.stop == self.local


class LocalHeads(RuntimeError):
    """Attention run with other heads than a tensor-parallel rank's share of the model's."""


class _LocalHeadsGuard(TorchFunctionMode):
    """Under TP each rank's attention runs its share of the heads: a traced attention (its
    SDPA, or the per-head matmuls of one written out) of H heads of size d runs H/tp heads of
    size d. A forward that takes a head count or size
    from the whole model where the runtime cannot give it the rank's (an attribute not named
    for heads, `hidden_size // num_attention_heads` computed in forward) can still reshape
    without an error, into other heads (H/tp heads of 2d...), and train wrong; the
    runtime's own counts (fused_projection.localise_head_counts) are checked here too."""

    def __init__(self, heads: frozenset, tp: int, folded: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.heads, self.tp = heads, tp
        self.folded = folded  # (batch, seq) of the step, where the model folds heads into the batch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.folded and func in _BMMS:
            self._check_folded(*_bmm_operands(func, args, kwargs or {}))
        query = args[0] if args else (kwargs or {}).get("query")
        if func is torch.nn.functional.scaled_dot_product_attention and _plain(query, 4) \
                and (query.shape[1] * self.tp, query.shape[-1]) not in self.heads:
            self._refuse(query.shape[1], query.shape[-1])
        if func in _MATMULS and len(args) == 2 and _plain(args[0], 4) \
                and _plain(args[1], 4) and per_head_matmul(args[0].shape, args[1].shape) \
                and not any((args[0].shape[1] * self.tp, d) in self.heads
                            for d in (args[0].shape[-1], args[1].shape[-1])):
            self._refuse(args[0].shape[1], args[0].shape[-1])
        return func(*args, **(kwargs or {}))

    def _check_folded(self, a, b) -> None:
        """q @ k^T on (batch * heads, seq, head size): the rank's heads, as for SDPA."""
        batch, seq = self.folded
        if _plain(a, 3) and _plain(b, 3) and folded_scores(tuple(a.shape), tuple(b.shape), seq) \
                and a.shape[0] % batch == 0:
            local = a.shape[0] // batch
            if (local * self.tp, a.shape[-1]) not in self.heads:
                self._refuse(local, a.shape[-1])

    def _refuse(self, heads: int, size: int) -> None:
        share = " or ".join(f"{h // self.tp} of size {d}" for h, d in sorted(self.heads))
        raise LocalHeads(f"its attention runs {heads} heads of size {size} per rank at "
                         f"tp={self.tp}, not {share}: {self._cause(heads)}")

    def _cause(self, heads: int) -> str:
        if heads in {h for h, _ in self.heads}:  # every head, each cut: the count came whole
            return ("its forward views each rank's share of q, k and v as the model's head count "
                    "(as `view(batch, seq, self.heads, -1)`), which the runtime leaves whole for "
                    "plain column-sharded projections, so it would train wrong silently; view by "
                    "the head size instead (`view(batch, seq, -1, head_dim)`)")
        return ("its forward takes a head count or size from the whole model that the runtime "
                "cannot set to the rank's, so it would train wrong silently")


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_BMMS = (torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm)


def _bmm_operands(func, args: tuple, kwargs: dict) -> tuple:
    """The two batched operands of a bmm (input, mat2) or a baddbmm (batch1, batch2; BLOOM
    passes them by keyword to `alibi.baddbmm`)."""
    if func in (torch.bmm, torch.Tensor.bmm):
        given = list(args) + [kwargs.get("mat2")]
        return given[0], given[1]
    given = list(args[1:]) + [kwargs.get("batch1"), kwargs.get("batch2")]
    given = [g for g in given if g is not None] + [None, None]
    return given[0], given[1]


def _plain(value, dims: int) -> bool:
    """A plain (not DTensor) tensor of `dims` dims: a rank's own (batch, heads, seq, head
    size), or its heads folded into the batch (batch * heads, seq, size)."""
    return isinstance(value, torch.Tensor) and not hasattr(value, "device_mesh") and value.dim() == dims


def _heads_guard(plan: Plan, heads: frozenset, folded: tuple[int, int] | None = None):
    if plan.tp == 1 or not heads:
        return contextlib.nullcontext()
    return _LocalHeadsGuard(heads, plan.tp, folded)


def _position_tables(part: nn.Module, full: int) -> dict[int, str]:
    """The part's buffers with a row per position of the sequence at least (id -> name)."""
    return {id(buf): name for name, buf in part.named_buffers() if buf.dim() >= 1 and buf.shape[0] >= full}


def _positions_guard(part: nn.Module, plan: Plan):
    if plan.cp == 1 or plan.cp_buffers or "position_ids" in model_call(part).accepted:
        return contextlib.nullcontext()
    return _LocalPositionsGuard(plan.seq_len // plan.cp, plan.seq_len, _position_tables(part, plan.seq_len))


def _step(part: nn.Module, plan: Plan, args: tuple, kwargs: dict, heads: frozenset = frozenset(),
          folds_heads: bool = False) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    if plan.cp > 1:  # this rank's share of the sequence (dim 1 of token ids)
        cut = lambda x: x[:, : x.shape[1] // plan.cp] if isinstance(x, torch.Tensor) and x.dim() > 1 else x  # noqa: E731
        args, kwargs = tuple(map(cut, args)), {k: cut(v) for k, v in kwargs.items()}
    if plan.pp == 1:
        kwargs = {**_runtime_kwargs(part, plan, args, kwargs), **kwargs}
    elif not args and "input_ids" in kwargs:  # the schedule hands stage 0 its input positionally
        kwargs = dict(kwargs)
        args = (kwargs.pop("input_ids"),)
    vocab_sharded = plan.tp > 1 and uses_loss_parallel(plan.tp_styles)
    with loss_parallel() if vocab_sharded else contextlib.nullcontext(), _positions_guard(part, plan), \
            _heads_guard(plan, heads, _batch_and_seq(args, kwargs) if folds_heads else None):
        out = part(*args, **kwargs)
        if plan.pp > 1:  # stage 0: whatever it hands on that carries gradients
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            carried = [t.float().mean() for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
            if not carried:
                return
            loss = sum(carried)
        else:
            logits = logits_of(out)
            if logits.dim() < 2:  # one value per sample: a model file's own loss reads it
                loss = logits.float().mean()
            else:
                labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
                loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
        loss.backward()


def _batch_and_seq(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(batch, seq) of the step's token ids (or first input)."""
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    return (int(first.shape[0]), int(first.shape[1])) if first is not None else None


def _runtime_kwargs(part: nn.Module, plan: Plan, args: tuple, kwargs: dict) -> dict:
    """The keyword inputs the runtime's training step passes with token ids (model_io:
    position_ids, use_cache, decoder_input_ids): without them a Hugging Face model derives
    positions from the local sequence shard and fails under SP or CP where the job does not."""
    ids = args[0] if args else kwargs.get("input_ids")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        return {}
    positions = torch.arange(ids.shape[1], device=ids.device)
    return model_call(part).kwargs(ids, positions, zigzag=plan.cp > 1)


def _attention_heads(graph: ModelGraph) -> frozenset:
    """(heads, head size) of each SDPA of the traced model, from its query (batch, heads,
    seq, head size)."""
    ops = (graph.graph.nodes[n]["op"] for n in graph.graph.nodes)
    return frozenset((int(op.input_shapes[0][1]), int(op.input_shapes[0][-1])) for op in ops
                     if op.kind == "attention" and op.target == "scaled_dot_product_attention"
                     and op.input_shapes and len(op.input_shapes[0]) == 4)


def _written_out_heads(graph: ModelGraph) -> frozenset:
    """(heads, head size) of each attention written out with matmuls (facts.py takes it as
    the block's attention), from its q @ k^T: of a module's per-head matmuls at a block's head
    count, in the order they ran, every other one (the other is the product with the values)."""
    counts = {block.heads for block in graph.blocks if block.heads}
    by_module: dict[str, list] = {}
    for op in (graph.graph.nodes[n]["op"] for n in graph.graph.nodes):
        if op.kind == "matmul" and len(op.input_shapes) >= 2 and per_head_matmul(*op.input_shapes[:2]) \
                and op.input_shapes[0][1] in counts:
            by_module.setdefault(op.module, []).append(op)
    return frozenset((int(op.input_shapes[0][1]), int(op.input_shapes[0][-1]))
                     for ops in by_module.values() for op in ops[::2])


def _folded_heads(graph: ModelGraph) -> frozenset:
    """(heads, head size) of each attention whose heads are folded into the batch of its
    bmm/baddbmm (facts.py reads it as per head), from its q @ k^T at a block's head count."""
    counts = {block.heads for block in graph.blocks if block.heads}
    found = set()
    for op in (graph.graph.nodes[n]["op"] for n in graph.graph.nodes):
        if op.kind != "matmul" or op.target not in ("bmm", "baddbmm"):
            continue
        a, b = (bmm_operands(op.target, op.input_shapes) + ((), ()))[:2]
        if folded_scores(tuple(a), tuple(b), graph.seq_len) and a[0] % graph.batch_size == 0 \
                and a[0] // graph.batch_size in counts:
            found.add((int(a[0] // graph.batch_size), int(a[-1])))
    return frozenset(found)


def _mha_heads(model: nn.Module) -> frozenset:
    """(heads, head size) of each nn.MultiheadAttention: its SDPA runs inside its call,
    which the trace records as one op."""
    return frozenset((m.num_heads, m.head_dim) for m in model.modules()
                     if isinstance(m, nn.MultiheadAttention))


def _cp_positions_problem(model: nn.Module, cp_modules, heads: frozenset) -> str | None:
    """Why ring attention cannot give this model's tokens their positions, or None."""
    if numbers_own_positions(model):
        return ("it numbers its tokens itself from their ids (a position table with a padding row, "
                "as RoBERTa's: positions from padding_idx + 1, past padding tokens), which a "
                "context-parallel rank holding a zig-zag share of the tokens cannot reproduce; "
                "use cp=1 for this model")
    return _position_bias(model, cp_modules, heads)


def _position_bias(model: nn.Module, cp_modules, heads: frozenset) -> str | None:
    """Why ring attention cannot run an attention that adds a learned bias of one column per
    head to its scores (T5's relative position bias), or None. Checked before the run: it
    would fail first on the bias's own positions, whose fix (position_ids) would not help."""
    counts = {h for h, _ in heads}
    for path in cp_modules:
        for name, sub in model.get_submodule(path).named_modules():
            if isinstance(sub, nn.Embedding) and sub.embedding_dim in counts:
                return (f"{path}: its attention adds a relative position bias ({path}.{name}, one "
                        "column per head) to the scores, which ring attention does not apply; use "
                        "cp=1 for this model")
    return None


def _pop(running: list[str]) -> None:
    running.pop()  # a forward hook that returns something replaces the module's output


_SPLIT_WITH_WHOLE = ("its forward combines a split tensor with a whole one of the original size (position or "
                     "token-type embeddings added to a sequence shard, a bias of all heads added to some, "
                     "a mask or bias the model sized from a sequence shard)")
# (what torch's error says, what it means for the model): the probe's failures that have one
# cause, said as the cause
KNOWN_FAILURES = (
    ("is invalid for input of size",
     "its forward reshapes to a size fixed in its code or read from the whole model (a head "
     "count or the full width, as in `reshape(batch, seq, dim)`), while this split leaves each "
     "rank a part of the heads or of the sequence; reshape with -1 (`reshape(batch, seq, -1)`)"),
    ("not enough values to unpack",
     "its forward cuts a fused projection's output into parts of a size fixed in its code or "
     "read from the whole model (the full width, as in `split(hidden, dim=-1)`), while each rank "
     "holds its share of every part; cut by the module's head counts (`num_heads * head_dim`, "
     "which the runtime sets to the rank's) or into equal chunks (`chunk(3, dim=-1)`)"),
    ("mixed torch.Tensor and DTensor",
     "its forward combines a tensor-parallel output with a plain tensor outside a column/row "
     "pair (a residual added to one branch, or attention and MLP run in parallel from one norm), "
     "or, in an attention that runs on DTensors (a fused qkv viewed as (..., 3, heads, head_dim)), "
     "with a plain tensor made in its forward (a mask or rotary table other than a parameter "
     "of one column per head)"),
    ("Attempting to broadcast a dimension", _SPLIT_WITH_WHOLE),
    ("must match the existing size", _SPLIT_WITH_WHOLE),
    ("stack expects each tensor to be equal size",
     "its attention's keys and values differ in shape (MLA's separate rope and value head "
     "dimensions), which ring attention does not exchange"),
    ("DataDependent",
     "its forward branches on tensor values, which cannot be run on the plan-time probe's "
     "fake tensors"),
)


def known_failure(message: str, kind: str) -> str | None:
    """The cause of a failure KNOWN_FAILURES names (torch's exception said as its cause, not
    quoted); else None."""
    for fragment, cause in KNOWN_FAILURES:
        if fragment in message or fragment in kind:
            return cause
    return None


def _run_on_fake_group(model: nn.Module, plan: Plan, args: tuple, kwargs: dict,
                       routing: RoutingContext | None, run: bool = True,
                       heads: frozenset = frozenset(), folds_heads: bool = False) -> str | None:
    """None when the runtime applies `plan` (and runs it, if `run`), else the reason it does
    not, naming the innermost module that was running when it failed."""
    copy_ = copy_module(model)
    names = {id(m): path for path, m in copy_.named_modules()}
    running: list[str] = []
    enter = nn.modules.module.register_module_forward_pre_hook(
        lambda m, _args: running.append(names.get(id(m), "")))
    leave = nn.modules.module.register_module_forward_hook(lambda m, _args, _out: _pop(running))
    try:
        with fake_process_group(plan.world_size), warnings.catch_warnings():
            # the probe's mesh is a CPU one whatever the job's: not the job's RNG to warn about
            warnings.filterwarnings("ignore", message="DTensor random operators")
            _apply(copy_, plan, args, kwargs, run, routing, heads, folds_heads)
    except UserError as exc:  # the runtime's own words; name the module it ran if they do not
        where = next((p for p in reversed(running) if p), "")
        return f"{where}: {exc}" if where and where not in str(exc) else str(exc)
    except (LocalHeads, LocalPositions) as exc:  # the probe's own guards say the cause
        where = next((p for p in reversed(running) if p), "the root module")
        return f"{where}: {exc}"
    except Exception as exc:  # the runtime's own failure is the fact to report
        where = next((p for p in reversed(running) if p), "the root module")
        known = known_failure(str(exc), type(exc).__name__)
        if known:
            return f"{where}: {known}"
        return f"{where} fails under autoplan.runtime: {type(exc).__name__}: " \
               f"{(str(exc).splitlines() or [''])[0][:300]}"
    finally:
        enter.remove()
        leave.remove()
    return None


def _settings(model: nn.Module) -> str:
    """A Hugging Face model's configuration, whole: one class runs other code by its settings
    (the attention implementation: eager attention adds a mask made for the whole sequence,
    SDPA takes it as is)."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    fields = getattr(config, "__dict__", None)  # a user's model may hold any kind of `config`
    return repr(sorted((k, repr(v)) for k, v in fields.items())) if isinstance(fields, dict) else repr(config)


def probe_capabilities(graph: ModelGraph, model: nn.Module, args: tuple,
                       kwargs: dict) -> dict[str, str | None]:
    """axis -> None (the runtime applies it) or the reason it does not, for each axis the
    graph offers. When the model without any axis cannot run one step on fake tensors (data-
    dependent routing), each axis is only applied, not run. Empty inside a process that
    already has a process group (a training job)."""
    if dist.is_initialized():
        return {}
    # parameters alone do not tell models apart (two files, or two classes of a submodule,
    # can differ only in forward code), and what the probe runs depends on how the model is called
    classes = tuple(sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}))
    key = (graph.fingerprint, classes, _settings(model), len(args), tuple(sorted(kwargs)),
           graph.batch_size, graph.seq_len)
    if key not in _CACHE:
        seq = _probe_seq(graph)
        args, kwargs = _shorter(args, graph.seq_len, seq), _shorter(kwargs, graph.seq_len, seq)
        single = Plan(model=ModelRef("probe", graph.model_name), gpu="cpu", world_size=1,
                      gpus_per_node=1, parallel=ParallelConfig(global_batch=1, seq_len=seq, precision="fp32"))
        model, blocks = shallow_copy(model, graph)
        plans = probe_plans(graph, seq, blocks)
        routing = _routing(graph)
        run = bool(plans) and _run_on_fake_group(model, single, args, kwargs, routing) is None
        folded = _folded_heads(graph)
        heads = _attention_heads(graph) | _written_out_heads(graph) | _mha_heads(model) | folded

        def probe(plan: Plan, run_axis: bool) -> str | None:
            return (_cp_positions_problem(model, plan.cp_modules, heads) if plan.cp > 1 else None) or \
                _run_on_fake_group(model, plan, args, kwargs, routing, run_axis,
                                   heads if plan.tp > 1 else frozenset(), bool(folded))

        _CACHE[key] = {}
        for axis, plan in plans.items():
            if axis == "pp_tp" and (_CACHE[key].get("tp") or _CACHE[key].get("pp")):
                continue  # each refused alone: the pair says nothing more
            # an EP step moves tokens by exchanged counts, which balanced values cannot model
            run_axis = run and not (axis == "ep" and routing is not None)
            if plan.tp > 1 and _CACHE[key].get("sp"):
                plan = plan.with_(sequence_parallel=False)
            reason = probe(plan, run_axis)
            degrees = ("pp", "tp") if axis == "pp_tp" else (axis.partition("_")[0],)
            probed = " ".join(f"{d}={getattr(plan, d)}" for d in degrees)
            if axis == "tp" and reason and plan.parallel.sequence_parallel \
                    and probe(plan.with_(sequence_parallel=False), run_axis) is None:
                # the model's own code between its blocks cannot take a sequence shard
                # (positions added to it, tokens flattened by the full width): TP without SP
                _CACHE[key]["sp"], reason = f"(probed at {probed} with SP) {reason}", None
            _CACHE[key][axis] = reason and f"(probed at {probed}) {reason}"
    return dict(_CACHE[key])


def add_capability_facts(graph: ModelGraph, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Record on the graph the axes the runtime refuses (`graph.refused`) and the probe's time."""
    start = time.perf_counter()
    results = probe_capabilities(graph, model, args, kwargs)
    graph.refused = {axis: reason for axis, reason in results.items() if reason}
    if graph.sp_problem and graph.tensor_parallel:  # read off the facts, not probed
        graph.refused.setdefault("sp", graph.sp_problem)
    if graph.cp_problem and graph.context_parallel:
        graph.refused["cp"] = graph.cp_problem
    graph.capability_probe_s = time.perf_counter() - start
