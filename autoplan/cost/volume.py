"""Bytes one rank puts into each collective, by kind and dtype: the payloads the communication
times of layers.py, stages.py and step.py are costed on, in one place.

The bytes are those of the dry run's log (autoplan/dryrun/collectives.py): the gathered output
of an all-gather, the unreduced input of a reduce-scatter, the buffer of an all-reduce,
broadcast, send or recv, the input of an all-to-all. So `autoplan check` can set the cost
model's volume beside what autoplan's runtime issues on fake tensors, kind by kind.

Each `Traffic` says when it is issued: every micro-batch, once a step with the first
micro-batch (ZeRO-2's weight gather: FSDP keeps the gathered weights until the last backward,
runtime/loop.py _fsdp_microbatch), or once a step after the last backward (the DP sync).
Collectives of a group of one rank are not issued and not listed. What the time model leaves
out as latency-bound is listed where the runtime issues it (the MoE token counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from autoplan.config import ParallelConfig
from autoplan.cost import comm, compute, memory, sac
from autoplan.cost.kv_heads import replicates_kv
from autoplan.trace.graph import BlockInfo, ModelGraph, SideValue

MICROBATCH, FIRST, END = "every micro-batch", "first micro-batch", "end of step"
INDEX_BYTES = 8  # int64 token counts per expert (models/moe.py dispatch_to_owners)


@dataclass(frozen=True)
class Traffic:
    """`bytes` of collectives of one `kind` and `dtype` one rank issues, `when` in the step."""

    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send, recv
    dtype: str  # torch's name: bfloat16, float16, float32, int64
    bytes: float
    when: str = MICROBATCH


def stream_dtype_bytes(config: ParallelConfig, fp32_module_weights: bool = True) -> int:
    """Bytes per element of the residual stream between blocks: fp32 where torch.autocast
    computes from fp32 module weights (ZeRO-0/1 in autoplan's runtime: the norms return fp32
    and the residual sums stay fp32, so the hidden states a block hands on, a pipeline stage
    sends and an MoE layer dispatches are fp32), else the 16-bit activation dtype."""
    if memory.autocasts_fp32_weights(config.precision, config.zero_stage, fp32_module_weights):
        return memory.FP32_BYTES
    return compute.activation_dtype_bytes(config.precision)


def dtype_name(nbytes: int, precision: str) -> str:
    """torch's name of a floating dtype of `nbytes` under `precision` (16 bits: the training's)."""
    if nbytes == 4:
        return "float32"
    if nbytes == 1:  # the float8 all-gather's weights (torchao casts them to e4m3)
        return "float8_e4m3fn"
    return "float16" if precision == "fp16" else "bfloat16"


def tokens_per_rank(graph: ModelGraph, config: ParallelConfig, block: BlockInfo | None = None) -> float:
    """Tokens of one micro-batch on a rank. A sample of an image model is one image, whose
    blocks run on its patches (ViT) or window tokens (Swin): read off the block's input
    (batch, tokens..., hidden) as traced."""
    tokens = graph.seq_len
    if graph.image_size and block is not None and block.kind not in ("pre", "post") \
            and block.hidden and block.input_bytes:
        tokens = block.input_bytes / (graph.dtype_bytes * graph.batch_size * block.hidden)
    return config.micro_batch * tokens / config.cp


# -- tensor parallelism ------------------------------------------------------------------

def tp_payload_elements(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> float:
    """The activation one TP collective moves whole: the micro-batch's tokens on this CP rank x
    hidden (an all-reduce's buffer; with sequence parallelism the all-gather's output and the
    reduce-scatter's input)."""
    return tokens_per_rank(graph, config, block) * block.hidden


def tp_forward_reruns(recompute: str, sequence_parallel: bool, selective_policy: str = "op",
                      checkpoint_early_stop: bool = True) -> tuple[int, int]:
    """(input, output) TP collectives of a transformer layer's forward that its recomputation
    in backward runs again, of the 2 each (attention and MLP): the inputs' all-gathers with
    sequence parallelism (none without: the inputs cross in backward only), the outputs'
    reduce-scatters or all-reduces.

    A recomputation regenerates what the backward needs saved and nothing else: a
    non-reentrant torch checkpoint stops once the last saved tensor is back
    (torch.utils.checkpoint early stop, on by default: autoplan's runtime, torchtitan), so
    the MLP's output reduction, which feeds only the residual sum, is not run again; the
    attention's output is, as the MLP's input derives from it. Megatron's and DeepSpeed's
    reentrant checkpoint reruns the whole forward. Selective recomputation: torch's selective
    checkpoint as autoplan's runtime applies it (runtime/recompute.py) saves matmul and
    attention outputs, so the collectives between them run again as under full (`autoplan
    check` logs 2 all-gathers and 1 reduce-scatter a layer with sequence parallelism, 1
    all-reduce without, under both); torchtitan's op SAC saves the reduce-scatters' outputs
    too (sac.py), not the all-gathers' nor an all-reduce's; Megatron's recomputes the core
    attention only, which holds no TP collective."""
    if recompute == "none" or (recompute == "selective" and selective_policy == "attention_core"):
        return 0, 0
    inputs = 2 if sequence_parallel else 0
    if recompute == "selective" and selective_policy == sac.OP_SAC and sequence_parallel:
        return inputs, 0
    return inputs, 1 if checkpoint_early_stop else 2


def tp_collectives(block: BlockInfo, config: ParallelConfig, recompute: str,
                   fp32_module_weights: bool = True, selective_policy: str = "op",
                   checkpoint_early_stop: bool = True) -> list[tuple[str, int, int]]:
    """(kind, bytes per element, count) of one block's TP collectives per micro-batch.

    A transformer layer's attention and MLP each take their input (the norm's output, in the
    residual stream's dtype: stream_dtype_bytes) to the column-parallel linears and hand the
    row-parallel output (16-bit) back: 2 all-reduces in forward (the outputs) and 2 in
    backward (the inputs' gradients) per layer (Shoeybi et al. 2019 §3); with sequence
    parallelism the input is all-gathered in forward and its gradient reduce-scattered in
    backward, the output reduce-scattered and its gradient all-gathered (Korthikanti et al.
    2022 §4.2.2). The recomputation repeats some forward ones (tp_forward_reruns). The
    embedding reduces its partial lookups in forward (with SP a reduce-scatter, whose
    backward is an all-gather); the vocabulary-parallel output layer keeps its logits sharded
    for the parallel cross entropy, so only its input crosses: with SP gathered in forward
    and its gradient reduce-scattered in backward, without SP its gradient all-reduced
    (Megatron copy_to_tensor_model_parallel_region; autoplan's runtime, `autoplan check`)."""
    stream = stream_dtype_bytes(config, fp32_module_weights)
    act = compute.activation_dtype_bytes(config.precision)
    sp = config.sequence_parallel
    if block.kind in ("pre", "post"):
        return [("all_gather", stream, 1), ("reduce_scatter", stream, 1)] if sp else [("all_reduce", stream, 1)]
    inputs, outputs = tp_forward_reruns(recompute, sp, selective_policy, checkpoint_early_stop)
    if sp:
        return [("all_gather", stream, 2 + inputs), ("all_gather", act, 2),
                ("reduce_scatter", act, 2 + outputs), ("reduce_scatter", stream, 2)]
    return [("all_reduce", act, 2 + outputs), ("all_reduce", stream, 2)]


def sp_replicated_params(graph: ModelGraph, block: BlockInfo) -> float:
    """Parameters TP leaves whole that run on sequence shards under SP (the norms): a
    layer's outside its TP-sharded linears and experts, the final norm beside the
    vocabulary-parallel head. (The embedding block's are left out: a position table added
    to the embedding output.)"""
    if block.kind == "pre":
        return 0.0
    if block.kind == "post":
        return float(block.parameters - graph.vocab_parameters(block))
    return float(block.parameters - block.tp_parameters - block.expert_parameters)


def tp_partial_params(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> float:
    """Parameters whole on every tp rank whose gradients are each rank's share of the sum:
    the norms under SP (sp_replicated_params) and k and v projections whose K/V heads tp
    exceeds (cost/kv_heads.py: each rank's gradient covers its own head's rows)."""
    sp = sp_replicated_params(graph, block) if config.sequence_parallel else 0.0
    return sp + (float(block.kv_parameters) if replicates_kv(block.kv_heads, config.tp) else 0.0)


def sp_grad_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, per_microbatch_scatter: bool,
                    fp32_module_weights: bool = True) -> list[Traffic]:
    """The partial gradients of the tp-replicated parameters (tp_partial_params), summed over
    the tp group: by FSDP
    before each reduce-scatter in the 16-bit compute dtype, or once on the fp32 gradient
    accumulated over a pipeline's micro-batches (FSDPParam._get_grad_inner_tensor); below
    ZeRO-2 by the runtime once a step in the weights' dtype (tensor_parallel.reduce_partial_grads)."""
    params = tp_partial_params(graph, block, config) if config.tp > 1 else 0.0
    if not params:
        return []
    if config.zero_stage >= 2 and per_microbatch_scatter:
        nbytes, when = compute.activation_dtype_bytes(config.precision), MICROBATCH
    elif config.zero_stage >= 2 or fp32_module_weights:
        nbytes, when = memory.FP32_BYTES, END
    else:
        nbytes, when = compute.activation_dtype_bytes(config.precision), END
    return [Traffic("all_reduce", dtype_name(nbytes, config.precision), params * nbytes, when)]


def loss_parallel_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> list[Traffic]:
    """The vocabulary-parallel cross entropy all-reduces three fp32 values per token over the
    tp group: the logits' max, the sum of their exponentials and the target's logit
    (torch loss_parallel, _log_softmax_handler and _nll_loss_forward_handler; Megatron
    VocabParallelCrossEntropy)."""
    if config.tp <= 1 or block.kind != "post" or not graph.vocab:
        return []
    return [Traffic("all_reduce", "float32", 3 * tokens_per_rank(graph, config) * memory.FP32_BYTES)]


def tp_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, recompute: str,
               fp32_module_weights: bool = True, selective_policy: str = "op",
               checkpoint_early_stop: bool = True) -> list[Traffic]:
    if config.tp <= 1:
        return []
    elements = tp_payload_elements(graph, block, config)
    return [Traffic(kind, dtype_name(nbytes, config.precision), count * elements * nbytes)
            for kind, nbytes, count in tp_collectives(block, config, recompute, fp32_module_weights,
                                                      selective_policy, checkpoint_early_stop)]


