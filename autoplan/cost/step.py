"""Step time from stage costs: steady state x micro-batches, pipeline bubble, DP sync, optimizer.

- Steady state + bubble: the slowest physical stage sets the pace; a flush costs
  (m + bubble_stage_times) x its time per micro-batch (Narayanan et al. 2021 Eq. 1;
  the "(m-1) x max stage" form of Alpa/Metis/Galvatron for balanced stages).
- DP gradient sync: all-reduce (ZeRO-0) or reduce-scatter + all-gather of the updated
  weights (ZeRO-1/2, Megatron distributed optimizer) of each rank's parameters, started
  bucket by bucket during the last micro-batch's backward: only what that backward cannot
  hide, and at least the last bucket (one block), is exposed (PyTorch DDP, Li et al. 2020
  §3.2.3; Megatron --overlap-grad-reduce). ZeRO-3 syncs per micro-batch, ZeRO-2 reduce-
  scatters per micro-batch and gathers the weights here (layers.py).
- Tied embedding under a pipeline: the first and the last stage sum their copies' gradients
  with one all-reduce over the two pipeline ranks after the backward, exposed (Megatron-LM's
  embedding group; runtime/pipeline.py sum_tied_grads).
- Optimizer: Adam is memory-bound; it reads and writes the fp32 master weight, momentum
  and variance (8 B each way), reads the 16-bit gradient and writes the 16-bit weight. With
  optimizer offload it runs on the CPU after the gradients' copy to the host (offload.py).
- Overlap is not free: the DP sync that backward hides still slows it (comm.contended_exposed_s).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

from autoplan.config import ParallelConfig
from autoplan.cost import comm, hw, memory, offload, pipeline, volume
from autoplan.cost.layers import DEFAULT_RUNTIME, Runtime, expert_state_layout, fsdp_pipeline_unsharded
from autoplan.cost.stages import StageCost, num_virtual_stages
from autoplan.trace.graph import ModelGraph

ADAM_UPDATE_BYTES_MIXED = 3 * 4 * 2 + 2 + 2  # fp32 master/m/v read+write, grad read, weight write
ADAM_UPDATE_BYTES_FP32 = 3 * 4 * 2 + 4  # weight/m/v read+write, grad read
# AdamW issued op by op over fp32 parameters, gradients and states (Composer's
# DecoupledAdamW.adamw, composer/optim/decoupled_weight_decay.py, llm-foundry's `decoupled_adamw`):
# each tensor op is a kernel that reads its operands and writes its result, 4 B each:
# exp_avg.mul_ (8) .add_(grad) (12), exp_avg_sq.mul_ (8) .addcmul_(grad, grad) (12), sqrt (8),
# / sqrt(bias_correction2) (8), .add_(eps) (8), param.addcdiv_(exp_avg, denom) (16). The
# decoupled weight decay's param.mul_ is skipped at weight_decay 0, as llm-foundry's MPT
# yamls set it (scripts/train/yamls/pretrain/mpt-*.yaml). torch's foreach AdamW
# (torch/optim/adamw.py _multi_tensor_adamw) moves the same 80 B with weight decay on:
# _foreach_mul_(params) (8), _foreach_lerp_(exp_avgs, grads) (12), _foreach_mul_ (8) and
# _foreach_addcmul_ (12) of exp_avg_sqs, _foreach_sqrt (8), _foreach_div_ (8), _foreach_add_
# (8), _foreach_addcdiv_(params, exp_avgs, denom) (16).
ADAM_UPDATE_BYTES_PER_OP = 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16


@dataclass(frozen=True)
class StepTime:
    step_s: float
    compute_s: float  # forward + backward + optimizer on the critical path
    recompute_s: float
    exposed_comm_s: float
    bubble_s: float
    bubble_fraction: float
    dp_sync_s: float  # exposed DP gradient/weight sync
    optimizer_s: float
    comm_breakdown_s: Mapping[str, float]  # exposed seconds per step, by kind
    stage_time_s: tuple[float, ...]  # per physical stage, per micro-batch
    bottleneck_stage: int


def rank_stage_times(stage_costs: Sequence[StageCost], pp: int) -> list[float]:
    """Seconds per micro-batch of every physical stage (sum of its virtual stages)."""
    times = [0.0] * pp
    for s in stage_costs:
        times[s.physical_stage] += s.time_s
    return times


def dp_sync_s(stages: Sequence[StageCost], config: ParallelConfig, cluster,
              runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Exposed DP sync of one physical stage's parameters after the last micro-batch."""
    if config.zero_stage >= 3:
        return 0.0
    fabric = hw.fabric(cluster)
    groups = comm.config_groups(config.tp, config.cp, config.dp, config.pp, config.ep, fabric)
    if groups.dp.size <= 1 and groups.expert_dp.size <= 1:
        return 0.0
    w = memory.synced_weight_bytes_per_param(config.precision, config.zero_stage,
                                             runtime.fp32_module_weights)
    g = memory.grad_reduce_bytes_per_param(config.precision)
    dense = sum(s.dense_params for s in stages)
    expert = sum(s.expert_params for s in stages)
    per_microbatch_scatter = config.zero_stage == 2 and not fsdp_pipeline_unsharded(config)

    def sync(dense_params: float, expert_params: float) -> float:
        if config.zero_stage == 0:
            return (comm.allreduce_time_s(dense_params * g, groups.dp, fabric)
                    + comm.allreduce_time_s(expert_params * g, groups.expert_dp, fabric))
        # reduce-scatter the gradients (ZeRO-2 outside a pipeline did so per micro-batch:
        # layers.zero2_comm_s), all-gather the updated 16-bit weights
        scatter = 0.0 if per_microbatch_scatter else comm.dp_allgather_time_s(
            dense_params, expert_params, g, groups, fabric)
        return scatter + comm.dp_allgather_time_s(dense_params, expert_params, w, groups, fabric)

    total = sync(dense, expert)
    largest = max(s.largest_block_params for s in stages)
    share = expert / (dense + expert) if dense + expert else 0.0
    last_bucket = sync(largest * (1 - share), largest * share)
    window = sum(s.bwd_s for s in stages)
    # what backward hides still slows it (comm.contended_exposed_s)
    return comm.contended_exposed_s(total, max(total - window, last_bucket))


