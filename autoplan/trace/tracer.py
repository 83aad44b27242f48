"""Trace a model on the meta device into a ModelGraph.

How: (1) find the repeated blocks (children of a ModuleList/Sequential sharing a
structure, at any depth); (2) a model torch.fx traces symbolically (autoplan's reference
families) is traced with every block as a leaf, and each block group's first copy on its
own, and the graphs run on meta tensors one node at a time; any other model (keyword
arguments, output objects, shape arithmetic, data-dependent routing, Hugging Face code) is
traced by running its forward on fake meta tensors (`recorder.py`), each torch call one fx
node. Either way FLOPs are counted with FlopCounterMode and the bytes autograd saves for
backward with saved-tensor hooks, in bf16; copies of a block reuse the first copy's numbers,
so an 80-layer model costs about one layer. Data-dependent routing runs with balanced
routing (`routing.py`); the modules that needed it are listed as `fallback_modules`.
(3) `facts.py` adds the parallelism facts (TP pairs and styles, CP attention, EP MoE).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from autoplan.errors import UserError
from autoplan.trace.graph import ModelGraph, OpInfo
from autoplan.runtime.transposed_linear import is_transposed_linear
from autoplan.runtime.model_io import attention_window, logits_of, token_vocab
from autoplan.trace.ops import classify, gemm_mnk, is_norm_type, shape_of, tensor_bytes, tensors_in
from autoplan.trace.autocast import MetaAutocast
from autoplan.trace.blocks import build_segments, execution_order, find_block_groups
from autoplan.trace.recorder import (FunctionRecorder, ModuleStack, fresh_like,
                                     install_module_hooks, record_module_inputs, restore_forwards,
                                     skip_copies)
from autoplan.trace.routing import BalancedRouting, RoutingContext
from autoplan.trace.side_values import pipeline_side_values
from autoplan.trace.capability import add_capability_facts
from autoplan.trace.facts import add_parallelism_facts
from autoplan.models import ConfigError, build_model
from autoplan.models.user_code import USER_MODULE_PREFIX, user_code

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
        full = self._full(qualname)
        if full in self.leaves or is_transposed_linear(m):  # GPT-2's Conv1D: a linear, as TP sees it
            return True
        # fx keeps torch.nn modules whole; one holding blocks (nn.TransformerEncoder) is
        # traced into, or its blocks would never be costed
        if any(leaf.startswith(full + ".") for leaf in self.leaves):
            return False
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if self.failed is None:
                self.failed = (self._full(self.path_of_module(m)), exc)
            raise


class _NotSymbolic(Exception):
    """torch.fx cannot trace (or run on meta) some module; trace by running the code instead."""


def _trace_symbolic(root: nn.Module, prefix: str, leaves: set[str]) -> fx.GraphModule:
    """Symbolically trace `root` with `leaves` as leaf modules."""
    tracer = _Tracer(leaves, prefix)
    try:
        return fx.GraphModule(root, tracer.trace(root))
    except Exception as exc:
        raise _NotSymbolic(f"{tracer.failed[0] if tracer.failed else prefix}: {exc}") from exc


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
    batch: int = 0
    suspend: int = 0
    direct_parameters: bool = False  # OpInfo.parameters are the op's own (run traces)

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
        if self.is_attention_square(base):
            self.saved_quadratic[self.current] = self.saved_quadratic.get(self.current, 0) + nbytes
        return tensor

    def is_attention_square(self, t: torch.Tensor) -> bool:
        """An attention score/probability tensor: (..., heads, seq, seq). A (batch, seq, hidden)
        tensor whose hidden width happens to equal seq (Llama-2-7B at seq 4096) is not one."""
        if self.seq_len <= 1 or t.dim() < 3 or t.shape[-1] != self.seq_len or t.shape[-2] != self.seq_len:
            return False
        return t.dim() >= 4 or t.shape[0] != self.batch


def _is_dropout(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        sub = root.get_submodule(str(node.target))
        return isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0 and sub.training
    if getattr(node.target, "__name__", "") == "dropout":
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return bool(training) and not (isinstance(p, (int, float)) and p == 0)
    return False


class _CostInterpreter(fx.Interpreter):
    """Runs a GraphModule on meta tensors, recording one OpInfo per node."""

    def __init__(self, gm: fx.GraphModule, prefix: str, rec: _Recorder, counter: FlopCounterMode,
                 block_runner) -> None:
        super().__init__(gm)
        self.prefix, self.rec, self.counter = prefix, rec, counter
        self.block_runner = block_runner
        self.parameter_names = {name for name, _ in gm.named_parameters()}

    def _path(self, target: str) -> str:
        return ".".join(p for p in (self.prefix, target) if p)

    def run_node(self, node: fx.Node):
        if node.op in ("placeholder", "output", "get_attr"):
            return super().run_node(node)
        name = self._path(node.name)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        inputs = tensors_in((args, kwargs))
        if node.op == "call_module":
            path = self._path(str(node.target))
            if self.block_runner.is_block(path):
                return self.block_runner.run(path, self.fetch_attr(node.target), args, kwargs)
        before = self.counter.get_total_flops()
        self.rec.current = name
        fused_attention = classify(node, "", None) == "attention" and node.op == "call_function"
        dropout = _is_dropout(node, self.module)
        self.rec.suspend += fused_attention or dropout
        try:
            result = super().run_node(node)
        except _NotSymbolic:
            raise
        except Exception as exc:  # data-dependent code: run it instead
            raise _NotSymbolic(f"{name}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.rec.suspend -= fused_attention or dropout
        if fused_attention:
            self._save_like_flash_attention(inputs, result)
        if dropout and torch.is_grad_enabled() and tensors_in(result) and tensors_in(result)[0].requires_grad:
            # GPU dropout (native_dropout) saves a 1-byte mask; CPU/meta save a float one
            out = tensors_in(result)[0]
            self.rec.saved[name] = self.rec.saved.get(name, 0) + out.numel()
            if self.rec.is_attention_square(out):
                self.rec.saved_quadratic[name] = self.rec.saved_quadratic.get(name, 0) + out.numel()
        self.rec.current = None
        flops = self.counter.get_total_flops() - before
        module, target = self._owner(node)
        kind = classify(node, target, self.module if node.op == "call_module" else None)
        if kind == "elementwise" and node.op != "call_module" and is_norm_type(_innermost_module(node)[1]):
            kind = "norm"  # a norm written out in plain ops, as the recorder counts it
        out = tensors_in(result)
        op = OpInfo(
            name=name, module=module, kind=kind, target=target,
            input_shapes=tuple(shape_of(t) for t in inputs),
            output_shape=shape_of(out[0]) if out else (),
            dtype=str(out[0].dtype).replace("torch.", "") if out else "",
            parameters=self._leaf_parameters(node),
            flops=flops,
            elementwise_flops=sum(t.numel() for t in out) if kind in ("elementwise", "norm") else 0,
            bytes_read=sum(tensor_bytes(t) for t in inputs),
            bytes_written=sum(tensor_bytes(t) for t in out),
            saved_bytes=self.rec.saved.get(name, 0),
            gemm_mnk=gemm_mnk(kind, inputs, out, flops),
            parameter_reads=self._parameter_reads(node),
        )
        self._record(node, op, inputs)
        return result

    def _save_like_flash_attention(self, inputs: list[torch.Tensor], result) -> None:
        """SDPA on meta runs the math kernel, which saves the (seq x seq) probabilities.
        Training kernels (FlashAttention, cuDNN, memory-efficient) save q, k, v, the output
        and the fp32 log-sum-exp per row (Dao et al. 2022, Alg. 2); count those instead."""
        for tensor in inputs[:3] + tensors_in(result)[:1]:
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
        target = getattr(node.target, "__name__", str(node.target))
        return self._path(_innermost_module(node)[0]), target

    def _parameter_reads(self, node: fx.Node) -> tuple[str, ...]:
        """Paths of the parameters a call reads: a leaf module's own, or one fetched by get_attr."""
        if node.op == "call_module":
            return tuple(self._path(f"{node.target}.{n}") for n, _ in self.fetch_attr(node.target).named_parameters())
        return tuple(self._path(str(a.target)) for a in node.all_input_nodes
                     if a.op == "get_attr" and str(a.target) in self.parameter_names)

    def _leaf_parameters(self, node: fx.Node) -> int:
        if node.op != "call_module":
            return 0
        return sum(p.numel() for p in self.fetch_attr(node.target).parameters())