# -- context parallelism -----------------------------------------------------------------

# How ring attention's backward passes the gradients of the K/V blocks back to their owners
# (layers.Runtime.cp_grad_ring): (bytes per element, None for K/V's own dtype; whether they
# make a hop more than K/V's cp - 1, starting at the owner).
#   fp32: autoplan's runtime (runtime/context_parallel.py): fp32 accumulators, started by the
#     rank after the owner and home after cp-1 hops, the owner keeping its own share
#   fp32-home: torch's ring attention (torchtitan): fp32 accumulators started at the owner,
#     home after cp hops (_templated_ring_attention_backward, _cp_options.convert_to_f32)
#   kv-dtype: Transformer Engine (Megatron-Core, NeMo): in K/V's dtype, riding in the K/V
#     buffer from the second hop and alone on the last, cp-1 hops (AttnFuncWithCPAndKVP2P)
CP_GRAD_RINGS = {"fp32": (memory.FP32_BYTES, False), "fp32-home": (memory.FP32_BYTES, True),
                 "kv-dtype": (None, False)}


def cp_hop_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig,
                 dtype_bytes: int | None = None) -> float:
    """This rank's K/V chunk of one micro-batch, which one ring step passes on: in the
    activation dtype (16-bit under mixed precision: the ring takes autocast's cast of q/k/v
    as SDPA does, runtime/context_parallel.py), or at `dtype_bytes` per element."""
    element = dtype_bytes or compute.activation_dtype_bytes(config.precision)
    return (block.kv_bytes * config.micro_batch / graph.batch_size / config.cp / config.tp
            * element / graph.dtype_bytes)


