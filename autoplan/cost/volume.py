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
from autoplan.cost import comm, compute, memory
from autoplan.trace.graph import BlockInfo, ModelGraph

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

def tp_payload_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> float:
    """The activation one TP collective moves whole: the micro-batch's tokens on this CP rank x
    hidden (an all-reduce's buffer; with sequence parallelism the all-gather's output and the
    reduce-scatter's input)."""
    return tokens_per_rank(graph, config, block) * block.hidden * compute.activation_dtype_bytes(config.precision)


def tp_collective_count(block: BlockInfo, recompute: str) -> int:
    """TP all-reduces (with SP: all-gather + reduce-scatter pairs) per micro-batch: 2 in forward
    and 2 in backward per transformer layer (Shoeybi et al. 2019 §3; Korthikanti et al. 2022
    §4.2.2), the forward ones again under full recomputation. The embedding reduces its
    partial lookups in forward (with SP a reduce-scatter, whose backward is an all-gather): 1.
    The vocabulary-parallel output layer keeps its logits sharded for the parallel cross
    entropy, so only its input crosses: with SP gathered in forward and its gradient
    reduce-scattered in backward, without SP its gradient all-reduced in backward (Megatron
    copy_to_tensor_model_parallel_region; autoplan's runtime, `autoplan check`): 1."""
    if block.kind in ("pre", "post"):
        return 1
    return 4 + (2 if recompute == "full" else 0)


def tp_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, recompute: str) -> list[Traffic]:
    if config.tp <= 1:
        return []
    payload = tp_collective_count(block, recompute) * tp_payload_bytes(graph, block, config)
    dtype = dtype_name(compute.activation_dtype_bytes(config.precision), config.precision)
    if config.sequence_parallel:
        return [Traffic("all_gather", dtype, payload), Traffic("reduce_scatter", dtype, payload)]
    return [Traffic("all_reduce", dtype, payload)]


# -- context parallelism -----------------------------------------------------------------

def cp_hop_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> float:
    """This rank's K/V chunk of one micro-batch, which one ring step passes on (16-bit)."""
    return (block.kv_bytes * config.micro_batch / graph.batch_size / config.cp / config.tp
            * compute.activation_dtype_bytes(config.precision) / graph.dtype_bytes)


def cp_hops(cp: int) -> tuple[int, int]:
    """(forward, backward) K/V-sized ring steps per micro-batch (Liu et al. 2023 Ring
    Attention): cp - 1 in forward; backward passes K/V and their gradients, twice the bytes."""
    return cp - 1, 2 * (cp - 1)


def cp_traffic(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> list[Traffic]:
    if config.cp <= 1 or not block.kv_bytes:
        return []
    dtype = dtype_name(compute.activation_dtype_bytes(config.precision), config.precision)
    each_way = sum(cp_hops(config.cp)) * cp_hop_bytes(graph, block, config)
    return [Traffic("send", dtype, each_way), Traffic("recv", dtype, each_way)]


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
    """All-gather the 16-bit weights, reduce-scatter the gradients in the reduce dtype."""
    if config.zero_stage < 3:
        return []
    return _dp_traffic("all_gather", params, memory.weight_bytes_per_param(config.precision), config,
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


def pp_traffic(graph: ModelGraph, config: ParallelConfig, stage_index: int, stages: int,
               fp32_module_weights: bool = True) -> list[Traffic]:
    """A stage receives the hidden states from the one before and sends their gradient back;
    it sends its own output to the one after and receives that output's gradient. (What
    else a split model hands on beside them, position tables, is left out.)"""
    if config.pp <= 1:
        return []
    payload = pp_boundary_bytes(graph, config, fp32_module_weights)
    dtype = dtype_name(stream_dtype_bytes(config, fp32_module_weights), config.precision)
    neighbours = (stage_index > 0) + (stage_index < stages - 1)
    return [Traffic("send", dtype, neighbours * payload), Traffic("recv", dtype, neighbours * payload)]


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
            out += tp_traffic(graph, block, config, rc)
            out += cp_traffic(graph, block, config)
            out += ep_traffic(graph, block, config, rc, runtime.fp32_module_weights, runtime.selective_policy)
            out += zero3_traffic(params, block, config, runtime.fsdp_root_regathered)
            out += zero2_traffic(params, config, per_microbatch_scatter)
        out += pp_traffic(graph, config, index, len(stages_layers), runtime.fp32_module_weights)
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