def _innermost_module(node: fx.Node) -> tuple[str, str]:
    """(path, class name) of the innermost module whose forward made `node` ("" when none)."""
    stack = node.meta.get("nn_module_stack") or {}
    path, kind = list(stack.values())[-1] if stack else ("", "")
    return path, kind if isinstance(kind, str) else getattr(kind, "__name__", "")


class _BlockRunner:
    """Interprets the first copy of each block group; later copies reuse its output shape."""

    def __init__(self, groups: dict[str, str], rec: _Recorder, counter: FlopCounterMode) -> None:
        self.groups = groups  # block path -> group name
        self.rec, self.counter = rec, counter
        self.first_path: dict[str, str] = {}
        self.outputs: dict[tuple, object] = {}

    def is_block(self, path: str) -> bool:
        return path in self.groups

    def run(self, path: str, module: nn.Module, args, kwargs):
        group = self.groups[path]
        key = (group, tuple(shape_of(t) for t in tensors_in((args, kwargs))))
        if key in self.outputs:
            return fresh_like(self.outputs[key])
        self.first_path.setdefault(group, path)
        if kwargs:
            raise _NotSymbolic(f"{path} is called with keyword arguments")
        gm = _trace_symbolic(module, path, set())
        interp = _CostInterpreter(gm, path, self.rec, self.counter, self)
        result = interp.run(*args)
        self.outputs[key] = result
        return result