def cp_grad_bytes(config: ParallelConfig, grad_ring: str = "fp32") -> int:
    """Bytes per element of the K/V gradients ring attention's backward passes on."""
    return CP_GRAD_RINGS[grad_ring][0] or compute.activation_dtype_bytes(config.precision)


def cp_ring_forwards(recompute: str, selective_policy: str = "op") -> int:
    """Forward rings per micro-batch: the forward's, and again in backward when the block is
    recomputed: full, or selective where the policy does not keep the ring's output.
    autoplan's "op" policy keeps the outputs of aten ops (runtime/recompute.py); the ring is
    an autograd Function whose exchanges are c10d ops, so it runs again, its attention
    kernels answered from the saved outputs. Megatron's selective recomputes the core
    attention, ring included (checkpoint_core_attention). torchtitan's op SAC saves
    aten._scaled_dot_product_flash_attention, the op torch's context_parallel() answers with
    its ring (a DTensor custom op handler), so the ring is taken not to run again (read off
    the sources; no torchtitan CP run is in the validation set)."""
    if recompute == "full" or (recompute == "selective" and selective_policy != sac.OP_SAC):
        return 2
    return 1


def cp_hops(cp: int, recompute: str = "none", selective_policy: str = "op",
            grad_ring: str = "fp32") -> tuple[int, int, int]:
    """(forward, backward, gradient) ring steps per micro-batch (Liu et al. 2023 Ring
    Attention): K/V-sized steps of K/V in their dtype, cp - 1 per forward ring
    (cp_ring_forwards) and cp - 1 in backward; and the steps of the K/V gradients in
    their dtype (cp_grad_bytes): cp - 1, or cp (CP_GRAD_RINGS)."""
    return (cp_ring_forwards(recompute, selective_policy) * (cp - 1), cp - 1,
            cp - 1 + CP_GRAD_RINGS[grad_ring][1])


