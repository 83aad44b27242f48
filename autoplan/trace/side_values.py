"""What each pipeline cut of a model hands on beside the hidden states, as autoplan's runtime
splits it: every value live across the cut (runtime/pipeline.py values_handed_on), such as the
rotary cos/sin tables stage 0 slices from its buffers and every later block reads.

The split is the runtime's own, made with one block per stage, so a plan's cut after any block
is one of these. The values are measured by running the model's graph on meta tensors in its
own dtype, each block passing its input through (a value made outside the blocks does not
depend on what they compute), at the traced batch and sequence length and again at twice the
batch and half the sequence, which tells how each value grows with them.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn as nn

from autoplan.runtime.pipeline import values_handed_on
from autoplan.trace.graph import SideValue


class _BlocksPassThrough(fx.Interpreter):
    """Runs the model's graph with every block returning its first input."""

    def __init__(self, gm: fx.GraphModule, blocks: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.blocks = blocks

    def call_module(self, target, args, kwargs):
        if target in self.blocks:
            return args[0]
        return super().call_module(target, args, kwargs)


def _run(gm: fx.GraphModule, blocks: set[str], args: tuple) -> dict[fx.Node, object]:
    interpreter = _BlocksPassThrough(gm, blocks)
    with torch.enable_grad():
        interpreter.run(*args)
    return interpreter.env


def _resized(args: tuple, batch: int, seq: int, new_batch: int, new_seq: int) -> tuple:
    """The inputs with their batch (dim 0) and sequence (dim 1) sizes replaced."""
    out = []
    for x in args:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            shape = list(x.shape)
            if shape[0] == batch:
                shape[0] = new_batch
            if len(shape) >= 2 and shape[1] == seq:
                shape[1] = new_seq
            x = torch.empty(shape, dtype=x.dtype, device="meta")
        out.append(x)
    return tuple(out)


def _power(elements: int, scaled: int | None, factor: float) -> int:
    """How many times `factor` (the size change) multiplies a value's elements: 1 when an
    input of that size was not run (a model that refuses it), else log_factor(scaled / elements)."""
    if scaled is None or not elements:
        return 1
    return round(math.log(scaled / elements) / math.log(factor))


def _downstream(node: fx.Node) -> set[fx.Node]:
    seen, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def pipeline_side_values(module: nn.Module, args: tuple, layer_paths: list[str], batch: int,
                         seq: int, image: bool) -> list[tuple[SideValue, ...]]:
    """Per cut after layer_paths[k] (k < len - 1): the tensors the runtime's split hands on
    besides the hidden states (the value that flows through block k). `module` on meta in its
    own dtype, `args` its positional inputs at (batch, seq)."""
    if len(layer_paths) < 2:
        return []
    try:
        found = values_handed_on(module, [[path] for path in layer_paths])
    except Exception:  # any tracing failure: the runtime cannot split this model either
        return []
    if found is None:
        return []
    gm, cuts = found
    blocks = set(layer_paths)
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module" and n.target in blocks}
    try:
        base = _run(gm, blocks, args)
    except Exception:  # inputs the model refuses: the trace that follows says why, to the user
        return []
    scaled = {}
    for name, new_batch, new_seq in (("batch", 2 * batch, seq), ("seq", batch, seq // 2)):
        if name == "seq" and (image or seq < 2 or seq % 2):
            continue
        try:
            scaled[name] = _run(gm, blocks, _resized(args, batch, seq, new_batch, new_seq))
        except Exception:  # a model that runs at the traced sizes only
            pass
    out = []
    for path, cut in zip(layer_paths, cuts):
        hidden = _downstream(calls[path]) if path in calls else set()
        values = []
        for node in cut:
            value = base.get(node)
            if node in hidden or not isinstance(value, torch.Tensor):
                continue
            sizes = {name: env[node].numel() if isinstance(env.get(node), torch.Tensor) else None
                     for name, env in scaled.items()}
            values.append(SideValue(
                elements=value.numel(), dtype=str(value.dtype).removeprefix("torch."),
                element_bytes=value.element_size(), requires_grad=value.requires_grad,
                batch_power=_power(value.numel(), sizes.get("batch"), 2),
                seq_power=_power(value.numel(), sizes.get("seq"), 0.5)))
        out.append(tuple(values))
    return out
