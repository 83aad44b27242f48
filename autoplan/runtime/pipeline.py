"""Pipeline parallelism: split any model at the plan's block boundaries with torch.fx.

Why fx and not `torch.distributed.pipelining.pipeline()`: symbolic_trace with the blocks as
leaf modules is fast on meta, keeps the original parameter names (so checkpoints reshard
between plans with and without PP), keeps each block an ordinary module (so TP styles,
recompute wrappers and FSDP apply to it unchanged), and needs no example inputs. Values
that cross a cut (the hidden state, RoPE tables, masks) become stage outputs/inputs and are
passed through intermediate stages. Hugging Face causal LMs, which fx cannot trace, are split
by `pipeline_hf` instead. Stages are driven by the torch.distributed.pipelining schedules.

A parameter two stages use (a head tied to the embedding) is kept tied as Megatron-LM keeps
its word embeddings (the "embedding group": `_allreduce_word_embedding_grads` in
megatron/core/distributed/finalize_model_grads.py): each stage holds its own copy, the same
initial value on every rank (materialised from one seed, or loaded from one checkpoint key;
checked at the start, `check_tied_copies`), and after the backward the copies' gradients are
summed over the pipeline ranks holding them (`StageTie`, `TiedCopy`, `sum_tied_grads`), so
every copy takes the same optimizer step.
"""

from __future__ import annotations

import copy
import functools
import inspect
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from autoplan.errors import UserError
from autoplan.runtime.data_parallel import allreduce_grads
from autoplan.runtime.mesh import local_part
from autoplan.runtime.pipeline_hf import hf_block_paths, hf_split_problem, split_hf_stages
from autoplan.runtime.tying import model_fqn, tied_groups

if TYPE_CHECKING:  # imported where a pipeline is built (build_schedule, _stage_class)
    from torch.distributed.pipelining import PipelineStage


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
        return None
    try:
        _trace(model, {path for paths in stages for path in paths})
    except UserError as exc:
        return str(exc)
    except Exception as exc:  # any tracing failure means: no fx split for this model
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None):  # fx's error on transformers' code says nothing to its user
            kind = " (an encoder-decoder, whose every decoder stage reads the encoder's output)" \
                if getattr(config, "is_encoder_decoder", False) else ""
            return f"torch.fx cannot trace transformers' forward, and {hf_problem}{kind}"
        return (f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc)[:200]}); "
                f"and the split without tracing does not apply: {hf_problem}")
    return None


def split_stages(model: nn.Module, stages: list[list[str]], positions: torch.Tensor,
                 zigzag: bool = False) -> list[nn.Module]:
    """One module per (virtual) stage; each holds only its own parameters. `positions`: the
    token positions this rank holds (zig-zag ones under CP), where the stages build their own."""
    if hf_split_problem(model) is None:
        return split_hf_stages(model, stages, positions, zigzag)
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
            # p2p sends need contiguous tensors, and a stage may end on a transposed view
            # (a ViT's patches, flatten(2).transpose(1, 2), plus a residual keep its strides)
            live = [sub.call_function(_contiguous, (env[v],)) for v in _live_across(nodes, stage, k)]
            sub.output(live[0] if len(live) == 1 else tuple(live))
        parts.append(fx.GraphModule(model, sub, class_name=f"Stage{k}"))
    return parts


def _contiguous(value):
    return value.contiguous() if isinstance(value, torch.Tensor) else value


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


def stage_indices(rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """Stages held by pipeline rank `rank`: loop placement, or V placement for ZB-V."""
    if schedule == "zero-bubble" and vpp == 2:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(vpp)]


def build_schedule(stages: list[PipelineStage], schedule: str, num_microbatches: int,
                   loss_fn: Callable, vpp: int):
    """The torch.distributed.pipelining schedule for the plan's name."""
    # imported here: torch.distributed.pipelining costs each rank ~0.6 s of CPU to import,
    # which a job without a pipeline never needs
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                              ScheduleZBVZeroBubble)

    if schedule == "zero-bubble":
        cls = ScheduleZBVZeroBubble if vpp == 2 else ScheduleInterleavedZeroBubble
        return cls(stages, num_microbatches, loss_fn=loss_fn)
    if vpp > 1 or schedule == "interleaved-1f1b":
        cls = ScheduleLoopedBFS if schedule == "gpipe" else ScheduleInterleaved1F1B
        return cls(stages, num_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], num_microbatches, loss_fn=loss_fn)