def fingerprint(module: nn.Module) -> str:
    """sha256 over parameter names, shapes and dtypes (independent of values)."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return digest.hexdigest()[:16]


def trace_model(module: nn.Module, example_inputs: tuple | dict, *, name: str = "",
                example_kwargs: dict | None = None, probe_runtime: bool = True,
                user_batch: bool = False, token_labels: bool = False) -> ModelGraph:
    """Trace `module` (parameters on meta) called with `example_inputs` (positional inputs,
    or a dict of keyword inputs) and `example_kwargs` into a ModelGraph.

    Models torch.fx traces symbolically are traced that way; any other model (keyword
    arguments, output objects, shape arithmetic, data-dependent routing, code fx rejects) is
    traced by running its forward (`recorder.py`). Both count FLOPs with FlopCounterMode and
    saved bytes with saved-tensor hooks, on the first copy of each block group.
    `probe_runtime=False` leaves out the capability probe (capability.py): for graphs that
    only cost layouts other runtimes ran, never to choose what autoplan's runtime applies.
    `user_batch`: the inputs are those of the model file's `example_batch`, which the job
    feeds as they are (models/user_batch.py). `token_labels`: the job will train it on next-
    token labels shaped like its token ids, so its logits must be (batch, seq, vocab).
    """
    if not type(module).__module__.startswith(USER_MODULE_PREFIX):  # autoplan's or a library's model
        return _trace_model(module, example_inputs, name=name, example_kwargs=example_kwargs,
                            probe_runtime=probe_runtime, user_batch=user_batch,
                            token_labels=token_labels)
    with user_code(f"tracing the forward of {name or type(module).__name__} (on the meta device)"):
        return _trace_model(module, example_inputs, name=name, example_kwargs=example_kwargs,
                            probe_runtime=probe_runtime, user_batch=user_batch,
                            token_labels=token_labels)


def _refuse_blocks_never_run(module: nn.Module, groups: dict[str, list[str]],
                             first_path: dict[str, str], name: str) -> None:
    """A stack of blocks the forward never calls on the inputs it is trained on (a multimodal
    model's vision tower, given token ids alone) would sit in every plan, costed by nothing
    and trained by no step: refused, naming it."""
    idle = [paths for group, paths in groups.items() if group not in first_path]
    if not idle:
        return
    blocks = sum(len(paths) for paths in idle)
    parameters = sum(p.numel() for paths in idle for path in paths
                     for p in module.get_submodule(path).parameters())
    stacks = ", ".join(sorted({path.rsplit(".", 1)[0] for paths in idle for path in paths}))
    raise UserError(
        f"the forward of {name} never runs {blocks} of its blocks ({stacks}: {parameters:,} "
        f"parameters) on the inputs autoplan trains it on (token ids, or the model file's "
        f"example_batch): every plan would hold them and no step would train them, as with a "
        f"multimodal model's vision tower given text alone. Plan the part that runs: for a "
        f"Hugging Face multimodal config, its language model (a config.json of the fields of its "
        f"\"text_config\", which name the text model's model_type); for a model file, a model "
        f"whose forward calls every block.")


def _refuse_uncosted_blocks(module: nn.Module, segments, name: str) -> None:
    """A trace that left a block with linears no FLOPs, or a segment fewer than no parameters,
    attributed the model's ops to the wrong modules: every plan of it would be costed wrong
    (DBRX's, before the trace knew its experts' layout, cost 0 s a block), so it is refused."""
    wrong = [s.name for s in segments if s.parameters < 0]
    wrong += [s.name for s in segments if s.kind not in ("pre", "post") and s.forward_flops == 0
              and any(isinstance(m, nn.Linear) for m in module.get_submodule(s.paths[0]).modules())]
    if wrong:
        raise UserError(
            f"autoplan's trace of {name} could not attribute its costs to its parts ({', '.join(wrong)}: "
            f"no FLOPs for linears that run, or fewer than no parameters), so every plan of it would "
            f"be costed wrong and none is made. This is a limit of autoplan's trace for this model "
            f"(most often a layout of MoE experts it does not know): please report it with the "
            f"model's config or file.")


def _trace_model(module: nn.Module, example_inputs: tuple | dict, *, name: str,
                 example_kwargs: dict | None, probe_runtime: bool, user_batch: bool = False,
                 token_labels: bool = False) -> ModelGraph:
    if isinstance(example_inputs, dict):
        example_inputs, example_kwargs = (), {**example_inputs, **(example_kwargs or {})}
    module = module.to(device="meta")
    own_dtype_args = tuple(_to_meta(x, dtype=None) for x in example_inputs)
    args = tuple(_to_meta(x) for x in example_inputs)
    kwargs = {k: _to_meta(v) for k, v in (example_kwargs or {}).items()}
    _check_call(module, args, kwargs)
    ids = args[0] if args else kwargs.get("input_ids")
    labels = tuple(ids.shape) if token_labels and isinstance(ids, torch.Tensor) and ids.dim() == 2 \
        and not ids.is_floating_point() else None
    batch, seq, image = input_dims(args, kwargs)
    classes = classifier_width(module, own_dtype_args, {k: _to_meta(v, dtype=None) for k, v in
                                                        (example_kwargs or {}).items()}) if image else 0
    groups = find_block_groups(module)
    block_of = {path: group for group, paths in groups.items() for path in paths}
    order = execution_order(module, block_of)
    # in the model's own dtype, as the runtime hands the values on (its buffers stay fp32)
    side_values = [] if kwargs else pipeline_side_values(module, own_dtype_args, order, batch, seq, bool(image))
    module = module.to(dtype=TRACE_DTYPE)
    with MetaAutocast(TRACE_DTYPE):  # as the job runs a 16-bit plan: under torch.autocast
        try:
            if kwargs:
                raise _NotSymbolic("keyword inputs")
            gm, rec, first_path = _trace_by_fx(module, args, block_of, seq, batch, labels)
            costed_by_routing: list[str] = []
        except _NotSymbolic:
            gm, rec, first_path, costed_by_routing = _trace_by_running(module, args, kwargs, block_of, seq,
                                                                                    batch, labels)
    _refuse_blocks_never_run(module, groups, first_path, type(module).__name__)
    graph = nx.DiGraph()
    for op in rec.ops:
        graph.add_node(op.name, op=op)
    graph.add_edges_from((a, b) for a, b in rec.edges if a in graph and b in graph)
    segments, layer_order = build_segments(module, rec, groups, first_path, block_of)
    _refuse_uncosted_blocks(module, segments, type(module).__name__)
    params = sum(p.numel() for p in module.parameters())
    emb = sum(p.numel() for m in module.modules() if isinstance(m, nn.Embedding)
              for p in m.parameters(recurse=False))
    model_graph = ModelGraph(
        graph=graph, segments=segments, layer_order=layer_order, batch_size=batch, seq_len=seq,
        dtype_bytes=torch.finfo(TRACE_DTYPE).bits // 8, parameters=params,
        embedding_parameters=emb, vocab=token_vocab(module),
        fallback_modules=_outermost(costed_by_routing, block_of, first_path),
        fingerprint=fingerprint(module), model_name=name, image_size=image,
        image_channels=image_channels(args, kwargs) if image else 0,
        num_classes=classes,
        pipeline_side_values=side_values,
        sequence_loops=sequence_loops(rec.ops, seq, module),
        user_batch_inputs=len(args) + len(kwargs) if user_batch else 0,
        user_batch_keywords=user_batch and bool(kwargs),
        attention_window=attention_window(module),
    )
    add_parallelism_facts(model_graph, module, gm, groups, first_path, rec.edges)
    if probe_runtime:
        add_capability_facts(model_graph, module, args, kwargs)
    return model_graph


def _trace_by_fx(module: nn.Module, args: tuple, block_of: dict[str, str], seq: int, batch: int,
                 labels: tuple | None = None):
    """Symbolic fx trace of the root (blocks as leaves) and of each block group's first copy."""
    gm = _trace_symbolic(module, "", set(block_of))
    rec = _Recorder(seq_len=seq, batch=batch)
    with FlopCounterMode(display=False) as counter:
        runner = _BlockRunner(block_of, rec, counter)
        interp = _CostInterpreter(gm, "", rec, counter, runner)
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), torch.enable_grad():
            _check_output(module, interp.run(*args), labels)
    return gm, rec, runner.first_path


