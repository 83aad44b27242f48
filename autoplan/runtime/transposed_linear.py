"""Tensor parallelism for transformers' Conv1D (GPT-1, GPT-2): a linear whose weight is stored
transposed, (in, out), computing y = x @ W + b with `torch.addmm`.

torch's ColwiseParallel and RowwiseParallel accept only nn.Linear (and nn.Embedding), whose
weight is (out, in). A Conv1D's output features are its weight's columns, so column-wise
means weight Shard(1) with the bias Shard(0), and row-wise weight Shard(0) with the bias
replicated. The input and output hooks are torch's own: the forward runs `addmm` and `view`
on DTensors (global shapes, so `self.nf` stays the model's width), which DTensor's sharding
rules compute without communication inside the module.

The plan names the same styles as for nn.Linear ("colwise", "rowwise", "colwise_qkv:H,KV");
the runtime picks these classes by the module it styles, so the planner offers nothing the
runtime does not apply.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from autoplan.runtime.inline_colwise import InlineColwiseParallel


def is_transposed_linear(module: nn.Module) -> bool:
    """transformers' Conv1D, recognised by its name and its (nx, nf) weight, so that the
    runtime and the trace need no transformers import."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and tuple(weight.shape) == (getattr(module, "nx", None),
                                                               getattr(module, "nf", None)))


def output_dim(module: nn.Module, name: str) -> int:
    """The dim of parameter `name` that runs over the module's output features."""
    return 1 if is_transposed_linear(module) and name == "weight" else 0


def output_features(module: nn.Module) -> int:
    return module.nf if is_transposed_linear(module) else module.out_features


def _shard(module: nn.Module, mesh: DeviceMesh, placements: dict[str, object], src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class TransposedColwiseParallel(InlineColwiseParallel):
    """ColwiseParallel for a Conv1D: its output features are weight dim 1 and the bias."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            lambda _, mod, mesh: _shard(mod, mesh, {"weight": Shard(1), "bias": Shard(0)},
                                        self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class TransposedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a Conv1D: its input features are weight dim 0."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _, mod, mesh: _shard(mod, mesh, {"weight": Shard(0), "bias": Replicate()},
                                        self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def for_module(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """`style` as it applies to `module`: torch's column/row style, or its Conv1D form."""
    if not is_transposed_linear(module) or \
            type(style) not in (ColwiseParallel, InlineColwiseParallel, RowwiseParallel):
        return style
    transposed = TransposedRowwiseParallel if type(style) is RowwiseParallel else TransposedColwiseParallel
    out = transposed.__new__(transposed)  # the same layouts, as style_for chose them
    out.__dict__.update(style.__dict__)
    return out