def cp_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, recompute: str = "none",
               selective_policy: str = "op", grad_ring: str = "fp32") -> list[Traffic]:
    """Each ring step sends this rank's block to the next rank and receives the previous one's."""
    if config.cp <= 1 or not block.kv_bytes:
        return []
    forward, backward, grads = cp_hops(config.cp, recompute, selective_policy, grad_ring)
    kv = compute.activation_dtype_bytes(config.precision)
    by_dtype: dict[str, float] = {}
    for element, hops in ((kv, forward + backward), (cp_grad_bytes(config, grad_ring), grads)):
        dtype = dtype_name(element, config.precision)
        by_dtype[dtype] = by_dtype.get(dtype, 0.0) + hops * cp_hop_bytes(graph, block, config, element)
    return [Traffic(kind, dtype, b) for dtype, b in by_dtype.items() for kind in ("send", "recv")]


# -- expert parallelism ------------------------------------------------------------------

def ep_tokens(graph: ModelGraph, config: ParallelConfig) -> float:
    """Tokens a rank dispatches per micro-batch: with expert-TP 1 the TP ranks split their
    tokens before dispatch (sequence-parallel shard)."""
    return tokens_per_rank(graph, config) / config.tp


def ep_token_bytes(block: BlockInfo, config: ParallelConfig, fp32_module_weights: bool = True) -> tuple[float, float]:
    """(dispatch, combine) bytes of one routed token: the dispatch moves the layer's input, the
    residual stream (stream_dtype_bytes), the combine the experts' 16-bit outputs; each one's
    backward moves a gradient of the same dtype."""
    return (block.hidden * stream_dtype_bytes(config, fp32_module_weights),
            block.hidden * compute.activation_dtype_bytes(config.precision))