def _trace_by_running(module: nn.Module, args: tuple, kwargs: dict, block_of: dict[str, str],
                      seq: int, batch: int, labels: tuple | None = None):
    """Run the forward on fake meta tensors under the recorder (see recorder.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = _Recorder(seq_len=seq, batch=batch, direct_parameters=True)
    routing = RoutingContext()
    paths: dict[int, str] = {}
    for path, sub in module.named_modules():
        paths.setdefault(id(sub), path)
    stack = ModuleStack(paths, {p: type(m).__name__ for p, m in module.named_modules()}, routing,
                        block_paths=frozenset(block_of))
    first_path, blocks = skip_copies(module, block_of)
    module_inputs: dict[str, list[tuple]] = {}
    handles = [*install_module_hooks(stack), *record_module_inputs(module, module_inputs)]
    recorder = None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            fake_args = tuple(_fake(fake, x) for x in args)
            fake_kwargs = {k: _fake(fake, v) for k, v in kwargs.items()}
            with FlopCounterMode(display=False, custom_mapping=grouped_gemm_flops()) as counter, \
                    BalancedRouting(routing):
                recorder = FunctionRecorder(rec, counter, stack, module)
                stack.recorder = recorder
                with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), \
                        torch.enable_grad(), recorder:
                    output = module(*fake_args, **fake_kwargs)
        _check_output(module, output, labels)
    except UserError:
        raise
    except Exception as exc:
        where = (recorder.failed_in if recorder is not None else None) or "the root module"
        raise UserError(
            f"the forward of {where} fails when run on fake meta tensors: "
            f"{type(exc).__name__}: {exc}{_user_frame(exc)}. autoplan runs the model's forward "
            "without weights to measure it; check that the inputs match the forward "
            "(define example_inputs(batch_size, seq_len) in the model file) and that the "
            "forward does not need real values (.numpy(), Python-side data)."
        ) from None
    finally:
        for handle in handles:
            handle.remove()
        restore_forwards(blocks)
    return RecordedGraph(recorder.graph, module, module_inputs), rec, first_path, routing.modules


def _check_output(module: nn.Module, output, labels: tuple | None = None) -> None:
    """A forward that returns no tensor cannot be trained (there is no loss to take); one
    trained on next-token `labels` (their shape) must give a logit row per token."""
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    if isinstance(output, torch.Tensor) or getattr(output, "logits", None) is not None \
            or any(isinstance(item, torch.Tensor) for item in items):
        if labels is not None:
            _check_token_logits(module, tuple(logits_of(output).shape), labels)
        return
    raise UserError(f"the forward of {type(module).__name__} returned {type(output).__name__}, not a tensor: "
                    "return the logits (or an object with .logits, or a tuple or dict holding them), "
                    "which the training loss is taken from")


def _check_token_logits(module: nn.Module, shape: tuple, labels: tuple) -> None:
    """Next-token labels of shape `labels` need logits of (batch, seq, vocab), over every id
    the job draws."""
    if len(shape) == 3 and shape[:2] == labels:
        vocab = token_vocab(module)
        if shape[2] < vocab:
            raise UserError(
                f"the forward of {type(module).__name__} predicts over {shape[2]} tokens, but its "
                f"token embedding reads {vocab}: the job draws every id below {vocab} and takes each "
                f"as a next-token label too, which its logits cannot score. Make the output as wide "
                f"as the token embedding, or the embedding as narrow as the vocabulary the model "
                f"predicts.")
        return
    library = type(module).__module__.split(".")[0]
    file = "" if library.startswith(USER_MODULE_PREFIX) else (
        f" (a {library} class: write a model file whose build_model() returns it)")
    raise UserError(
        f"the forward of {type(module).__name__} returns {shape} for token ids of shape "
        f"{labels}: a model fed token ids is trained on next-token prediction, which takes "
        "logits of (batch, seq, vocab). For another objective (a label per sample, a "
        f"regression), define example_batch(batch_size) in the model file{file} returning "
        "(inputs, labels), and loss(outputs, labels) unless cross-entropy over the "
        "output's last dimension is the loss")


def _check_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The inputs must fit the forward's signature (before any tracing)."""
    import inspect

    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        given = ", ".join([f"{len(args)} positional"] + [f"{k}=" for k in kwargs])
        raise UserError(
            f"the forward of {type(module).__name__}{signature} cannot take the inputs autoplan "
            f"made for it ({given}): {exc}. Define example_inputs(batch_size, seq_len) in the "
            "model file, returning a tuple with one tensor per positional argument or a dict "
            "of keyword arguments."
        ) from None


