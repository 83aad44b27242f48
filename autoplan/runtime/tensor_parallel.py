"""Tensor + sequence parallelism from the plan's style table (styles per block class).

Megatron pairs: column-wise q/k/v and gate/up, row-wise o/down (one all-reduce, or with
sequence parallelism one reduce-scatter + all-gather, per pair). A fused [q | k | v] or
[gate | up] column gives each rank its share of every part and its attention the rank's head
counts (fused_projection.py); k and v projections of fewer K/V heads than ranks give each
rank the K/V head of its q heads (kv_replication.py). transformers' Conv1D (GPT-2) takes
the same styles in its transposed form (transposed_linear.py). An nn.MultiheadAttention is
split by heads as one module (mha_parallel.py); an RMSNorm over all heads of a column's
output sums its statistic over the ranks (sharded_norm.py); a low-rank attention (MLA) is
split by heads after its down-projections, which every rank computes whole
(latent_attention.py); an attention handed a bias of every head by its model (ALiBi) takes
its heads of it (head_inputs.py). Between blocks the residual
stream is sequence-sharded when SP is on; "prepare_input" gathers it before attention/MLP.
The output head stays vocab-sharded and the loss runs under `loss_parallel`, so the full
logits are never gathered. The token embedding is vocab-sharded too and looks up and
differentiates its own rows only (VocabParallelEmbedding), so its gradient is 1/tp of the
table, as the cost model counts it. Tables added to it whole (positions, token types) stay
replicated and hand on the rank's sequence shard (SequenceShardOutput).
"""

from __future__ import annotations

import re
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate, Shard,
                                      distribute_module, distribute_tensor)
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from autoplan.config import TP_STYLES, head_inputs_parts  # noqa: F401 (TP_STYLES: the styles this module applies)
from autoplan.errors import UserError
from autoplan.runtime import rng
from autoplan.runtime.data_parallel import allreduce_grads
from autoplan.runtime.expert_parallel import TOKEN_WISE_MOE, is_moe_layer
from autoplan.runtime.inline_colwise import InlineColwiseParallel
from autoplan.runtime.fused_projection import FusedColwiseParallel, head_counts_of, localise_head_counts
from autoplan.runtime.head_inputs import HEAD_INPUTS, slice_head_inputs
from autoplan.runtime.head_parameters import HEAD_PARAMETERS, shard_head_parameters
from autoplan.runtime.global_attention import GLOBAL_QKV, GlobalFusedColwiseParallel, shard_head_tables
from autoplan.runtime.kv_replication import KV_STYLE, KVColwiseParallel, local_kv_heads
from autoplan.runtime.latent_attention import COLWISE_LOCAL, REPLICATED, ColwiseLocalInput, replicate_module
from autoplan.runtime.mesh import local_part
from autoplan.runtime.mha_parallel import MHA_STYLE, MultiheadAttentionParallel
from autoplan.runtime.model_io import without_causal_only_mask
from autoplan.runtime.pipeline_hf import StageGap
from autoplan.runtime.sharded_norm import SHARDED_RMS_NORM, ShardedRMSNorm
from autoplan.runtime.transposed_linear import for_module, output_features
from autoplan.runtime.tying import retie, tied_groups