def ep_alltoall_reruns(recompute: str, selective_policy: str = "attention_core") -> bool:
    """Whether the recomputation runs a block's all-to-alls again: under full recomputation,
    and under selective with the "op" policy (autoplan's runtime: torch's selective checkpoint
    saves matmul and attention outputs only, runtime/recompute.py, so the exchanges between
    them run again, as `autoplan check` logs). Megatron's selective recomputation reruns the
    attention core only; torchtitan's op SAC saves all_to_all_single's output."""
    return recompute == "full" or (recompute == "selective" and selective_policy == "op")


def ep_alltoall_count(recompute: str, selective_policy: str = "attention_core") -> int:
    """Token all-to-alls per micro-batch: dispatch + combine in forward and in backward (GShard,
    Lepikhin et al. 2020 §2.2), the forward ones again where the recomputation reruns them
    (ep_alltoall_reruns)."""
    return 4 + (2 if ep_alltoall_reruns(recompute, selective_policy) else 0)


def ep_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, recompute: str,
               fp32_module_weights: bool = True, selective_policy: str = "attention_core") -> list[Traffic]:
    if config.ep <= 1 or not block.experts:
        return []
    slots = ep_tokens(graph, config) * block.top_k
    forwards = 2 if ep_alltoall_reruns(recompute, selective_policy) else 1
    # half dispatches (and their gradients), half combines
    each = ep_alltoall_count(recompute, selective_policy) // 2
    out = [Traffic("all_to_all", dtype_name(int(b / block.hidden), config.precision), each * slots * b)
           for b in ep_token_bytes(block, config, fp32_module_weights)]
    # every forward exchanges the per-expert token counts before the dispatch
    return out + [Traffic("all_to_all", "int64", forwards * block.experts * INDEX_BYTES)]


# -- data parallelism ----------------------------------------------------------------------

def fsdp_gathers(block: BlockInfo, root_regathered: bool = False) -> int:
    """ZeRO-3 all-gathers of a block's weights per micro-batch: before forward and again
    before backward (Rajbhandari et al. 2020 §5.3). Where the embedding and head are FSDP's
    root unit kept gathered from its forward to its backward (autoplan's runtime shards the
    root with reshard_after_forward=False, runtime/data_parallel.py apply_fsdp, as FSDP2 does
    for a root left to choose, torch/distributed/fsdp/_fully_shard/_fsdp_state.py _lazy_init),
    they are gathered once (Runtime.fsdp_root_regathered)."""
    return 1 if block.kind in ("pre", "post") and not root_regathered else 2


def zero3_traffic(params: memory.BlockParams, block: BlockInfo, config: ParallelConfig,
                  root_regathered: bool = False) -> list[Traffic]:
    """All-gather the 16-bit (or float8, memory.fsdp_gather_bytes_per_param) weights,
    reduce-scatter the gradients in the reduce dtype."""
    if config.zero_stage < 3:
        return []
    return _dp_traffic("all_gather", params, memory.fsdp_gather_bytes_per_param(config, block.kind), config,
                       MICROBATCH, fsdp_gathers(block, root_regathered)) + \
        _dp_traffic("reduce_scatter", params, memory.grad_reduce_bytes_per_param(config.precision), config, MICROBATCH)


def zero2_traffic(params: memory.BlockParams, config: ParallelConfig, per_microbatch: bool) -> list[Traffic]:
    """Reduce-scatter of the gradients every micro-batch (FSDP2, DeepSpeed stage 2), unless a
    pipeline accumulates them unsharded (`per_microbatch` False: step-level, dp_sync_traffic)."""
    if config.zero_stage != 2 or not per_microbatch:
        return []
    return _dp_traffic("reduce_scatter", params, memory.grad_reduce_bytes_per_param(config.precision), config,
                       MICROBATCH)