def _fake(mode, x):
    return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x


def _user_frame(exc: BaseException) -> str:
    """ ' (at file:line)' of the innermost frame outside torch and autoplan, if any."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/autoplan/" not in f.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


class RecordedGraph:
    """The fx graph a run recorded, with the module's buffers (what facts.py reads of a
    GraphModule), without generating Python code for it."""

    def __init__(self, graph: fx.Graph, module: nn.Module, module_inputs: dict[str, list[tuple]]) -> None:
        self.graph, self._module = graph, module
        self.module_inputs = module_inputs  # recorder.record_module_inputs

    def named_buffers(self):
        return self._module.named_buffers()


def grouped_gemm_flops() -> dict:
    """FlopCounterMode formulas for grouped GEMMs (HF experts' `torch._grouped_mm` and its CPU
    fallback op), which it has none for: every row of `a` meets one group's (K, N) matrix,
    2 FLOPs per multiply-add, so 2 * numel(out) * K."""
    def flops(a_shape, b_shape, *_, out_shape=None, **__) -> int:
        return 2 * math.prod(out_shape) * a_shape[-1]

    mapping = {torch.ops.aten._grouped_mm: flops}
    transformers_ops = getattr(torch.ops, "transformers", None)
    if transformers_ops is not None and hasattr(transformers_ops, "grouped_mm_fallback"):
        mapping[transformers_ops.grouped_mm_fallback] = flops
    return mapping


def _to_meta(x, dtype: torch.dtype | None = TRACE_DTYPE):
    """`x` on meta, a floating tensor in `dtype` (None: its own)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and dtype is not None:
            return torch.empty(x.shape, dtype=dtype, device="meta")
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def input_dims(args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """(batch, sequence length, image side) of the first input tensor. An image batch
    (batch, channels, height, width) has no sequence: seq 1, image side = its width."""
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 1, 1, 0
    if first.dim() == 4 and first.is_floating_point():
        return int(first.shape[0]), 1, int(first.shape[-1])
    return int(first.shape[0]), int(first.shape[1]) if first.dim() > 1 else 1, 0


def classifier_width(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """The class count of an image classifier (its output is (batch, classes)), else 0;
    one forward on meta tensors, in the model's own dtype."""
    from autoplan.runtime.model_io import logits_of

    try:
        with torch.no_grad():
            out = logits_of(module(*args, **kwargs))
    except Exception:  # noqa: BLE001 - the trace that follows reports a forward that fails
        return 0
    batch = input_dims(args, kwargs)[0]
    return int(out.shape[1]) if out.dim() == 2 and out.shape[0] == batch else 0


def image_channels(args: tuple, kwargs: dict) -> int:
    first = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
    return int(first.shape[1])


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


_CONFIG_GRAPHS: dict[tuple[str, int, int, bool], ModelGraph] = {}


def sequence_loops(ops, seq_len: int, model: nn.Module) -> list[dict]:
    """Modules that ran more torch ops than twice the sequence's tokens (and at least 64): a
    Python loop over the tokens, as transformers' Mamba runs its selective scan without the
    mamba-ssm kernels. A transformer block's modules run a few dozen ops whatever the length."""
    counts: dict[str, int] = {}
    for op in ops:
        if op.module:
            counts[op.module] = counts.get(op.module, 0) + 1
    return [{"module": path, "class": type(model.get_submodule(path)).__name__, "ops": count}
            for path, count in counts.items() if count > max(64, 2 * seq_len)]


def graph_for_config(config: dict, batch_size: int = 1, seq_len: int = 2048, *,
                     probe_runtime: bool = True) -> ModelGraph:
    """Build the reference model of an HF-style config on meta and trace it (memoised;
    `probe_runtime` as in trace_model).

    Position tables are sized to at least `seq_len` so a longer training sequence than the
    config's default still traces.
    """
    import json

    key = (json.dumps(config, sort_keys=True, default=str), batch_size, seq_len, probe_runtime)
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
        _CONFIG_GRAPHS[key] = trace_model(module, (tokens,), name=str(config.get("name", "")),
                                          probe_runtime=probe_runtime)
    return _CONFIG_GRAPHS[key]
