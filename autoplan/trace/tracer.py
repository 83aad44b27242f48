"""Trace a model with torch.fx on the meta device into a ModelGraph.

How: (1) find the repeated blocks (children of a ModuleList/Sequential sharing a
structure); (2) fx-trace the root with every block as a leaf, and each block group's
first copy on its own; a module whose code fx cannot trace (data-dependent MoE routing)
becomes a leaf costed from its structure (`fallback.py`); (3) run the graphs on meta
tensors in bf16, one node at a time, counting FLOPs with FlopCounterMode and the bytes
autograd saves for backward with saved-tensor hooks. Copies of a block reuse the first
copy's numbers, so an 80-layer model costs about one layer. (4) `facts.py` adds the
parallelism facts (TP pairs and styles, CP attention modules, EP MoE modules).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from autoplan.errors import UserError
from autoplan.trace.fallback import fallback_op
from autoplan.trace.graph import ModelGraph, OpInfo
from autoplan.trace.ops import classify, gemm_mnk, tensor_bytes
from autoplan.trace.blocks import build_segments, find_block_groups

TRACE_DTYPE = torch.bfloat16


class _Tracer(fx.Tracer):
    """fx tracer with extra leaf modules; remembers the innermost module that failed."""

    def __init__(self, leaves: set[str], prefix: str) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers sliced by a traced length (RoPE tables)
        self.leaves = leaves
        self.prefix = prefix
        self.failed: tuple[str, BaseException] | None = None

    def _full(self, path: str) -> str:
        return ".".join(p for p in (self.prefix, path) if p)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self._full(qualname) in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if self.failed is None:
                self.failed = (self._full(self.path_of_module(m)), exc)
            raise


def _trace_with_fallbacks(root: nn.Module, prefix: str, leaves: set[str],
                          fallbacks: list[str]) -> fx.GraphModule:
    """Trace `root`; every module that breaks tracing becomes a fallback leaf, then retry."""
    while True:
        tracer = _Tracer(leaves | set(fallbacks), prefix)
        try:
            graph = tracer.trace(root)
            return fx.GraphModule(root, graph)
        except Exception as exc:
            failed = tracer.failed
            if failed is None or failed[0] == prefix or failed[0] in fallbacks:
                where = failed[0] if failed else prefix
                raise UserError(
                    f"cannot trace the forward of {where or 'the root module'}: "
                    f"{type(exc).__name__}: {exc}. autoplan traces with torch.fx on the meta "
                    "device; move data-dependent code (branches on tensor values, .item(), "
                    ".tolist()) into a submodule so it can be costed from its structure, or "
                    "give a config.json of a supported family."
                ) from exc
            fallbacks.append(failed[0])


@dataclass
class _Recorder:
    """Collects OpInfo per node while the interpreter runs."""

    ops: list[OpInfo] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(default_factory=list)
    current: str | None = None
    saved: dict[str, int] = field(default_factory=dict)
    saved_quadratic: dict[str, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    keep: list[torch.Tensor] = field(default_factory=list)
    seq_len: int = 0
    suspend: int = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if self.current is None or self.suspend or id(base) in self.seen:
            return tensor
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return tensor  # weights are not activations
        self.seen.add(id(base))
        self.keep.append(base)
        nbytes = tensor_bytes(base)
        self.saved[self.current] = self.saved.get(self.current, 0) + nbytes
        if base.dim() >= 2 and base.shape[-1] == base.shape[-2] == self.seq_len:
            self.saved_quadratic[self.current] = self.saved_quadratic.get(self.current, 0) + nbytes
        return tensor


def _is_dropout(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        sub = root.get_submodule(str(node.target))
        return isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0 and sub.training
    if getattr(node.target, "__name__", "") == "dropout":
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return bool(training) and not (isinstance(p, (int, float)) and p == 0)
    return False


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _NodeFailed(Exception):
    """A node that cannot run on meta tensors (data-dependent op); names its owning module."""

    def __init__(self, module: str, node: str, error: BaseException) -> None:
        super().__init__(f"{node} in {module or 'the root module'}: {type(error).__name__}: {error}")
        self.module, self.node, self.error = module, node, error


class _CostInterpreter(fx.Interpreter):
    """Runs a GraphModule on meta tensors, recording one OpInfo per node."""

    def __init__(self, gm: fx.GraphModule, prefix: str, rec: _Recorder, counter: FlopCounterMode,
                 block_runner, fallbacks: set[str]) -> None:
        super().__init__(gm)
        self.prefix, self.rec, self.counter = prefix, rec, counter
        self.block_runner, self.fallbacks = block_runner, fallbacks

    def _path(self, target: str) -> str:
        return ".".join(p for p in (self.prefix, target) if p)

    def run_node(self, node: fx.Node):
        if node.op in ("placeholder", "output", "get_attr"):
            return super().run_node(node)
        name = self._path(node.name)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        inputs = _tensors((args, kwargs))
        if node.op == "call_module":
            path = self._path(str(node.target))
            if self.block_runner.is_block(path):
                return self.block_runner.run(path, self.fetch_attr(node.target), args, kwargs, name)
            if path in self.fallbacks:
                op, result = fallback_op(name, path, self.fetch_attr(node.target), inputs,
                                         self.rec.seq_len)
                self._record(node, op, inputs)
                return result
        before = self.counter.get_total_flops()
        self.rec.current = name
        fused_attention = classify(node, "", None) == "attention" and node.op == "call_function"
        dropout = _is_dropout(node, self.module)
        self.rec.suspend += fused_attention or dropout
        try:
            result = super().run_node(node)
        except _NodeFailed:
            raise
        except Exception as exc:
            raise _NodeFailed(self._owner(node)[0], name, exc) from exc
        finally:
            self.rec.suspend -= fused_attention or dropout
        if fused_attention:
            self._save_like_flash_attention(inputs, result)
        if dropout and torch.is_grad_enabled() and _tensors(result) and _tensors(result)[0].requires_grad:
            # GPU dropout (native_dropout) saves a 1-byte mask; CPU/meta save a float one
            out = _tensors(result)[0]
            self.rec.saved[name] = self.rec.saved.get(name, 0) + out.numel()
            if out.dim() >= 2 and out.shape[-1] == out.shape[-2] == self.rec.seq_len:
                self.rec.saved_quadratic[name] = self.rec.saved_quadratic.get(name, 0) + out.numel()
        self.rec.current = None
        flops = self.counter.get_total_flops() - before
        module, target = self._owner(node)
        kind = classify(node, target, self.module if node.op == "call_module" else None)
        out = _tensors(result)
        op = OpInfo(
            name=name, module=module, kind=kind, target=target,
            input_shapes=tuple(_shape(t) for t in inputs),
            output_shape=_shape(out[0]) if out else (),
            dtype=str(out[0].dtype).replace("torch.", "") if out else "",
            parameters=self._leaf_parameters(node),
            flops=flops,
            elementwise_flops=sum(t.numel() for t in out) if kind in ("elementwise", "norm") else 0,
            bytes_read=sum(tensor_bytes(t) for t in inputs),
            bytes_written=sum(tensor_bytes(t) for t in out),
            saved_bytes=self.rec.saved.get(name, 0),
            gemm_mnk=gemm_mnk(kind, inputs, out, flops),
        )
        self._record(node, op, inputs)
        return result

    def _save_like_flash_attention(self, inputs: list[torch.Tensor], result) -> None:
        """SDPA on meta runs the math kernel, which saves the (seq x seq) probabilities.
        Training kernels (FlashAttention, cuDNN, memory-efficient) save q, k, v, the output
        and the fp32 log-sum-exp per row (Dao et al. 2022, Alg. 2); count those instead."""
        for tensor in inputs[:3] + _tensors(result)[:1]:
            self.rec.pack(tensor)
        q = inputs[0]
        lse_bytes = q.numel() // q.shape[-1] * 4
        self.rec.saved[self.rec.current] = self.rec.saved.get(self.rec.current, 0) + lse_bytes

    def _record(self, node: fx.Node, op: OpInfo, inputs) -> None:
        self.rec.ops.append(op)
        for arg in node.all_input_nodes:
            if arg.op not in ("placeholder", "get_attr"):
                self.rec.edges.append((self._path(arg.name), op.name))

    def _owner(self, node: fx.Node) -> tuple[str, str]:
        if node.op == "call_module":
            sub = self.fetch_attr(node.target)
            return self._path(str(node.target)), type(sub).__name__
        stack = node.meta.get("nn_module_stack") or {}
        inner = list(stack.values())[-1][0] if stack else ""
        target = getattr(node.target, "__name__", str(node.target))
        return self._path(inner), target

    def _leaf_parameters(self, node: fx.Node) -> int:
        if node.op != "call_module":
            return 0
        return sum(p.numel() for p in self.fetch_attr(node.target).parameters())


class _BlockRunner:
    """Interprets the first copy of each block group; later copies reuse its output shape."""

    def __init__(self, groups: dict[str, str], rec: _Recorder, counter: FlopCounterMode,
                 fallbacks: list[str]) -> None:
        self.groups = groups  # block path -> group name
        self.rec, self.counter, self.fallbacks = rec, counter, fallbacks
        self.first_path: dict[str, str] = {}
        self.outputs: dict[tuple, object] = {}

    def is_block(self, path: str) -> bool:
        return path in self.groups

    def run(self, path: str, module: nn.Module, args, kwargs, node_name: str):
        group = self.groups[path]
        key = (group, tuple(_shape(t) for t in _tensors((args, kwargs))))
        if key in self.outputs:
            return _fresh_like(self.outputs[key])
        self.first_path.setdefault(group, path)
        if path in self.fallbacks:  # the whole block is data-dependent
            op, result = fallback_op(node_name, path, module, _tensors((args, kwargs)), self.rec.seq_len)
            self.rec.ops.append(op)
            self.outputs[key] = result
            return result
        gm = _trace_with_fallbacks(module, path, set(), self.fallbacks)
        interp = _CostInterpreter(gm, path, self.rec, self.counter, self, set(self.fallbacks))
        result = interp.run(*args, **kwargs)
        self.outputs[key] = result
        return result


def _fresh_like(value):
    if isinstance(value, torch.Tensor):
        out = torch.empty(value.shape, dtype=value.dtype, device="meta")
        return out.requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh_like(v) for v in value)
    return value


def fingerprint(module: nn.Module) -> str:
    """sha256 over parameter names, shapes and dtypes (independent of values)."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return digest.hexdigest()[:16]