def tied_sync_s(stages: Sequence[StageCost], config: ParallelConfig, cluster, graph: ModelGraph) -> float:
    """The all-reduce of a tied embedding's gradient on a rank holding the first or the last
    stage (volume.tied_grad_traffic): over 2 ranks, pp - 1 pipeline ranks apart (Megatron rank
    order tp, cp, dp, pp), after the backward, so nothing hides it."""
    last = num_virtual_stages(config) - 1
    if config.pp <= 1 or not volume.tied_head(graph) \
            or not any(s.stage_index in (0, last) for s in stages):
        return 0.0
    fabric = hw.fabric(cluster)
    span = comm.group_span(2, (config.pp - 1) * config.tp * config.cp * config.dp, fabric.scaleup_domain)
    return comm.allreduce_time_s(volume.tied_grad_bytes(graph, config), span, fabric)


def adam_update_bytes_per_param(precision: str, optimizer_kernels: str = "fused") -> int:
    """HBM bytes one AdamW update moves per parameter: one fused pass over the states, or
    a pass per tensor op (Runtime.optimizer_kernels)."""
    if optimizer_kernels == "per-op":
        return ADAM_UPDATE_BYTES_PER_OP
    return ADAM_UPDATE_BYTES_FP32 if precision == "fp32" else ADAM_UPDATE_BYTES_MIXED


def optimizer_s(stages: Sequence[StageCost], config: ParallelConfig, cluster,
                runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Adam step on one rank's (sharded) parameters, memory-bound; with optimizer offload the
    ZeRO-Offload step instead (gradients to host, CPU Adam, weights back: offload.py)."""
    dense = sum(s.dense_params for s in stages)
    expert = sum(s.expert_params for s in stages)
    if config.zero_stage >= 1:
        dense /= config.dp_shard * config.cp
        expert /= expert_state_layout(config, runtime)[1]
    per_param = adam_update_bytes_per_param(config.precision, runtime.optimizer_kernels)
    if config.offload == "both" and config.zero_stage >= 2:
        # FSDP2's CPUOffloadPolicy: the gradient shards reach the host and the updated weight
        # shards the GPU with the per-block copies of every micro-batch (layers.param_offload_comm_s);
        # the step itself is the CPU AdamW
        return offload.cpu_adam_s(dense + expert, per_param, cluster.gpu)
    if config.offload in ("optimizer", "both"):
        w = memory.weight_bytes_per_param(config.precision)
        return offload.optimizer_offload_s(dense + expert, w, w, per_param,
                                           sum(s.bwd_s for s in stages), cluster.gpu)
    return (dense + expert) * per_param / hw.hbm_bytes_per_s(cluster.gpu)


def step_time_s(stage_costs: Sequence[StageCost], config: ParallelConfig, cluster,
                graph: ModelGraph, runtime: Runtime = DEFAULT_RUNTIME) -> StepTime:
    """Step time of one optimizer step from the stages' per-micro-batch costs."""
    m = config.num_microbatches
    times = rank_stage_times(stage_costs, config.pp)
    bottleneck = max(range(config.pp), key=lambda r: times[r])
    t_max = times[bottleneck]
    bubble = pipeline.bubble_stage_times(config.schedule, config.pp, config.vpp) * t_max
    tails = []
    for r in range(config.pp):
        mine = [s for s in stage_costs if s.physical_stage == r]
        tails.append((dp_sync_s(mine, config, cluster, runtime), tied_sync_s(mine, config, cluster, graph),
                      optimizer_s(mine, config, cluster, runtime)))
    dp_exposed, tied, opt = max(tails, key=sum)
    mine = [s for s in stage_costs if s.physical_stage == bottleneck]
    fwd_bwd = sum(s.fwd_s + s.bwd_s for s in mine)
    recompute = sum(s.recompute_s for s in mine)
    kinds: dict[str, float] = {}
    for s in mine:
        for k, v in s.comm_s.items():
            kinds[k] = kinds.get(k, 0.0) + m * v
    if dp_exposed:
        kinds["dp"] = kinds.get("dp", 0.0) + dp_exposed
    if tied:
        kinds["tied"] = tied
    exposed = sum(kinds.values())
    step = m * t_max + bubble + dp_exposed + tied + opt
    return StepTime(
        step_s=step, compute_s=m * fwd_bwd + opt, recompute_s=m * recompute,
        exposed_comm_s=exposed, bubble_s=bubble,
        bubble_fraction=bubble / step if step else 0.0, dp_sync_s=dp_exposed, optimizer_s=opt,
        comm_breakdown_s=MappingProxyType(kinds), stage_time_s=tuple(times),
        bottleneck_stage=bottleneck,
    )
