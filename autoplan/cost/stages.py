"""Pipeline stages: which blocks each (virtual) stage runs, and the cost of one stage."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from autoplan.config import ParallelConfig
from autoplan.cost import comm, memory, pipeline, volume
from autoplan.cost.cache import CostCache
from autoplan.cost.layers import DEFAULT_RUNTIME, LayerCost, Runtime, fabric_and_groups, layer_cost
from autoplan.trace.graph import BlockInfo, ModelGraph


@dataclass(frozen=True)
class StageCost:
    """One (virtual) pipeline stage on one rank of its physical stage."""

    stage_index: int  # virtual stage index in schedule order (== physical when vpp == 1)
    physical_stage: int
    layers: tuple[LayerCost, ...]  # pre / blocks / post in execution order
    fwd_s: float  # per micro-batch
    bwd_s: float
    recompute_s: float
    comm_s: Mapping[str, float]  # exposed per micro-batch, by kind (pp p2p included)
    comm_total_s: Mapping[str, float]
    in_flight: float  # micro-batches whose activations the physical stage holds
    memory_bytes: Mapping[str, float]  # breakdown for this stage's share of its rank
    model_flops: float  # per micro-batch
    hardware_flops: float
    dense_params: float
    expert_params: float
    largest_block_params: float
    host_bytes: float = 0.0  # host memory of CPU-offloaded model states, this stage's share of its rank

    @property
    def time_s(self) -> float:
        """Seconds per micro-batch: compute + recomputation + exposed communication."""
        return self.fwd_s + self.bwd_s + self.recompute_s + sum(self.comm_s.values())


def num_virtual_stages(config: ParallelConfig) -> int:
    return config.pp * (config.vpp if config.schedule == "interleaved-1f1b" else 1)


def stage_layer_counts(num_layers: int, config: ParallelConfig) -> list[int]:
    """Blocks per virtual stage: `config.stage_layers`, else as even as possible with the
    extra blocks on the middle stages (stage 0 has the embedding, the last the head)."""
    stages = num_virtual_stages(config)
    if config.stage_layers is not None:
        return list(config.stage_layers)
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 2 else list(range(stages))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def stage_recompute_modes(count: int, config: ParallelConfig, stage_index: int) -> list[str]:
    """Recomputation per block of a stage: `stage_recompute` (full, selective) counts for the
    first blocks, else `config.recompute` for all."""
    if config.stage_recompute is None:
        return [config.recompute] * count
    full, selective = config.stage_recompute[stage_index]
    modes = ["full"] * full + ["selective"] * selective
    return (modes + ["none"] * count)[:count]


def partition(graph: ModelGraph, config: ParallelConfig) -> list[list[tuple[BlockInfo, str]]]:
    """(block, recompute) of every virtual stage, in schedule order."""
    blocks = graph.layer_blocks()
    out, start = [], 0
    for index, count in enumerate(stage_layer_counts(len(blocks), config)):
        modes = stage_recompute_modes(count, config, index)
        out.append(list(zip(blocks[start:start + count], modes)))
        start += count
    return out


def stage_cost(graph: ModelGraph, config: ParallelConfig, cluster, stage_index: int,
               layers: list[tuple[BlockInfo, str]], *, flash_attention: bool = True,
               runtime: Runtime = DEFAULT_RUNTIME, cache: CostCache | None = None) -> StageCost:
    """Cost of virtual stage `stage_index` running `layers` (block, recompute) on one rank.

    Stage 0 also runs the embedding (pre), the last virtual stage the head and loss (post).
    Memory: this stage's model states, its activations x micro-batches in flight on its
    physical stage (pipeline.microbatches_in_flight), pipeline send/recv buffers, the loss's
    memory on the last stage (memory.loss_bytes) and ZeRO-3 gather buckets.
    """
    stages = num_virtual_stages(config)
    physical = stage_index % config.pp
    costs: list[LayerCost] = []
    if stage_index == 0:
        costs.append(layer_cost(graph.pre, graph, config, cluster, "none", runtime=runtime, cache=cache))
    costs += [layer_cost(block, graph, config, cluster, mode, flash_attention=flash_attention,
                         runtime=runtime, cache=cache)
              for block, mode in layers]
    if stage_index == stages - 1:
        costs.append(layer_cost(graph.post, graph, config, cluster, "none", runtime=runtime, cache=cache))
    comm_s: dict[str, float] = {}
    comm_total: dict[str, float] = {}
    for c in costs:
        for k, v in c.comm_s.items():
            comm_s[k] = comm_s.get(k, 0.0) + v
        for k, v in c.comm_total_s.items():
            comm_total[k] = comm_total.get(k, 0.0) + v
    p2p = pp_p2p_s(graph, config, cluster, cache, runtime)
    if p2p:
        comm_s["pp"] = comm_total["pp"] = p2p
    in_flight = pipeline.microbatches_in_flight(config.schedule, config.pp, physical,
                                                config.num_microbatches, config.vpp)
    activations = (sum(c.activation_bytes for c in costs) * in_flight
                   + sum(c.cast_weight_bytes for c in costs))
    temporaries = 0.0
    if stage_index == stages - 1:
        loss = last_stage_loss_bytes(graph, config, runtime)
        activations += loss["activations"]
        temporaries = loss["temporaries"]
    largest = max((c.zero3_gather_params for c in costs), default=0.0)
    buffers = memory.pipeline_buffer_bytes(graph, config) + memory.zero3_buffer_bytes(largest, config)
    mem = {
        "parameters": sum(c.weight_bytes for c in costs),
        "gradients": sum(c.grad_bytes for c in costs),
        "optimizer": sum(c.optimizer_bytes for c in costs),
        "activations": activations,
        "buffers": buffers,
        "temporaries": temporaries,
    }
    return StageCost(
        stage_index=stage_index, physical_stage=physical, layers=tuple(costs),
        fwd_s=sum(c.fwd_s for c in costs), bwd_s=sum(c.bwd_s for c in costs),
        recompute_s=sum(c.recompute_s for c in costs),
        comm_s=MappingProxyType(comm_s), comm_total_s=MappingProxyType(comm_total),
        in_flight=in_flight, memory_bytes=MappingProxyType(mem),
        model_flops=sum(c.model_flops for c in costs),
        hardware_flops=sum(c.hardware_flops for c in costs),
        dense_params=sum(c.dense_params for c in costs),
        expert_params=sum(c.expert_params for c in costs),
        largest_block_params=max((c.dense_params + c.expert_params for c in costs), default=0.0),
        host_bytes=sum(c.host_bytes for c in costs),
    )


def pp_p2p_s(graph: ModelGraph, config: ParallelConfig, cluster, cache: CostCache | None = None,
             runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Receive of the activation in forward and of its gradient in backward per micro-batch
    (b*s*h per transfer, /t with the scatter/gather optimisation: Narayanan et al. 2021 §4.1),
    with what the runtime hands on beside it (volume.pp_side_traffic; the cuts of a stack of
    like blocks hand on alike, and stage 0's, in the model's own dtype, are the largest).
    Megatron overlaps them only partly; counted as exposed."""
    if config.pp <= 1:
        return 0.0
    fabric, groups = fabric_and_groups(config, cluster, cache)
    hidden = volume.pp_boundary_bytes(graph, config, runtime.fp32_module_weights)
    forward = back = hidden
    if runtime.pp_hands_on_side_values:
        sent, grads = volume.pp_side_traffic(graph, config, 0, True, runtime.fp32_module_weights)
        forward, back = hidden + sum(sent.values()), hidden + sum(grads.values())
    return (comm.p2p_time_s(forward, groups.pp_cross_node, fabric)
            + comm.p2p_time_s(back, groups.pp_cross_node, fabric))


def last_stage_loss_bytes(graph: ModelGraph, config: ParallelConfig, runtime: Runtime) -> dict[str, float]:
    """memory.loss_bytes as `runtime` runs the loss. A pipeline schedule
    (torch.distributed.pipelining) keeps each stage's output until that micro-batch's
    backward, so the last stage keeps its logits whatever the runtime's own step does."""
    return memory.loss_bytes(graph, config, keeps_logits=runtime.loss_keeps_logits or config.pp > 1,
                             fused_vocab_cross_entropy=runtime.fused_vocab_cross_entropy)