def trace_model(module: nn.Module, example_inputs: tuple, *, name: str = "") -> ModelGraph:
    """Trace `module` (parameters on meta) called with `example_inputs` into a ModelGraph."""
    from autoplan.trace.capability import add_capability_facts
    from autoplan.trace.facts import add_parallelism_facts

    module = module.to(device="meta", dtype=TRACE_DTYPE)
    inputs = tuple(_to_meta(x) for x in example_inputs)
    batch, seq = _batch_and_seq(inputs)
    groups = find_block_groups(module)
    block_of = {path: group for group, paths in groups.items() for path in paths}
    fallbacks: list[str] = []
    while True:  # each data-dependent module found at run time becomes a fallback; start over
        gm = _trace_with_fallbacks(module, "", set(block_of), fallbacks)
        rec = _Recorder(seq_len=seq)
        try:
            with FlopCounterMode(display=False) as counter:
                runner = _BlockRunner(block_of, rec, counter, fallbacks)
                interp = _CostInterpreter(gm, "", rec, counter, runner, set(fallbacks))
                with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), \
                        torch.enable_grad():
                    interp.run(*inputs)
            break
        except _NodeFailed as failed:
            if not failed.module or failed.module in fallbacks:
                raise UserError(
                    f"the forward of {failed.module or 'the root module'} fails on the meta device "
                    f"at {failed.node}: {type(failed.error).__name__}: {failed.error}. Make the "
                    "model's forward run on meta tensors (no .item()/.tolist() at the top level), "
                    "or give example_inputs(batch_size, seq_len) that match its forward."
                ) from None
            fallbacks.append(failed.module)
    graph = nx.DiGraph()
    for op in rec.ops:
        graph.add_node(op.name, op=op)
    graph.add_edges_from((a, b) for a, b in rec.edges if a in graph and b in graph)
    segments, layer_order = build_segments(module, rec, groups, runner.first_path, block_of)
    params = sum(p.numel() for p in module.parameters())
    emb = sum(p.numel() for m in module.modules() if isinstance(m, nn.Embedding)
              for p in m.parameters(recurse=False))
    model_graph = ModelGraph(
        graph=graph, segments=segments, layer_order=layer_order, batch_size=batch, seq_len=seq,
        dtype_bytes=torch.finfo(TRACE_DTYPE).bits // 8, parameters=params,
        embedding_parameters=emb, vocab=_vocab(module), fallback_modules=_outermost(fallbacks, block_of, runner.first_path),
        fingerprint=fingerprint(module), model_name=name,
    )
    add_parallelism_facts(model_graph, module, gm, groups, runner.first_path, rec.edges)
    add_capability_facts(model_graph, module, inputs)
    return model_graph


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            return torch.empty(x.shape, dtype=TRACE_DTYPE, device="meta")
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _batch_and_seq(inputs: tuple) -> tuple[int, int]:
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 1, 1
    return int(first.shape[0]), int(first.shape[1]) if first.dim() > 1 else 1


