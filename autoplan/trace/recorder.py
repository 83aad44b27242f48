"""Trace a model by running its Python: every torch call of the forward, on fake tensors over
the meta device, becomes one node of a torch.fx graph with concrete shapes and the path of
the module that made it (`nn_module_stack`), and one OpInfo with the FLOPs FlopCounterMode
counted for it and the bytes autograd saved for it.

Running the code (rather than symbolically tracing it) is what lets real model code pass:
keyword arguments, output objects (ModelOutput), masks built from shapes, shape arithmetic
(`int(d * frac)`), and Hugging Face code that checks for fake tensors to skip value-dependent
shortcuts. Data-dependent routing runs under `routing.BalancedRouting`.

Only the first copy of each block group runs; the other copies return a fresh tensor of the
first copy's output shape (their numbers are the first copy's), so an 80-layer model costs
about one layer.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from autoplan.trace.fallback import expert_matrices, moe_facts, routes_tokens
from autoplan.trace.graph import OpInfo
from autoplan.runtime.head_inputs import forward_arg_names
from autoplan.runtime.transposed_linear import is_transposed_linear
from autoplan.trace.ops import function_kind, gemm_mnk, shape_of, tensor_bytes, tensors_in
from autoplan.trace.routing import RoutingContext

_NON_ROUTED_GEMM_KINDS = ("linear", "matmul", "moe_router")
_ROUTING_FIELDS = ("tokens", "experts", "top_k", "module", "expert_ids")
_LAYER_KINDS = {"linear", "embedding", "conv", "norm"}
_IN_PLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "add_", "sub_", "mul_", "div_"}
_FLASH_SAVED = {"scaled_dot_product_attention"}


def func_name(func) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith(("r", "i")) and name[1:] in ("add", "sub", "mul", "truediv", "matmul"):
            name = name[1:]
    return name


def _is_dropout_call(name: str, args, kwargs) -> bool:
    if name not in ("dropout", "dropout1d", "dropout2d", "dropout3d"):
        return False
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", args[2] if len(args) > 2 else True)
    return bool(training) and not (isinstance(p, (int, float)) and p == 0)


@dataclass
class ModuleStack:
    """The module path running now, kept by global forward hooks."""

    paths: dict[int, str]
    types: dict[str, str]
    routing: RoutingContext
    stack: list[tuple[str, RoutingContext | None]] = field(default_factory=list)
    routers: dict[int, bool] = field(default_factory=dict)
    recorder: "FunctionRecorder | None" = None  # folds a MoE module's ops when it returns
    routing_start: int = 0  # index of the running MoE module's first op
    routing_module: nn.Module | None = None
    # the model's blocks: a module that holds them is the model around its MoE layers, never
    # one (DBRX's DbrxForCausalLM states the experts' count and top-k for its auxiliary loss)
    block_paths: frozenset[str] = frozenset()

    def current(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def push(self, module: nn.Module, args) -> None:
        path = self.paths.get(id(module), self.current())
        saved = None
        if id(module) in self.paths and not self.routing.experts and self._routes(module):
            experts, top_k = moe_facts(module)
            first = tensors_in(args)
            if first:
                saved = RoutingContext(**{k: getattr(self.routing, k) for k in _ROUTING_FIELDS})
                self.routing.tokens = first[0].numel() // max(int(first[0].shape[-1]), 1)
                self.routing.experts, self.routing.top_k, self.routing.module = experts, top_k, path
                self.routing.expert_ids = frozenset(expert_matrices(module, experts)[1])
                self.routing_start = len(self.recorder.rec.ops) if self.recorder else 0
                self.routing_module = module
        self.stack.append((path, saved))

    def _routes(self, module: nn.Module) -> bool:
        key = id(module)
        if key not in self.routers:
            prefix = f"{self.paths[key]}." if self.paths[key] else ""
            holds_blocks = any(block.startswith(prefix) and block != self.paths[key]
                               for block in self.block_paths)
            self.routers[key] = not holds_blocks and routes_tokens(module)
        return self.routers[key]

    def pop(self) -> None:
        path, saved = self.stack.pop()
        if saved is not None:
            if self.recorder is not None:
                self.recorder.merge_moe(path, self.routing_module, self.routing_start,
                                        self.routing.experts, self.routing.tokens * self.routing.top_k)
            for key in _ROUTING_FIELDS:
                setattr(self.routing, key, getattr(saved, key))

    def module_stack(self) -> dict[str, tuple[str, str]]:
        return {p: (p, self.types.get(p, "")) for p, _ in self.stack if p}


class FunctionRecorder(TorchFunctionMode):
    """Records each torch call as an fx node and an OpInfo (see module doc)."""

    def __init__(self, rec, counter, modules: ModuleStack, model: nn.Module) -> None:
        super().__init__()
        self.rec, self.counter, self.modules = rec, counter, modules
        self.graph = fx.Graph()
        self.node_of: dict[int, fx.Node] = {}
        self.op_of: dict[int, str] = {}
        self.names: dict[str, int] = {}
        self.params = {id(p): n for n, p in model.named_parameters()}
        self.modules_by_path = dict(model.named_modules())
        # GPT-2's Conv1D runs addmm on its transposed weight: a linear, as TP sees it
        self.transposed = {id(m.weight) for m in model.modules() if is_transposed_linear(m)}
        # a Linear's weight transposed by its own forward (Falcon's FalconLinear computes
        # `input @ self.weight.T`): a matmul on it is that Linear's. Held, so that no later
        # tensor takes its id.
        self.weight_transposes: dict[int, torch.Tensor] = {}
        self.buffers = {id(b): n for n, b in model.named_buffers()}
        self.seen_params: set[int] = set()
        self.op_params: dict[str, int] = {}
        self.failed_in: str | None = None  # module whose torch call raised first
        self.renamed: dict[str, str] = {}  # op folded into its MoE module's op

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func_name(func)
        module = self.modules.current()
        op_name = self._unique(".".join(p for p in (module, name) if p))
        inputs = tensors_in((args, kwargs))
        flash = name in _FLASH_SAVED
        dropout = _is_dropout_call(name, args, kwargs)
        before = self.counter.get_total_flops()
        previous, self.rec.current = self.rec.current, op_name
        self.rec.suspend += flash or dropout
        try:
            result = func(*args, **kwargs)
        except BaseException:
            if self.failed_in is None:
                self.failed_in = module
            raise
        finally:
            self.rec.suspend -= flash or dropout
            self.rec.current = previous
        out = tensors_in(result)
        if not out:
            return result
        if flash:
            self._save_like_flash_attention(op_name, inputs, out)
        if dropout and out[0].requires_grad:
            # GPU dropout saves a 1-byte mask per element
            self.rec.saved[op_name] = self.rec.saved.get(op_name, 0) + out[0].numel()
        flops = self.counter.get_total_flops() - before
        self._record(func, name, op_name, module, args, kwargs, inputs, out, flops)
        return result

    def _unique(self, name: str) -> str:
        count = self.names.get(name, 0)
        self.names[name] = count + 1
        return name if count == 0 else f"{name}_{count}"

    def _record(self, func, name, op_name, module, args, kwargs, inputs, out, flops) -> None:
        module_type = self.modules.types.get(module, "")
        kind = function_kind(name, module_type)
        if kind in ("linear", "matmul") and self._reads_expert_weights(inputs):
            kind = "expert"  # routed experts: EP shards them, TP never does
        elif kind == "matmul" and any(id(t) in self.transposed or id(t) in self.weight_transposes
                                      for t in inputs):
            kind = "linear"
        elif self._transposes_own_linear_weight(func, module, inputs):
            self.weight_transposes[id(out[0])] = out[0]
        # the call a layer module makes on its own weights is named by the layer's class,
        # as an fx call_module node is (facts read "Linear", "Embedding")
        target = name
        if kind in _LAYER_KINDS and module_type and any(id(t) in self.params or id(t) in self.weight_transposes
                                                        for t in inputs):
            target = module_type
        parameters = 0
        for t in inputs:
            if id(t) in self.params and id(t) not in self.seen_params:
                self.seen_params.add(id(t))
                parameters += t.numel()
        self.op_params[op_name] = parameters
        op = OpInfo(
            name=op_name, module=module, kind=kind, target=target,
            input_shapes=tuple(shape_of(t) for t in inputs if id(t) not in self.params),
            output_shape=shape_of(out[0]),
            dtype=str(out[0].dtype).replace("torch.", ""),
            parameters=parameters, flops=flops,
            elementwise_flops=sum(t.numel() for t in out) if kind in ("elementwise", "norm") else 0,
            bytes_read=sum(tensor_bytes(t) for t in inputs),
            bytes_written=sum(tensor_bytes(t) for t in out),
            saved_bytes=self.rec.saved.get(op_name, 0),
            gemm_mnk=self._gemm(kind, name, inputs, out, flops),
            writes_input=getattr(func, "__name__", "") in _IN_PLACE,
            parameter_reads=tuple(self.params[id(t)] for t in inputs if id(t) in self.params),
        )
        self.rec.ops.append(op)
        for t in inputs:
            src = self.op_of.get(id(t))
            if src is not None:
                self.rec.edges.append((self.renamed.get(src, src), op_name))
        node = self.graph.call_function(func, *self._fx_args(args, kwargs))
        node.name = op_name.replace(".", "_")
        node.meta["nn_module_stack"] = self.modules.module_stack()
        node.meta["op_name"] = op_name
        node.meta["shape"] = shape_of(out[0])
        for t in out:
            self.op_of[id(t)] = op_name
            self.node_of[id(t)] = node
            self.rec.keep.append(t)
            if t._base is not None and any(t is x for x in inputs):  # written in place into a view
                # (`key[..., :d].copy_(k)` into a `new_empty` tensor): what reads the base later reads this
                self.op_of[id(t._base)] = op_name

    def merge_moe(self, path: str, module: nn.Module, start: int, experts: int, routed: int) -> None:
        """Fold the ops a MoE module ran (ops[start:]) into one op of kind "expert" named by
        the module: its FLOPs and saved bytes are the sum of what was measured; the cost
        model prices routed experts per expert GEMM (M = routed tokens per expert), from
        the module's expert matrices, as Megatron-Core's grouped GEMM runs them."""
        inner = self.rec.ops[start:]
        if not inner:
            return
        del self.rec.ops[start:]
        names = {op.name for op in inner}
        for name in names:
            self.renamed[name] = path
        for key in list(self.op_of):
            if self.op_of[key] in names:
                self.op_of[key] = path
        self.rec.edges[:] = [(self.renamed.get(a, a), self.renamed.get(b, b)) for a, b in self.rec.edges
                             if not (a in names and b in names)]
        quadratic = sum(self.rec.saved_quadratic.pop(n, 0) for n in names)
        if quadratic:
            self.rec.saved_quadratic[path] = quadratic
        matrices, _ = expert_matrices(module, experts)
        gemm = (max(1, routed // max(experts, 1)), *matrices[0]) if matrices else None
        first, last = inner[0], inner[-1]
        others = tuple((*op.gemm_mnk, op.flops) for op in inner
                       if op.kind in _NON_ROUTED_GEMM_KINDS and op.gemm_mnk and op.flops > 0)
        self.rec.ops.append(OpInfo(
            name=path, module=path, kind="expert", target=type(module).__name__,
            input_shapes=first.input_shapes[:1], output_shape=last.output_shape, dtype=last.dtype,
            parameters=sum(op.parameters for op in inner), flops=sum(op.flops for op in inner),
            bytes_read=_numel(first.input_shapes[0]) * 2 if first.input_shapes else 0,
            bytes_written=_numel(last.output_shape) * 2,
            saved_bytes=sum(op.saved_bytes for op in inner), gemm_mnk=gemm, fallback=True,
            inner_gemms=others,
            routed_gemm_output_elements=routed * sum(out for out, _ in matrices),
        ))

    def _gemm(self, kind, name, inputs, out, flops):
        mnk = gemm_mnk(kind, [t for t in inputs if id(t) not in self.params], out, flops)
        experts = self.modules.routing.experts
        if mnk and kind == "expert" and "grouped_mm" in name and experts:
            mnk = (max(1, mnk[0] // experts), mnk[1], mnk[2])  # M: tokens per expert
        return mnk

    def _transposes_own_linear_weight(self, func, module: str, inputs) -> bool:
        """The call reads `.T` of the weight of the nn.Linear (subclass) making it."""
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        return (getattr(func, "__name__", "") == "__get__" and prop in ("T", "mT") and len(inputs) == 1
                and isinstance(self.modules_by_path.get(module), nn.Linear)
                and self.params.get(id(inputs[0])) == ".".join(p for p in (module, "weight") if p))

    def _reads_expert_weights(self, inputs) -> bool:
        experts = self.modules.routing.expert_ids
        return bool(experts) and any(
            id(t) in experts or (t._base is not None and id(t._base) in experts) for t in inputs)

    def _fx_args(self, args, kwargs):
        def convert(value):
            if isinstance(value, torch.Tensor):
                if id(value) in self.node_of:
                    return self.node_of[id(value)]
                key = self.params.get(id(value)) or self.buffers.get(id(value))
                if key is not None:
                    node = self.graph.get_attr(key)
                else:
                    node = self.graph.placeholder(f"input_{len(self.node_of)}")
                    node.meta["shape"] = shape_of(value)
                self.node_of[id(value)] = node
                self.rec.keep.append(value)
                return node
            if isinstance(value, (list, tuple)):
                return type(value)(convert(v) for v in value) if not hasattr(value, "_fields") else value
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            if isinstance(value, (int, float, bool, str, slice, type(None), torch.dtype,
                                  torch.device, torch.Size, torch.memory_format, torch.layout)):
                return value
            return repr(value)

        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    def _save_like_flash_attention(self, op_name, inputs, out) -> None:
        """Training attention kernels (FlashAttention, cuDNN, memory-efficient) save q, k, v,
        the output and the fp32 log-sum-exp per row (Dao et al. 2022, Alg. 2); meta's math
        path would save the (seq x seq) probabilities instead."""
        self.rec.current = op_name
        for tensor in inputs[:3] + out[:1]:
            self.rec.pack(tensor)
        self.rec.current = None
        q = inputs[0]
        self.rec.saved[op_name] = self.rec.saved.get(op_name, 0) + q.numel() // q.shape[-1] * 4


def _numel(shape) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel


def install_module_hooks(stack: ModuleStack):
    """Global forward hooks keeping `stack` current; returns the handles to remove."""
    pre = nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: stack.push(module, args))
    post = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: stack.pop(), always_call=True)
    return pre, post


def record_module_inputs(model: nn.Module, seen: dict[str, list[tuple]]) -> list:
    """Pre-hooks filling `seen` with each module's first call's tensor inputs after the first
    (path -> [(argument name, shape, requires grad)], positional ones named by the forward's
    signature): what the model hands its attention beside the hidden states (a per-head
    bias, facts.py). Returns the handles to remove."""

    def hook(module, args, kwargs, path):
        if path in seen:
            return
        given = list(zip(forward_arg_names(module), args)) + list(kwargs.items())
        tensors = [(n, v) for n, v in given if isinstance(v, torch.Tensor)]
        seen[path] = [(n, tuple(v.shape), bool(v.requires_grad)) for n, v in tensors[1:]]

    return [sub.register_forward_pre_hook(functools.partial(hook, path=path), with_kwargs=True)
            for path, sub in model.named_modules() if path]


def skip_copies(module: nn.Module, block_of: dict[str, str]):
    """Replace the forward of every block copy: the first call per (group, input shapes) runs
    the real forward; later calls return fresh tensors shaped like its output."""
    outputs: dict[tuple, object] = {}
    first_path: dict[str, str] = {}
    originals = []
    for path, group in block_of.items():
        block = module.get_submodule(path)
        original = block.forward

        def forward(*args, _group=group, _path=path, _original=original, **kwargs):
            key = (_group, tuple(shape_of(t) for t in tensors_in((args, kwargs))))
            if key in outputs:
                return fresh_like(outputs[key])
            first_path.setdefault(_group, _path)
            outputs[key] = _original(*args, **kwargs)
            return outputs[key]

        block.forward = forward
        originals.append(block)
    return first_path, originals


def restore_forwards(blocks: list[nn.Module]) -> None:
    for block in blocks:
        if "forward" in block.__dict__:
            del block.forward


def fresh_like(value):
    if isinstance(value, torch.Tensor):
        out = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        return out.requires_grad_(value.requires_grad)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fresh_like(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(fresh_like(v) for v in value)
    if isinstance(value, dict):
        copy = value.copy()
        for key in list(copy.keys()):
            copy[key] = fresh_like(copy[key])
        return copy
    return value