@functools.cache
def _stage_class() -> type:
    """PipelineStage, with a shape-inference forward that leaves the stage's buffers as they
    were (imported on first use, as build_schedule's schedules).

    On the first step torch runs each stage once to learn the shapes it sends (in torch
    2.13 through `_compute_outputs`, which nothing else calls), on the real first
    micro-batch at stage 0 and on uninitialised tensors after it. A BatchNorm would count
    that forward in its running statistics, and take them from the garbage on later stages."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _compute_outputs(self, *args, module: nn.Module, **kwargs):
            # the forward runs on copies, put back afterwards: restoring values in place would
            # change tensors the inference graph saved for its backward (also run once)
            owners = [(owner, name, buf) for owner in module.modules()
                      for name, buf in owner._buffers.items() if buf is not None]
            for owner, name, buf in owners:
                owner._buffers[name] = buf.clone()
            try:
                return super()._compute_outputs(*args, module=module, **kwargs)
            finally:
                for owner, name, buf in owners:
                    owner._buffers[name] = buf

    return _Stage


def make_stages(parts: list[nn.Module], indices: list[int], num_stages: int,
                device: torch.device, group) -> list[PipelineStage]:
    stage = _stage_class()
    return [stage(part, index, num_stages, device, group=group)
            for part, index in zip(parts, indices)]


# -- parameters shared across stages ---------------------------------------------------------

@dataclass(frozen=True)
class StageTie:
    """A parameter several pipeline stages use: `name`, the model's own (the first of its
    names, under which an unsplit model's optimizer state keeps it), and for each stage that
    uses it, (stage index, the name it has in that stage), in stage order."""

    name: str
    users: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> list[int]:
        return [stage for stage, _ in self.users]


def stage_ties(model: nn.Module, parts: list[nn.Module]) -> list[StageTie]:
    """The parameters of `model` that more than one of its stage modules `parts` use."""
    ties = []
    for group in tied_groups(model):
        users = []
        for k, part in enumerate(parts):
            held = {name for name, _ in part.named_parameters(remove_duplicate=False)}
            names = [name for name in group if name in held]
            if names:
                users.append((k, names[0]))
        if len(users) > 1:
            ties.append(StageTie(group[0], tuple(users)))
    return ties


def stage_aliases(ties: list[StageTie], stage_ids: list[int]) -> list[dict[str, str]]:
    """Per stage of `stage_ids`: the names its copies of shared parameters have there -> the
    model's own name of each (where they differ), under which checkpoints keep their
    optimizer state."""
    return [{name: tie.name for tie in ties for stage, name in tie.users
             if stage == stage_id and name != tie.name} for stage_id in stage_ids]


def stage_ranks(pp: int, vpp: int, schedule: str) -> dict[int, int]:
    """Stage index -> the pipeline rank holding it."""
    return {stage: rank for rank in range(pp) for stage in stage_indices(rank, pp, vpp, schedule)}


def untie_on_one_rank(ties: list[StageTie], parts: list[nn.Module], stage_ids: list[int]) -> None:
    """Give each of this rank's stages its own copy of a parameter it shares with another of
    them (the V placement of zero-bubble puts the first and the last stage on one pipeline
    rank): a stage's parameters must be its own, as each stage divides its gradients by the
    micro-batch count at the end of the step (PipelineStage.scale_grads) and FSDP shards each
    stage's root on its own. The copy is a clone of the first stage's value, owned by a
    shallow copy of the module holding it (so a module both stages run, such as a shared
    norm, keeps the first stage's parameter there)."""
    for tie in ties:
        held = [(stage, name) for stage, name in tie.users if stage in stage_ids]
        for stage, name in held[1:]:
            part = parts[stage_ids.index(stage)]
            path, _, attr = name.rpartition(".")
            parent_path, _, child = path.rpartition(".")
            parent = part.get_submodule(parent_path) if path else None
            owner = copy.copy(part.get_submodule(path))
            owner._parameters = dict(owner._parameters)
            source = owner._parameters[attr]
            owner._parameters[attr] = nn.Parameter(source.detach().clone(), source.requires_grad)
            if parent is None:  # a parameter of the stage module itself
                part._parameters = owner._parameters
            else:
                setattr(parent, child, owner)


@dataclass
class TiedCopy:
    """This rank's copy of a shared parameter other stages hold copies of. `name`: the
    model's name of it; `group`: the pipeline ranks holding a copy at this rank's dp/tp/cp
    coordinates (None when this rank holds them all); `counted`: this copy is the first
    stage's, the one the global gradient norm counts (the others hold the same summed
    gradient, as Megatron-LM's grad norm skips the `shared` copy of its embedding)."""

    name: str
    param: nn.Parameter
    group: dist.ProcessGroup | None
    counted: bool


def tied_copies(ties: list[StageTie], parts: list[nn.Module], stage_ids: list[int],
                rank_of: dict[int, int], world) -> list[TiedCopy]:
    """This rank's copies of the `ties`. `parts`: this rank's stage modules (after every
    wrapper), of stages `stage_ids`; `world`: the world DeviceMesh, pp its first axis. Every
    rank must call it: it creates the groups of pipeline ranks holding copies where they are
    not the whole pp axis."""
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    copies = []
    for tie in ties:
        ranks = tuple(sorted({rank_of[stage] for stage in tie.stages}))
        if ranks not in groups:
            groups[ranks] = _pipeline_subgroup(world, ranks)
        for stage, name in tie.users:
            if stage in stage_ids:
                param = model_named_parameters(parts[stage_ids.index(stage)])[name]
                copies.append(TiedCopy(tie.name, param, groups[ranks], stage == tie.stages[0]))
    return copies


def _pipeline_subgroup(world, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The group of pipeline ranks `ranks` at this rank's other coordinates: the pp axis's
    group when they are all of it, else one new group per column of the other axes (created
    on every rank in one order, as dist.new_group requires); None when this rank is in none,
    or is the only one."""
    if len(ranks) == 1:
        return None
    if len(ranks) == world.size(0):
        return world["pp"].get_group()
    columns = world.mesh.reshape(world.size(0), -1)[list(ranks)].T.tolist()
    mine = None
    for column in columns:
        group = dist.new_group(column)
        if dist.get_rank() in column:
            mine = group
    return mine


def model_named_parameters(part: nn.Module) -> dict[str, nn.Parameter]:
    """A stage module's parameters by their names in the model (wrappers' levels removed)."""
    return {model_fqn(name): param
            for name, param in part.named_parameters(remove_duplicate=False)}


def check_tied_copies(copies: list[TiedCopy]) -> None:
    """Refuse copies of a shared parameter that differ in layout or in value. Laid out
    differently (TP styles that shard the embedding and the head differently), summing their
    local gradients would add unrelated rows; with different values (a model whose
    initialisation is not the same on every rank), they would never become one parameter.
    This rank's copies are compared here; with the other ranks' through one MAX all-reduce of
    (x, -x), x: the layout and two checksums of the values, per shared parameter over its
    group: every rank of the group sees the same result, so all of them raise."""
    for name, mine in _by_tie(copies).items():
        if is_fake(local_part(mine[0].param)):  # a dry run: one process stands for every rank
            continue
        signatures = [_signature(c.param) for c in mine]
        layouts_differ = len({sig[:3] for sig in signatures}) > 1
        values_differ = len(set(signatures)) > 1 and not layouts_differ
        if mine[0].group is not None:
            code = torch.tensor(signatures[0], dtype=torch.float64, device=local_part(mine[0].param).device)
            both = torch.cat([code, -code])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mine[0].group)
            highest, lowest = both[:len(code)], -both[len(code):]
            layouts_differ |= not torch.equal(highest[:3], lowest[:3])
            values_differ |= not layouts_differ and not torch.equal(highest, lowest)
        if layouts_differ:
            described = ", ".join(f"{c.param.__class__.__name__} {_placements(c.param)} "
                                  f"{tuple(local_part(c.param).shape)}" for c in mine)
            raise UserError(f"the shared (tied) parameter {name} is sharded differently on the "
                            f"pipeline stages using it (this rank's copies: {described}; another "
                            "copy is laid out otherwise), so their gradients cannot be summed; give "
                            "the embedding and the head the same TP sharding (vocab_embedding with "
                            "vocab_head) or leave both whole")
        if values_differ:
            raise UserError(f"the copies of the shared (tied) parameter {name} on the pipeline "
                            "stages using it start with different values: the model is not "
                            "initialised alike on every rank. Initialise it from torch's default "
                            "generator (the runtime seeds it the same on every rank), not from the "
                            "rank or another source")


def _by_tie(copies: list[TiedCopy]) -> dict[str, list[TiedCopy]]:
    """This rank's copies grouped by the shared parameter's name."""
    by_tie: dict[str, list[TiedCopy]] = {}
    for copy_ in copies:
        by_tie.setdefault(copy_.name, []).append(copy_)
    return by_tie


def _placements(param) -> str:
    return str(tuple(map(str, param.placements))) if hasattr(param, "placements") else "whole"


def _signature(param) -> tuple[float, ...]:
    """The local shard's size and first dimension, a checksum of the placements, and the sum
    and the sum of squares of its values (float64: equal copies give equal sums)."""
    local = local_part(param).detach()
    values = local.double()
    return (float(local.numel()), float(local.shape[0] if local.dim() else 1),
            float(zlib.crc32(_placements(param).encode())), float(values.sum()),
            float(values.square().sum()))


def sum_tied_grads(copies: list[TiedCopy]) -> None:
    """Sum the gradients of each shared parameter's copies: this rank's copies first, then
    over the ranks holding copies (one flat all-reduce per group of the local shards under
    FSDP/TP, which have the same layout on every rank of the group: check_tied_copies), and
    every copy takes the sum. After the backward (and the data-parallel reduction), before
    clipping and the optimizer step, as Megatron-LM's finalize_model_grads."""
    for copy_ in copies:
        if copy_.param.grad is None:  # a stage whose use got no gradient still takes part
            copy_.param.grad = torch.zeros_like(copy_.param)
    by_tie = _by_tie(copies)
    by_group: dict[int, tuple[dist.ProcessGroup, list[nn.Parameter]]] = {}
    for mine in by_tie.values():
        first = local_part(mine[0].param.grad)
        for other in mine[1:]:
            first.add_(local_part(other.param.grad))
        if mine[0].group is not None:
            by_group.setdefault(id(mine[0].group), (mine[0].group, []))[1].append(mine[0].param)
    for group, params in by_group.values():
        allreduce_grads(params, group, 1)
    for mine in by_tie.values():
        for other in mine[1:]:
            local_part(other.param.grad).copy_(local_part(mine[0].param.grad))