def _vocab(module: nn.Module) -> int:
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    return max((m.num_embeddings for m in embeddings), default=0)


def _outermost(fallbacks: list[str], block_of: dict[str, str], first_path: dict[str, str]) -> list[str]:
    """Fallback modules not nested in another one, for every copy of their block."""
    tops = [f for f in fallbacks if not any(f.startswith(o + ".") for o in fallbacks)]
    result = []
    for path in tops:
        first = next((p for p in first_path.values() if path == p or path.startswith(p + ".")), None)
        if first is None:
            result.append(path)
            continue
        group = block_of[first]
        result += [copy + path[len(first):] for copy, g in block_of.items() if g == group]
    return result


_CONFIG_GRAPHS: dict[tuple[str, int, int], ModelGraph] = {}


def graph_for_config(config: dict, batch_size: int = 1, seq_len: int = 2048) -> ModelGraph:
    """Build the reference model of an HF-style config on meta and trace it (memoised).

    Position tables are sized to at least `seq_len` so a longer training sequence than the
    config's default still traces.
    """
    import json

    from autoplan.models import ConfigError, build_model

    key = (json.dumps(config, sort_keys=True, default=str), batch_size, seq_len)
    if key not in _CONFIG_GRAPHS:
        config = dict(config)
        for field_name in ("max_position_embeddings", "n_positions"):
            if field_name in config or field_name == "max_position_embeddings":
                config[field_name] = max(int(config.get(field_name) or 0), seq_len)
        try:
            with torch.device("meta"):
                module = build_model(config)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
        _CONFIG_GRAPHS[key] = trace_model(module, (tokens,), name=str(config.get("name", "")))
    return _CONFIG_GRAPHS[key]