def dp_sync_traffic(params: memory.BlockParams, config: ParallelConfig, per_microbatch_scatter: bool,
                    fp32_module_weights: bool = True) -> list[Traffic]:
    """Once a step: ZeRO-0 all-reduces the gradients (DDP, or one flat buffer), ZeRO-1 too and
    then broadcasts each updated parameter from the rank owning its states
    (ZeroRedundancyOptimizer); ZeRO-2 reduce-scatters the gradients (unless it did every
    micro-batch) and all-gathers the updated 16-bit weights before the next forward."""
    if config.zero_stage >= 3:
        return []
    g = memory.grad_reduce_bytes_per_param(config.precision)
    w = memory.synced_weight_bytes_per_param(config.precision, config.zero_stage, fp32_module_weights)
    if config.zero_stage <= 1:
        synced = _dp_traffic("all_reduce", params, g, config, END)
        return synced + (_dp_traffic("broadcast", params, w, config, END) if config.zero_stage == 1 else [])
    scatter = [] if per_microbatch_scatter else _dp_traffic("reduce_scatter", params, g, config, END)
    return scatter + _dp_traffic("all_gather", params, w, config, FIRST)


def _dp_traffic(kind: str, params: memory.BlockParams, bytes_per_param: int, config: ParallelConfig,
                when: str, times: int = 1) -> list[Traffic]:
    """`times` collectives of `bytes_per_param` per parameter: dense parameters over dp x cp,
    expert ones over their expert-DP group, where those groups have more than one rank."""
    dtype = dtype_name(bytes_per_param, config.precision)
    out = []
    for count, group in ((params.dense, config.dp * config.cp),
                         (params.expert, comm.expert_dp_degree(config.tp, config.cp, config.dp, config.ep))):
        if count and group > 1:
            out.append(Traffic(kind, dtype, times * count * bytes_per_param, when))
    return out


# -- pipeline parallelism ------------------------------------------------------------------

def pp_boundary_bytes(graph: ModelGraph, config: ParallelConfig, fp32_module_weights: bool = True) -> float:
    """The hidden states (and, back, their gradient) one micro-batch hands across a stage
    boundary: b x s x h in the residual stream's dtype, / t with the scatter/gather
    optimisation (Narayanan et al. 2021 §4.1)."""
    act = stream_dtype_bytes(config, fp32_module_weights)
    hidden = graph.blocks[0].hidden if graph.blocks else graph.pre.hidden
    payload = config.micro_batch * graph.seq_len / config.cp * hidden * act
    if config.sequence_parallel and config.tp > 1:
        payload /= config.tp
    return payload


def side_value_bytes(graph: ModelGraph, value: SideValue, config: ParallelConfig) -> float:
    """Bytes of one micro-batch's `value` on a rank, in its traced dtype: scaled from the traced
    batch and sequence to the micro-batch and the tokens a rank holds (seq / cp, as the runtime
    slices its position tables: runtime/context_parallel.py); tensor parallelism leaves it whole."""
    return (value.elements * value.element_bytes
            * (config.micro_batch / graph.batch_size) ** value.batch_power / config.cp ** value.seq_power)


def side_value_dtype_bytes(value: SideValue, config: ParallelConfig, from_first_stage: bool,
                           fp32_module_weights: bool = True) -> int:
    """Bytes per element a stage hands `value` on in. Stage 0 makes it: a value carrying a
    gradient is an activation, in the residual stream's dtype (stream_dtype_bytes); one without
    comes from the model's buffers (the rotary tables), which the runtime keeps in their own
    dtype (fp32: FSDP's MixedPrecisionPolicy casts parameters only, and autocast leaves slices
    alone). A later stage passes it on as it took it in: at ZeRO-2/3 FSDP casts a stage's
    floating forward inputs to the 16-bit compute dtype (MixedPrecisionPolicy
    cast_forward_inputs, runtime/data_parallel.py apply_fsdp); below, it leaves them be."""
    if not value.floating:
        return value.element_bytes
    act = compute.activation_dtype_bytes(config.precision)
    if not from_first_stage and config.zero_stage >= 2 and config.precision != "fp32":
        return act
    if value.requires_grad:
        return stream_dtype_bytes(config, fp32_module_weights)
    return value.element_bytes


