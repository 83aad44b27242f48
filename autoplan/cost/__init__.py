"""Cost model: pure functions from (ModelGraph, ParallelConfig, Cluster) to time and memory.

Public API (seconds, bytes, FLOP/s; `*_gib` only in the Estimate shown to users):
    estimate(graph, config, cluster, *, flash_attention=True, runtime=Runtime()) -> Estimate
    estimate_partition(graph, config, cluster, stages_layers) -> Estimate
    layer_cost(block, graph, config, cluster, recompute) -> LayerCost   (per micro-batch / per rank)
    stage_cost(graph, config, cluster, stage_index, layers) -> StageCost
    step_time_s(stage_costs, config, cluster, graph) -> StepTime
    partition(graph, config) -> [[(BlockInfo, recompute)] per virtual stage]
    check_config(graph, config, cluster)   (UserError on an inconsistent configuration)
    CostCache()   what a search passes as `cache=` to reuse per-block costs (cache.py)
Modules: memory (ZeRO/Korthikanti), compute (GEMM/attention/memory-bound roofline),
comm (alpha-beta collectives), pipeline (bubbles, in-flight micro-batches), offload (host
copies, CPU Adam), host (host-bound dropless MoE layers), hw (the only reader of hardware numbers).

`estimate` is built from `stage_cost` and `step_time_s`, which are built from `layer_cost`;
a solver that sums layer and stage costs for a partition reproduces `estimate` exactly.
"""

from autoplan.cost.cache import CostCache
from autoplan.cost.estimate import Estimate, assemble, check_config, estimate, estimate_partition
from autoplan.cost.layers import LayerCost, Runtime, layer_cost
from autoplan.cost.stages import StageCost, partition, stage_cost, stage_layer_counts
from autoplan.cost.step import StepTime, step_time_s

__all__ = [
    "CostCache", "Estimate", "LayerCost", "Runtime", "StageCost", "StepTime", "assemble", "check_config", "estimate",
    "estimate_partition", "layer_cost", "partition", "stage_cost", "stage_layer_counts",
    "step_time_s",
]