class GatherFirstInput(ParallelStyle):
    """Hand the first input to the module as a replicated DTensor: all-gathered along the
    sequence dim from `input_layout` Shard(1) (sequence parallelism), or taken as it is from
    Replicate(). Other inputs (RoPE tables, masks) pass untouched. Works whatever the module's
    arity, unlike PrepareModuleInput which needs one layout per input, and whether the
    activation comes positionally or by keyword (Hugging Face layers call
    `self_attn(hidden_states=...)`).

    The input stays a DTensor (PrepareModuleInput's use_local_output=False, as torchtitan):
    the column-parallel linears reading it (q, k, v; gate, up) hand back partial input
    gradients that autograd sums before one reduce-scatter to the sequence shards, or one
    all-reduce. Handed on as a plain tensor, each linear all-reduced its own."""

    def __init__(self, input_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(first):
            if not isinstance(first, DTensor):
                first = DTensor.from_local(first, device_mesh, [self.input_layout], run_check=False)
            return first.redistribute(device_mesh, [Replicate()])

        def gather_encoder_states(module, args, kwargs):
            # a decoder's cross-attention reads the encoder's output, sequence-sharded too
            states = kwargs.get(CROSS_ATTENTION_STATES)
            if isinstance(states, torch.Tensor):
                kwargs = {**kwargs, CROSS_ATTENTION_STATES: gather(states)}
            return args, kwargs

        module.register_forward_pre_hook(_on_first_input(gather), with_kwargs=True)
        module.register_forward_pre_hook(gather_encoder_states, with_kwargs=True)
        return module


class GatherFirstAndOwnHeads(GatherFirstInput):
    """GatherFirstInput for an attention its model hands tensors of every head (ALiBi's bias;
    head_inputs.py): the rank's heads of the inputs the style names are handed on."""

    def __init__(self, style: str, input_layout: Placement) -> None:
        super().__init__(input_layout)
        parsed = head_inputs_parts(style)
        if parsed is None:
            raise UserError(f"malformed TP style {style!r}; expected {HEAD_INPUTS}:<heads>:<name>[+<name>...]")
        self.heads, self.names = parsed

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.heads % device_mesh.size():
            raise UserError(f"tp={device_mesh.size()} does not divide the {self.heads} heads of "
                            f"{type(module).__name__}'s per-head inputs {self.names}.")
        super()._apply(module, device_mesh)
        slice_head_inputs(module, self.heads, self.names, device_mesh)
        return module


class GatherFirstAndShardHeadParameters(GatherFirstInput):
    """GatherFirstInput for an attention holding parameters of one value per head (GraniteSWA's
    sinks): each rank holds and reads its heads' values (head_parameters.py)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        shard_head_parameters(module, device_mesh)
        return module


CROSS_ATTENTION_STATES = "key_value_states"  # transformers' T5Attention (and BART's) name


class VocabParallelEmbedding(ParallelStyle):
    """An nn.Embedding with its rows (the vocabulary) sharded over the tp group: each rank
    looks its tokens up in its own rows, zeroes the tokens it does not own and the partial
    sums are reduced into `output_layout` (Megatron's VocabParallelEmbedding).

    The weight is the same Shard(0) DTensor as RowwiseParallel's, and the forward the same
    arithmetic as DTensor's rowwise embedding (torch/distributed/tensor/_ops/
    _embedding_ops.py, embedding_strategy's _MaskPartial). The lookup runs on the local
    shard because DTensor's backward would not: embedding_dense_backward_strategy (same file)
    has no Shard(0) weight-gradient strategy, so with the replicated gradient and token ids
    the backward gets, sharding propagation picks the all-replicate one and every rank
    builds the full (vocab, hidden) gradient in the compute dtype before it is cut to its
    rows. Here the backward of `to_local` hands the local row gradient back as the
    parameter's Shard(0) gradient.

    Modules that override nn.Embedding.forward (scaled embeddings) keep RowwiseParallel, and
    with it DTensor's replicated weight gradient; a hook cuts the rank's rows from it, so that
    what holds the gradient next (the sum of a tied head's copies over pipeline stages, the
    data-parallel all-reduce, ZeRO-1) finds it laid out as the weight."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).forward is not nn.Embedding.forward:
            RowwiseParallel(input_layouts=Replicate(), output_layouts=self.output_layout)._apply(
                module, device_mesh)
            module.weight.register_hook(_as_sharded_rows)
            return module

        def shard_rows(name, mod, mesh):
            mod.register_parameter("weight", nn.Parameter(
                distribute_tensor(mod.weight, mesh, [Shard(0)])))

        distribute_module(module, device_mesh, shard_rows)
        module.forward = types.MethodType(
            lambda mod, ids: _vocab_parallel_lookup(mod, ids, device_mesh, self.output_layout),
            module)
        return module


class SequenceShardOutput(ParallelStyle):
    """A table added to the token embedding before the first block (BERT's positions and
    token types): every rank keeps the whole (small) table and looks up the whole sequence, as
    the model does, and hands on the rank's sequence shard, so that it adds to the
    vocab-parallel embedding's shard under sequence parallelism. The cut's backward
    all-gathers the shards' gradients: each rank's table gets the gradient of every token,
    the same on every rank, as a replicated weight needs. The sequence is the dim before the
    features: (batch, seq, hidden) from (batch, seq) ids, (seq, hidden) from positions
    `arange(seq)` that broadcast over the batch."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(mod, args, out):
            whole = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(device_mesh, [Shard(out.dim() - 2)]).to_local()

        module.register_forward_hook(shard)
        return module


def _as_sharded_rows(grad: DTensor) -> DTensor:
    """A Shard(0) embedding weight's gradient in its weight's layout (replicate -> shard cuts
    the local rows, no communication)."""
    return grad.redistribute(grad.device_mesh, [Shard(0)])


def _vocab_parallel_lookup(module: nn.Embedding, ids: torch.Tensor, mesh: DeviceMesh,
                           output_layout: Placement) -> torch.Tensor:
    """This rank's share of the embedding of (replicated) token `ids`, reduced over the
    tp group into `output_layout`; a plain tensor, as RowwiseParallel's use_local_output."""
    weight = module.weight  # FSDP's gathered parameter inside a fully_shard unit
    local = local_part(weight)
    vocab = weight.shape[0]
    # Shard(0) splits as torch.chunk: every rank but the last ceil(vocab / tp) rows
    start = min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)
    rows = local.shape[0]
    foreign = (ids < start) | (ids >= start + rows)
    local_ids = (ids - start).masked_fill(foreign, 0)
    padding = module.padding_idx
    padding = padding - start if padding is not None and start <= padding < start + rows else None
    out = F.embedding(local_ids, local, padding, module.max_norm, module.norm_type,
                      module.scale_grad_by_freq, module.sparse)
    out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
    out = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return out.redistribute(mesh, [output_layout]).to_local()


class HeadCountedColwise(InlineColwiseParallel):
    """A plain column-parallel q, k or v whose attention reads its head count in forward:
    `style` ("colwise_heads:<heads>,<kv_heads>") tells `_localise_attention` the counts."""

    def __init__(self, style: str, input_layout: Placement) -> None:
        super().__init__(input_layouts=input_layout)
        self.style = style


def _on_first_input(transform):
    """A with_kwargs forward pre-hook applying `transform` to the first tensor input."""

    def hook(module, args, kwargs):
        name = None if args else next(key for key, value in kwargs.items() if isinstance(value, torch.Tensor))
        given = args[0] if args else kwargs[name]
        seen = transform(given)
        # gathered from a sequence shard: a mask the model sized from its shard (Falcon
        # always builds one) stands for causality over the whole sequence (model_io)
        gathered = seen.dim() > 1 and given.dim() > 1 and seen.shape[1] != given.shape[1]
        kwargs = without_causal_only_mask(module, kwargs, seen.shape[1] if gathered else None)
        if args:
            return (seen, *args[1:]), kwargs
        return args, {**kwargs, name: seen}

    return hook


def _own_copy(module, args, out: torch.Tensor) -> torch.Tensor:
    """A forward hook after a row style's ("rowwise_copy"): its plain output as a tensor of its
    own, not DTensor's view of its local shard, for a model that writes to it in place
    (Falcon's `mlp_output += attention_output`; autograd refuses in-place writes to a view a
    custom Function returned). It costs one copy of the output: the plan asks for it only there."""
    return out.clone()


def style_for(name: str, sequence_parallel: bool) -> ParallelStyle | None:
    """The DTensor ParallelStyle of one plan style; None where SP is off and nothing is needed."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if name == "colwise":  # a plain input is a sequence shard under SP (a column written inline
        # in its block, as nn.TransformerEncoderLayer's linear1), gathered here; one gathered
        # by its module's "prepare_input" comes as a replicated DTensor and passes as it is
        return InlineColwiseParallel(input_layouts=seq)
    if name.partition(":")[0] == GLOBAL_QKV:
        return GlobalFusedColwiseParallel(name)
    if name.partition(":")[0] in ("colwise_qkv", "colwise_gate_up"):
        return FusedColwiseParallel(name)
    if name.partition(":")[0] == KV_STYLE:
        return KVColwiseParallel(name)
    if name.partition(":")[0] == "colwise_heads":
        return HeadCountedColwise(name, seq)
    if name.partition(":")[0] == MHA_STYLE:  # nn.MultiheadAttention, split by heads whole
        return MultiheadAttentionParallel(sequence_parallel)
    if name == "head_embedding":  # a table of one column per head (T5's relative position
        # bias): each rank looks up its heads' columns
        return ColwiseParallel()
    if name in ("rowwise", "rowwise_copy"):  # the copy: _own_copy
        return RowwiseParallel(output_layouts=seq)
    if name == "sequence_parallel":  # a plain shard out: after a post-norm (BERT) it is the
        # residual, added to a row-parallel linear's plain output
        return SequenceParallel(use_local_output=True) if sequence_parallel else None
    if name == "final_norm":  # after the last block, as torchtitan's norm: a sequence-sharded
        # DTensor of the whole sequence's shape, which the model's closing code can view and
        # slice (GPT-2's view(-1, seq, hidden)) and the vocab head gathers
        return SequenceParallel() if sequence_parallel else None
    if name == "head_norm":  # a norm over each head's features, on (batch, seq, this rank's heads, head_dim):
        # its weight is replicated and its gradient summed over the ranks' heads
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if name == COLWISE_LOCAL:  # an up-projection of MLA reading its replicated latent
        return ColwiseLocalInput()
    if name == SHARDED_RMS_NORM:  # an RMSNorm over all heads of a column's output (OLMo-2's q/k norm)
        return ShardedRMSNorm()
    if name == "prepare_input":
        return GatherFirstInput(seq)
    if name == HEAD_PARAMETERS:
        return GatherFirstAndShardHeadParameters(seq)
    if name.partition(":")[0] == HEAD_INPUTS:
        return GatherFirstAndOwnHeads(name, seq)
    if name == "vocab_embedding":
        return VocabParallelEmbedding(output_layout=seq)
    if name == "whole_embedding":
        return SequenceShardOutput() if sequence_parallel else None
    if name == "vocab_head":
        return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(f"unknown TP style {name!r}")


def _scope_regex(scope: str) -> re.Pattern:
    """A block-class key of the table ("layers.*") as a regex; "*" is one path component."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in scope.split("*")))


def expand_tp_styles(table: dict[str, dict[str, str]], module_names) -> dict[str, str]:
    """The plan's per-class style table -> {module path: style} for the modules named.

    "" holds absolute paths; any other key matches block paths (each "*" one path
    component) and its entries are relative to each matching block ("" = the block)."""
    names = list(module_names)
    styles = {}
    for scope, entries in table.items():
        blocks = [""] if scope == "" else [n for n in names if _scope_regex(scope).fullmatch(n)]
        for block in blocks:
            for relative, style in entries.items():
                styles[".".join(p for p in (block, relative) if p)] = style
    return styles


def apply_tensor_parallel(model: nn.Module, table: dict[str, dict[str, str]], tp_mesh: DeviceMesh,
                          sequence_parallel: bool, dropout_shard: int | None = None) -> list[nn.Module]:
    """parallelize_module with every style of the plan that exists in this (stage) module.

    MoE layers (style "moe") are token-wise, so with SP they simply run on this
    rank's sequence shard (no gather, no re-shard; EP all-to-all works per tp rank). Their
    weights stay plain replicas whose gradients cover only the local tokens, as do those of
    the "replicated" down-projections of a latent attention (their gradients come from this
    rank's heads only): the returned modules need their gradients summed over the tp group
    after backward.

    `dropout_shard`: where given (a model with dropout), dropout on the rank's heads or
    columns draws from the rank's own stream (rng.ShardDropouts), this index telling it apart
    from every other rank's shards."""
    modules = dict(model.named_modules(remove_duplicate=False))
    plan, names, token_local = {}, {}, []
    styled: dict[int, tuple[str, str]] = {}  # a module used at several paths is styled once
    for path, name in expand_tp_styles(table, modules).items():
        if path not in modules or isinstance(modules[path], StageGap):
            continue  # on another pipeline stage
        first = styled.setdefault(id(modules[path]), (path, name))
        if first[0] != path:
            if first[1] != name:
                raise UserError(f"tensor parallelism cannot shard the module shared by {first[0]} "
                                f"and {path} two ways ({first[1]}, {name}); give both paths one style.")
            continue
        if name == REPLICATED:
            replicate_module(modules[path])
            token_local.append(modules[path])
            continue
        # (a plan written before the MoE style had one: "prepare_input" on an MoE layer)
        if name == TOKEN_WISE_MOE or (name == "prepare_input" and is_moe_layer(modules[path])):
            if sequence_parallel:
                modules[path].register_forward_pre_hook(_on_first_input(local_part), with_kwargs=True)
                token_local.append(modules[path])
            continue
        style = style_for(name, sequence_parallel)
        if style is not None:
            plan[path] = for_module(style, modules[path])
            names[path] = name
    if plan:
        groups = tied_groups(model)
        parallelize_module(model, tp_mesh, plan)
        retie(model, groups, "tensor parallelism")
    for path in (p for p, name in names.items() if name == "rowwise_copy"):
        modules[path].register_forward_hook(_own_copy)  # after the style's own output hook
    _localise_attention(modules, plan, tp_mesh.size())
    _shard_global_attention_tables(modules, plan, tp_mesh)
    if dropout_shard is not None:
        _mark_shard_regions(model, modules, table, names, sequence_parallel, rng.ShardRegions(dropout_shard))
    return token_local


# Styles after whose output a rank holds its own heads or columns, until the row-parallel
# linear that sums them. Left out: MLA's up-projections (their module also computes the
# latent every rank holds whole) and the attention run on DTensors (global_attention.py).
_SHARD_OPENERS = ("colwise", "colwise_qkv", "colwise_gate_up", KV_STYLE, "colwise_heads")


def _mark_shard_regions(model: nn.Module, modules: dict[str, nn.Module], table: dict[str, dict[str, str]],
                        names: dict[str, str], sequence_parallel: bool, regions: rng.ShardRegions) -> None:
    """Hooks that open the rank's dropout stream where its activations are its own shard and
    close it where they are whole again.

    Under SP a block holds nothing whole but DTensors (the gathered inputs of its column
    linears, which keep DTensor's own random streams): the region is each block, and the
    embedding's output (the rank's tokens) up to the first block. Without SP it runs from a
    column-parallel linear's output to the row-parallel linear that sums the shards, or the
    end of the module holding them, whichever comes first; a head-split
    nn.MultiheadAttention throughout. The model's end closes any region left open."""
    model.register_forward_hook(lambda m, args, out: regions.close())
    blocks = [path for path in expand_tp_styles({scope: {"": "block"} for scope in table if scope}, modules)
              if path in modules] if sequence_parallel else []
    if blocks:  # a plan naming its blocks (a flat table names none: the pairs below)
        for path in blocks:
            modules[path].register_forward_pre_hook(lambda m, args: regions.open())
            modules[path].register_forward_hook(lambda m, args, out: regions.close())
        for path, name in names.items():
            if name == "vocab_embedding":
                modules[path].register_forward_hook(lambda m, args, out: regions.open())
        return
    parents = set()
    for path, name in names.items():
        module, kind = modules[path], name.partition(":")[0]
        if kind == MHA_STYLE:
            module.register_forward_pre_hook(lambda m, args: regions.open())
            module.register_forward_hook(lambda m, args, out: regions.close())
        elif kind in _SHARD_OPENERS:
            module.register_forward_hook(lambda m, args, out: regions.open())
            parents.add(path.rpartition(".")[0])
        elif kind in ("rowwise", "rowwise_copy"):
            module.register_forward_pre_hook(lambda m, args: regions.close())
    for parent in parents:
        modules[parent].register_forward_hook(lambda m, args, out: regions.close())


def _localise_attention(modules: dict[str, nn.Module], plan: dict[str, ParallelStyle], tp: int) -> None:
    """The module holding a fused q/k/v or a k and v projection cuts and groups their output
    by its head counts: give it the rank's, once (k and v name the same module)."""
    counts = {}
    for path, style in plan.items():
        name = getattr(style, "style", "")
        found = head_counts_of(name, "colwise_qkv", KV_STYLE, "colwise_heads")
        if found:  # a fused projection's q part is heads / (heads + 2 kv_heads) of its rows; of
            # separate q, k and v projections q is the widest
            heads, kv_heads = found
            fused = head_counts_of(name, "colwise_qkv") is not None
            q_width = output_features(modules[path]) * heads // (heads + 2 * kv_heads) if fused \
                else output_features(modules[path])
            parent = path.rpartition(".")[0]
            counts[parent] = (heads, kv_heads, max(q_width, counts.get(parent, (0, 0, 0))[2]))
    for path, (heads, kv_heads, q_width) in counts.items():
        localise_head_counts(modules[path], heads, kv_heads, tp, local_kv_heads(kv_heads, tp), q_width)


def _shard_global_attention_tables(modules: dict[str, nn.Module], plan: dict[str, ParallelStyle],
                                   tp_mesh: DeviceMesh) -> None:
    """The attention run on DTensors (global_attention.py) gets its per-head tables sharded."""
    for path, style in plan.items():
        counts = head_counts_of(getattr(style, "style", ""), GLOBAL_QKV)
        if counts:
            shard_head_tables(modules[path.rpartition(".")[0]], counts[0], tp_mesh)


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum the partial gradients of replicated TP parameters (the norms under sequence
    parallelism: each rank saw its own tokens) over their mesh, in one flat all-reduce.

    Left partial, every optimizer op and the grad-norm clip that reads the gradient
    redistributes it again (AdamW: three all-reduces a parameter). FSDP does this itself
    before its reduce-scatter (FSDPParam._get_grad_inner_tensor); this is for DDP/ZeRO-1."""
    partial = [p for p in params if isinstance(p.grad, DTensor)
               and any(isinstance(x, Partial) for x in p.grad.placements)
               and all(isinstance(x, Replicate) for x in p.placements)]
    if not partial:
        return
    mesh = partial[0].grad.device_mesh
    allreduce_grads(partial, mesh.get_group(), 1)  # sums the local tensors in place
    for param in partial:
        param.grad = DTensor.from_local(param.grad.to_local(), mesh, param.placements, run_check=False)


def local_input_linears(part: nn.Module, plan) -> frozenset[str]:
    """Paths of the linears whose TP style computes them with its own F.linear (MLA's
    up-projections, latent_attention.py): an FP8 plan leaves them in 16 bits, since a
    Float8Linear's forward would not run."""
    styles = expand_tp_styles(plan.tp_styles, dict(part.named_modules()))
    return frozenset(path for path, style in styles.items() if style == COLWISE_LOCAL)


def uses_loss_parallel(table: dict[str, dict[str, str]]) -> bool:
    return any("vocab_head" in entries.values() for entries in table.values())



