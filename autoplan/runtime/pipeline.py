"""Pipeline parallelism: split any model at the plan's block boundaries with torch.fx.

Why fx and not `torch.distributed.pipelining.pipeline()`: symbolic_trace with the blocks as
leaf modules is fast on meta, keeps the original parameter names (so checkpoints reshard
between plans with and without PP), keeps each block an ordinary module (so TP styles,
recompute wrappers and FSDP apply to it unchanged), and needs no example inputs. Values
that cross a cut (the hidden state, RoPE tables, masks) become stage outputs/inputs and are
passed through intermediate stages. Hugging Face causal LMs, which fx cannot trace, are split
by `pipeline_hf` instead. Stages are driven by the torch.distributed.pipelining schedules.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                          ScheduleZBVZeroBubble)

from autoplan.errors import UserError
from autoplan.runtime.pipeline_hf import hf_block_paths, hf_split_problem, split_hf_stages
from autoplan.runtime.tying import tied_groups


class _BlockTracer(fx.Tracer):
    def __init__(self, blocks: set[str]) -> None:
        super().__init__()
        self.blocks = blocks
        self.proxy_buffer_attributes = True  # RoPE tables sliced by a traced length

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.blocks or super().is_leaf_module(module, qualified_name)


def _node_stages(graph: fx.Graph, block_stage: dict[str, int], last: int) -> dict[fx.Node, int]:
    """Blocks go to their stage; other nodes to the latest stage among their inputs (so the
    embedding lands on stage 0 and the final norm/head on the last); attribute reads and
    constants to their first consumer."""
    stage: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            stage[node] = 0
        elif node.op == "output":
            stage[node] = last
        elif node.op == "call_module" and node.target in block_stage:
            own = block_stage[node.target]
            before = [stage[a] for a in node.all_input_nodes if a.op != "get_attr"]
            if before and max(before) > own:
                raise UserError(f"pipeline stages are out of order: block {node.target} "
                                f"(stage {own}) runs after a block of stage {max(before)}; "
                                "list the plan's stages in execution order.")
            stage[node] = own
        elif node.op != "get_attr":
            inputs = [stage[a] for a in node.all_input_nodes if a.op != "get_attr"]
            stage[node] = max(inputs) if inputs else -1  # -1: decided by its consumers
    for node in reversed(graph.nodes):
        if stage.get(node, -1) == -1:
            users = [stage[u] for u in node.users if stage.get(u, -1) >= 0]
            stage[node] = min(users) if users else 0
    return stage


def pipeline_split_problem(model: nn.Module, stages: list[list[str]]) -> str | None:
    """None when `split_stages` can cut this (meta) model at `stages`, else the reason."""
    hf_problem = hf_split_problem(model)
    if hf_problem is None:
        listed = [path for paths in stages for path in paths]
        layers = hf_block_paths(model)
        if listed != layers:
            return f"its stages must list {layers[0]} ... {layers[-1]} once each, in order"
        return _tie_across_stages(model, stages)
    try:
        _trace(model, {path for paths in stages for path in paths})
    except UserError as exc:
        return str(exc)
    except Exception as exc:  # any tracing failure means: no fx split for this model
        return (f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc)[:200]}); "
                f"and the split without tracing does not apply: {hf_problem}")
    return _tie_across_stages(model, stages)


def _tie_across_stages(model: nn.Module, stages: list[list[str]]) -> str | None:
    """The reason `split_stages` refuses a parameter shared across stages, else None."""
    if not tied_groups(model):
        return None
    try:
        split_stages(model, stages, torch.arange(1))
    except UserError as exc:
        return str(exc)
    return None


def split_stages(model: nn.Module, stages: list[list[str]], positions: torch.Tensor,
                 zigzag: bool = False) -> list[nn.Module]:
    """One module per (virtual) stage; each holds only its own parameters. `positions`: the
    token positions this rank holds (zig-zag ones under CP), where the stages build their own."""
    if hf_split_problem(model) is None:
        parts = split_hf_stages(model, stages, positions, zigzag)
        _check_disjoint(parts)
        return parts
    graph, stage = _cut(model, stages)
    nodes = list(graph.nodes)
    parts = []
    for k in range(len(stages)):
        mine = [n for n in nodes if stage[n] == k and n.op not in ("placeholder", "output")]
        if k == 0:
            inputs = [n for n in nodes if n.op == "placeholder"]
        else:
            inputs = _live_across(nodes, stage, k - 1)
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for value in inputs:  # the forward's own inputs keep their defaults (see _trace)
            default = value.args[0] if k == 0 and value.args else inspect.Parameter.empty
            env[value] = sub.placeholder(value.name, default_value=default)
        for node in mine:
            env[node] = sub.node_copy(node, lambda a: env[a])
        if k == len(stages) - 1:
            out = next(n for n in nodes if n.op == "output")
            sub.output(fx.node.map_arg(out.args[0], lambda a: env[a]))
        else:
            live = [env[v] for v in _live_across(nodes, stage, k)]
            sub.output(live[0] if len(live) == 1 else tuple(live))
        parts.append(fx.GraphModule(model, sub, class_name=f"Stage{k}"))
    _check_disjoint(parts)
    return parts


def values_handed_on(model: nn.Module, stages: list[list[str]]
                     ) -> tuple[fx.GraphModule, list[list[fx.Node]]] | None:
    """What `split_stages` makes each stage but the last hand on to the next: per cut, the
    nodes of the values live across it, in graph order, and the graph module of the whole
    model they belong to (blocks as leaves). None for a model split without tracing
    (pipeline_hf), whose stages hand on the hidden states alone and build the rest."""
    if hf_split_problem(model) is None:
        return None
    graph, stage = _cut(model, stages)
    nodes = list(graph.nodes)
    return fx.GraphModule(model, graph), [_live_across(nodes, stage, k) for k in range(len(stages) - 1)]


def _cut(model: nn.Module, stages: list[list[str]]) -> tuple[fx.Graph, dict[fx.Node, int]]:
    """The model's graph with the blocks as leaves, and the stage of each of its nodes."""
    block_stage = {path: i for i, paths in enumerate(stages) for path in paths}
    graph = _trace(model, set(block_stage))
    return graph, _node_stages(graph, block_stage, len(stages) - 1)