def pp_side_traffic(graph: ModelGraph, config: ParallelConfig, cut: int, from_first_stage: bool,
                    fp32_module_weights: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """({dtype: bytes} forward, {dtype: bytes} of the gradients back) of what one micro-batch
    hands across the cut after block `cut` beside the hidden states (ModelGraph
    .pipeline_side_values): a stage sends them on to the next (from the first stage or a later
    one: side_value_dtype_bytes), and only the gradients of those that carry one come back."""
    values = graph.pipeline_side_values[cut] if 0 <= cut < len(graph.pipeline_side_values) else ()
    forward: dict[str, float] = {}
    back: dict[str, float] = {}
    for value in values:
        nbytes = side_value_dtype_bytes(value, config, from_first_stage, fp32_module_weights)
        dtype = value.dtype if nbytes == value.element_bytes else dtype_name(nbytes, config.precision)
        payload = side_value_bytes(graph, value, config) / value.element_bytes * nbytes
        forward[dtype] = forward.get(dtype, 0.0) + payload
        if value.requires_grad:
            back[dtype] = back.get(dtype, 0.0) + payload
    return forward, back


def pp_traffic(graph: ModelGraph, config: ParallelConfig, stage_index: int, stages: int,
               fp32_module_weights: bool = True, cut_before: int | None = None,
               cut_after: int | None = None) -> list[Traffic]:
    """A stage receives the hidden states from the one before and sends their gradient back;
    it sends its own output to the one after and receives that output's gradient. Beside
    them, where the runtime hands on what else is live across a cut (`cut_before`, `cut_after`:
    the block after which the cut is, None where it hands on the hidden states alone), the
    side values cross forward (pp_side_traffic), and back the gradients of those with one."""
    if config.pp <= 1:
        return []
    payload = pp_boundary_bytes(graph, config, fp32_module_weights)
    dtype = dtype_name(stream_dtype_bytes(config, fp32_module_weights), config.precision)
    neighbours = (stage_index > 0) + (stage_index < stages - 1)
    out = [Traffic("send", dtype, neighbours * payload), Traffic("recv", dtype, neighbours * payload)]
    if stage_index > 0 and cut_before is not None:
        received, grads = pp_side_traffic(graph, config, cut_before, stage_index == 1, fp32_module_weights)
        out += [Traffic("recv", d, b) for d, b in received.items()]
        out += [Traffic("send", d, b) for d, b in grads.items()]
    if stage_index < stages - 1 and cut_after is not None:
        sent, grads = pp_side_traffic(graph, config, cut_after, stage_index == 0, fp32_module_weights)
        out += [Traffic("send", d, b) for d, b in sent.items()]
        out += [Traffic("recv", d, b) for d, b in grads.items()]
    return out


def tied_head(graph: ModelGraph) -> bool:
    """The output head shares the embedding matrix (post holds fewer than vocab x hidden)."""
    post = graph.post
    return graph.vocab > 0 and post.parameters < graph.vocab * max(post.hidden, 1)


def tied_grad_bytes(graph: ModelGraph, config: ParallelConfig) -> float:
    """This rank's shard of the tied embedding's gradient in fp32 (the vocabulary x hidden
    matrix; / tp as the vocabulary-parallel embedding and head shard it, and at ZeRO-2/3 /
    the dp_shard x cp ranks FSDP shards it over)."""
    shards = config.tp * (config.dp_shard * config.cp if config.zero_stage >= 2 else 1)
    return graph.vocab * graph.post.hidden / shards * memory.grad_reduce_bytes_per_param(config.precision)


def tied_grad_traffic(graph: ModelGraph, config: ParallelConfig, stage_index: int, stages: int) -> list[Traffic]:
    """Under a pipeline the first stage holds the embedding and the last a copy of it as the
    tied head; once a step, after the backward, each sums the copies' gradients with the other
    (runtime/pipeline.py sum_tied_grads; Megatron-LM's embedding group,
    _allreduce_word_embedding_grads): one all-reduce over the two pipeline ranks."""
    if config.pp <= 1 or not tied_head(graph) or stage_index not in (0, stages - 1):
        return []
    return [Traffic("all_reduce", dtype_name(memory.grad_reduce_bytes_per_param(config.precision),
                                             config.precision), tied_grad_bytes(graph, config), END)]


# -- one rank ------------------------------------------------------------------------------

def rank_traffic(graph: ModelGraph, config: ParallelConfig, stages_layers: list[list[tuple[BlockInfo, str]]],
                 physical_stage: int, runtime=None) -> list[Traffic]:
    """Every collective a rank of `physical_stage` issues in a step, as the cost model counts
    them; `stages_layers`: (block, recompute) of every virtual stage (stages.partition);
    `runtime`: layers.Runtime, autoplan's own by default."""
    # layers.py costs its times on this module's payloads: a real import cycle
    from autoplan.cost.layers import DEFAULT_RUNTIME, block_params, fsdp_pipeline_unsharded

    runtime = runtime or DEFAULT_RUNTIME
    per_microbatch_scatter = not fsdp_pipeline_unsharded(config)
    out: list[Traffic] = []
    dense = expert = 0.0
    # the block after which each virtual stage ends: where its cut is
    ends = [sum(len(layers) for layers in stages_layers[:i + 1]) - 1 for i in range(len(stages_layers))]
    for index, layers in enumerate(stages_layers):
        if index % config.pp != physical_stage:
            continue
        blocks = [(b, rc if b.kind not in ("pre", "post") else "none") for b, rc in layers]
        if index == 0:
            blocks.insert(0, (graph.pre, "none"))
        if index == len(stages_layers) - 1:
            blocks.append((graph.post, "none"))
        for block, rc in blocks:
            params = block_params(block, graph, config)
            dense, expert = dense + params.dense, expert + params.expert
            out += tp_traffic(graph, block, config, rc, runtime.fp32_module_weights, runtime.selective_policy,
                              runtime.checkpoint_early_stop)
            out += sp_grad_traffic(graph, block, config, per_microbatch_scatter, runtime.fp32_module_weights)
            out += loss_parallel_traffic(graph, block, config)
            out += cp_traffic(graph, block, config, rc, runtime.selective_policy, runtime.cp_grad_ring)
            out += ep_traffic(graph, block, config, rc, runtime.fp32_module_weights, runtime.selective_policy)
            out += zero3_traffic(params, block, config, runtime.fsdp_root_regathered)
            out += zero2_traffic(params, config, per_microbatch_scatter)
        cuts = (ends[index - 1] if index else None, ends[index]) if runtime.pp_hands_on_side_values else (None, None)
        out += pp_traffic(graph, config, index, len(stages_layers), runtime.fp32_module_weights, *cuts)
        out += tied_grad_traffic(graph, config, index, len(stages_layers))
    out += dp_sync_traffic(memory.BlockParams(dense, expert), config,
                           config.zero_stage == 2 and per_microbatch_scatter, runtime.fp32_module_weights)
    return out


def by_kind(traffic: Iterable[Traffic], num_microbatches: int, window: str = "step") -> dict[tuple[str, str], float]:
    """Bytes per (kind, dtype) over a `window`: "step", every micro-batch's and the step's once;
    "last micro-batch", what the dry run measures: the step's last micro-batch (with the
    first's once-a-step collectives when it is the only one) and the end of the step."""
    totals: dict[tuple[str, str], float] = {}
    for t in traffic:
        if window == "step":
            times = num_microbatches if t.when == MICROBATCH else 1
        else:
            times = 0 if t.when == FIRST and num_microbatches > 1 else 1
        if times and t.bytes:
            totals[(t.kind, t.dtype)] = totals.get((t.kind, t.dtype), 0.0) + times * t.bytes
    return totals