def _trace(model: nn.Module, blocks: set[str]) -> fx.Graph:
    """The model's graph with `blocks` as leaves, traced as a pipeline calls it: the first
    stage receives the token ids alone, so every other input of the forward takes its default
    (traced as that value: a `position_ids=None` branch runs as the job runs it). A forward
    that needs another input is refused (UserError)."""
    params = list(inspect.signature(model.forward).parameters.values())[1:]
    varargs = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p.name for p in params if p.default is inspect.Parameter.empty and p.kind not in varargs]
    if required:
        raise UserError(
            f"its forward takes {', '.join(required)} besides the token ids (as an encoder-decoder takes "
            "its decoder inputs), and a pipeline hands its first stage the token ids alone")
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return _BlockTracer(blocks).trace(model, concrete_args=defaults or None)


def _live_across(nodes: list[fx.Node], stage: dict[fx.Node, int], cut: int) -> list[fx.Node]:
    """Values made at stage <= cut and read at a stage > cut, in graph order."""
    return [n for n in nodes if n.op != "output" and stage[n] <= cut
            and any(stage[u] > cut for u in n.users)]


def _check_disjoint(parts: list[nn.Module]) -> None:
    """A parameter two stages share (tied embedding and head) would be two parameters on
    two ranks, each updated with its own stage's gradient only: refused."""
    owner: dict[int, tuple[int, str]] = {}
    for k, part in enumerate(parts):
        for name, param in part.named_parameters():
            first, first_name = owner.setdefault(id(param), (k, name))
            if first != k:
                raise UserError(f"pipeline stages {first} and {k} would both use the parameter "
                                f"shared as {first_name} and {name} (tied weights), and the "
                                "pipeline keeps no tie across stages; untie it or keep its "
                                "users on one stage")


def stage_indices(rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """Stages held by pipeline rank `rank`: loop placement, or V placement for ZB-V."""
    if schedule == "zero-bubble" and vpp == 2:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(vpp)]


def build_schedule(stages: list[PipelineStage], schedule: str, num_microbatches: int,
                   loss_fn: Callable, vpp: int):
    """The torch.distributed.pipelining schedule for the plan's name."""
    if schedule == "zero-bubble":
        cls = ScheduleZBVZeroBubble if vpp == 2 else ScheduleInterleavedZeroBubble
        return cls(stages, num_microbatches, loss_fn=loss_fn)
    if vpp > 1 or schedule == "interleaved-1f1b":
        cls = ScheduleLoopedBFS if schedule == "gpipe" else ScheduleInterleaved1F1B
        return cls(stages, num_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], num_microbatches, loss_fn=loss_fn)


def make_stages(parts: list[nn.Module], indices: list[int], num_stages: int,
                device: torch.device, group) -> list[PipelineStage]:
    return [PipelineStage(part, index, num_stages, device, group=group)
            for part, index in zip(parts, indices)]
